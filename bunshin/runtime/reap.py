"""Waiting for a workspace's init to exit, whether or not we are its parent.

A created workspace's init is our child; a forked one is the child of its template's init. A
pidfd turns readable when its process exits in both cases; only a parent can reap it.
"""

from __future__ import annotations

import logging
import os
import signal

from ..fdwait import readable

log = logging.getLogger("bunshin.reap")


def wait_exit_pidfd(pidfd: int, timeout: float) -> bool:
    """True once the process behind ``pidfd`` has exited (works for non-children too)."""
    return readable(pidfd, timeout)


def reap_init(pidfd: int, *, is_child: bool, grace: float) -> None:
    """Give the process ``grace`` seconds to exit, then SIGKILL it; reap it if it is our child;
    close ``pidfd``."""
    if not wait_exit_pidfd(pidfd, grace):
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not wait_exit_pidfd(pidfd, 10):
            log.warning("an init did not exit within 10 s of SIGKILL")
            os.close(pidfd)
            return
    if is_child:
        try:
            os.waitid(os.P_PIDFD, pidfd, os.WEXITED)  # exited (its pidfd polled so): cannot block
        except ChildProcessError:
            pass
    os.close(pidfd)
