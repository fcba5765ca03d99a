"""holder: a python3 victim holding <MiB> of private memory.

usage: holder.py <outdir> <MiB>. Prints "ready"; then sleeps in a loop.
SIGUSR1: writes "<pid in the host namespace> <os.getpid()>" to <outdir>/pid.<host pid>.
SIGUSR2: writes one byte in every page of the buffer (a clone's memory diverges), then
         creates <outdir>/dirty.<host pid>.
"""
import os
import signal
import sys
import time

outdir, mib = sys.argv[1], int(sys.argv[2])
buf = bytearray(os.urandom(1 << 20)) * mib


def host_pid():
    return int(os.readlink("/proc/self"))


def on_usr1(sig, frame):
    with open(os.path.join(outdir, f"pid.{host_pid()}.tmp"), "w") as f:
        f.write(f"{host_pid()} {os.getpid()}\n")
    os.rename(os.path.join(outdir, f"pid.{host_pid()}.tmp"), os.path.join(outdir, f"pid.{host_pid()}"))


def on_usr2(sig, frame):
    for i in range(0, len(buf), 4096):
        buf[i] ^= 0xFF
    open(os.path.join(outdir, f"dirty.{host_pid()}"), "w").close()


signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGUSR2, on_usr2)
print("ready", flush=True)
while True:
    time.sleep(0.05)
