"""Victim processes for SHARE_STATS tests; each prints "ready PID" and waits.

  victim.py family SIZE N   touch SIZE bytes of anonymous memory, fork N
                            children sharing it copy-on-write; SIGUSR1 makes
                            a process rewrite the first half ("rewrote PID")
  victim.py file PATH SIZE [twice]
                            map PATH shared and write every page; "twice"
                            maps it at a second address as well
  victim.py zero SIZE       map anonymous memory and only read it, so every
                            page maps the (huge) zero page
SIGTERM to the first process kills and reaps the whole family.

Signals are blocked and taken with sigwaitinfo(): a Python handler around
signal.pause() can miss a signal that lands just before pause() starts.
"""
import mmap
import os
import signal
import sys

PAGE = mmap.PAGESIZE
WAITED = {signal.SIGUSR1, signal.SIGTERM}


def touch(buf, size, value):
    for off in range(0, size, PAGE):
        buf[off] = value


def family(size, nchildren):
    """Returns the mapping and the children (empty in a child)."""
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)  # huge pages even when THP is "madvise"
    touch(buf, size, 1)
    children = []
    for _ in range(nchildren):
        pid = os.fork()
        if pid == 0:
            return buf, []
        children.append(pid)
    return buf, children


def shared_file(path, size, twice):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    bufs = [mmap.mmap(fd, size, flags=mmap.MAP_SHARED) for _ in range(1 + twice)]
    for buf in bufs:
        touch(buf, size, 1)
    return bufs


def zero(size):
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    sum(buf[off] for off in range(0, size, PAGE))
    return buf


def main(argv):
    signal.pthread_sigmask(signal.SIG_BLOCK, WAITED)
    mode, args = argv[1], argv[2:]
    children = []
    if mode == "family":
        keep, children = family(int(args[0]), int(args[1]))
    elif mode == "file":
        keep = shared_file(args[0], int(args[1]), args[2:] == ["twice"])
    elif mode == "zero":
        keep = zero(int(args[0]))
    else:
        raise SystemExit(__doc__)
    os.write(1, b"ready %d\n" % os.getpid())
    while signal.sigwaitinfo(WAITED).si_signo == signal.SIGUSR1:
        touch(keep, len(keep) // 2, 2)
        os.write(1, b"rewrote %d\n" % os.getpid())
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main(sys.argv)
