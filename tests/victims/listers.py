"""listers: 4 threading.Thread workers append to one list and record
threading.get_native_id() in `ids`. On SIGUSR1 the main thread writes
{"pid", "len", "ids"} as JSON to <path> (write, then rename) and clears `ids`, so the next
report shows only ids recorded since. Every thread blocks SIGUSR1 and the main thread
takes it with sigwait.
usage: listers.py <path>; prints "ready <pid>"."""

import json
import os
import signal
import sys
import threading
import time

path = sys.argv[1]
items: list[int] = []
ids: dict[int, int] = {}


def work(i: int) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    while True:
        ids[i] = threading.get_native_id()
        items.append(i)
        time.sleep(0.001)


def report() -> None:
    seen = sorted(set(ids.values()))
    ids.clear()
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "len": len(items), "ids": seen}, f)
    os.rename(tmp, path)


# Blocked everywhere and taken with sigwait: a handler would only run when the signal happens
# to land on the main thread, and a clone's first signal may not.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
for i in range(4):
    threading.Thread(target=work, args=(i,), daemon=True).start()
while len(ids) < 4:
    time.sleep(0.01)
print("ready", os.getpid(), flush=True)
while True:
    signal.sigwait({signal.SIGUSR1})
    report()
