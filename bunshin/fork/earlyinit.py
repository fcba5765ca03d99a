"""A child's init cloned ahead, into a slot of a template the engine holds.

The first step of every child is cloning the template's init into fresh namespaces and letting
it move into the child's root (engine.clone_init): ~0.35 ms of a small fork here, plus the
wait for the move and the start of the channel's reader thread. Nothing of it depends on the
moment of the fork: the template is frozen, and the slot (state directory, cgroup, overlay
root) is made ahead already. So while the trainer does something else, the engine's thread
clones the init into each new slot of a template it holds (thaw, clone, refreeze), and a fork
that takes such a slot starts with its init running in its root.

Two more pieces of the child are made with it: the masters of its shell ptys (in its devpts,
with the template's terminal settings) and, without the kernel module, the intermediate each
template process's clone goes through (engine.make_mid: a stopped CLONE_VM child of that
process in the child's pid namespace, moved into the child's cgroup, so that the clone made
from it is born there). The intermediates share the template's memory and are traced by
the engine's thread, so they live only while the template is held: letting go kills and
reaps them first (drop_mids), and the fork clones through a new one.

An init made ahead and never used is shut down with its slot: its channel closes, it exits,
and it is reaped like any closed child's (seize.ignore_children).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import config
from ..compel import Tracee
from ..errors import BunshinError, ForkError
from ..runtime.channel import Channel
from ..runtime.statedir import Meta
from ..runtime.reap import wait_exit_pidfd
from . import cloners, engine
from .resources import ptys

log = logging.getLogger("bunshin.fork")

if TYPE_CHECKING:
    from .seize import Pinned
    from .slots import Slot


def enabled() -> bool:
    """``BUNSHIN_EARLY_INIT=0``: every fork clones its children's inits itself."""
    return config.early_init()


@dataclass
class EarlyInit:
    """A child's init, the trainer's end of its channel and its pidfd: cloned ahead into a slot
    (then running in the slot's root), or by the fork itself."""

    ci: Tracee  # detached: only its pid and threads are used
    chan: Channel
    pidfd: int
    meta: Meta | None = None  # the child's meta file, once written (settle)
    masters: dict[int, int] = field(default_factory=dict)  # its shell ptys' masters (settle)
    # the intermediates of its processes' clones, by template process (make_mids); they exist
    # only while the template is held, which drops them (drop_mids) before letting go
    mids: dict[int, Tracee] = field(default_factory=dict)

    def discard(self) -> None:
        """Shut it down (the slot is being destroyed unused)."""
        for m in self.masters.values():
            os.close(m)
        self.masters = {}
        self.chan.close()
        try:
            os.kill(self.ci.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wait_exit_pidfd(self.pidfd, 5)
        os.close(self.pidfd)


def start(tinit: Tracee, tpl_sock, mount_fd: int, hostname: str, cg, pin: Pinned,
          name: str) -> EarlyInit:
    """A child's init (engine.clone_init) with its pidfd and channel, ahead of a fork or in
    one; ``mount_fd`` stays the caller's. On failure nothing of the init is left."""
    ci, sock = engine.clone_init(tinit, tpl_sock, mount_fd, hostname, cg, pin)
    return EarlyInit(ci, Channel(sock, name), pidfd_of(ci, sock))


def pidfd_of(ci: Tracee, sock) -> int:
    """A pidfd of a child's init let go running (``sock``: the trainer's end of its control
    socket); on failure the init is killed and ``sock`` closed."""
    try:
        return os.pidfd_open(ci.pid)
    except BaseException:
        sock.close()
        os.kill(ci.pid, signal.SIGKILL)
        raise


def clone_into(slot: Slot, tinit: Tracee, tpl_sock, hostname: str, pin: Pinned) -> EarlyInit:
    """Clone the (thawed, held) template init into ``slot`` and start its move into the root;
    the slot's mount fd goes to the init. On failure nothing is left but the slot."""
    ei = start(tinit, tpl_sock, slot.mount_fd, hostname, slot.cg, pin, f"workspace {slot.dir.id}")
    os.close(slot.mount_fd)
    slot.mount_fd = -1
    return ei


def settle(ei: EarlyInit, core, slot: Slot, pin: Pinned) -> None:
    """Wait for the init to be in its root, give it back its CPUs (clone_init let it go on
    the others only, beside the engine), open the masters of the child's shell ptys in its
    devpts (~0.15 ms a fork) and write the child's meta file (~0.1 ms)."""
    ei.chan.wait_ready(10)
    pin.release_clone(core.body.init_pid, ei.ci)
    slaves = f"/proc/{core.body.init_pid}/root/dev/pts"
    for index in core.trainer_ptys():
        ei.masters[index] = ptys.open_master(ei.ci.pid, index, f"{slaves}/{index}")
    meta = core.child_meta(slot.dir, slot.cg, ei.ci.pid)
    slot.dir.write_meta(meta)
    ei.meta = meta


def make_mids(ei: EarlyInit, core, tracees: dict, cg) -> None:
    """The intermediate each template process's clone goes through without the kernel
    module (engine.make_mid), made for this child ahead of its fork by the Cloner that
    clones so (cloners.Injection): one injected clone less per process in the fork (~0.2 ms
    here). The template must be thawed.

    Each goes into the child's cgroup ``cg``, so the clone made from it is born there: the
    fork moves it no more (~0.2 ms: one write per hierarchy), and neither it nor its
    threads count against the template's pids limit. Where the child's limit could not hold
    them beside its clones (mids_fit, the caller's check), or a limit refuses one (EAGAIN),
    none is made for this child: its fork makes its own."""
    try:
        cloners.cloner().make_mids(ei.mids, core, tracees, ei.ci.pid, cg)
    except ForkError as e:
        if e.errno != errno.EAGAIN:
            raise
        log.info("template %s: no intermediates made ahead (a pids limit): %s", core.id, e)
        drop_mids(ei.mids, tracees)


def mids_fit(core) -> bool:
    """Whether a child's cgroup can hold its intermediates made ahead: until the fork has
    cloned through them all, they are there beside its clones (at most the template's tasks
    and one intermediate per other process)."""
    limit = core.config.limits.pids
    return limit is None or sum(len(pl.threads) for pl in core.plans) + len(core.plans) - 1 <= limit


def drop_mids(mids: dict[int, Tracee], tracees: dict) -> None:
    """Kill the intermediates made ahead (``{template pid: intermediate}``, emptied) and reap
    each in its template process (thawed, held in ``tracees``) unless the kernel did: their
    zombies would keep the child's pid namespace from ever ending."""
    while mids:
        hostpid, mid = mids.popitem()
        dead: list[int] = []
        try:
            engine.end_mid(mid, dead)
            if dead:
                engine.reap_in(tracees[hostpid], dead)
        except (BunshinError, OSError) as e:  # a template process gone: the fork says so
            log.warning("an intermediate made ahead for %d: %s", hostpid, e)
