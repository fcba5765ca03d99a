"""Forking, snapshots, rollback and speculation of a :class:`Workspace` (the methods live here
to keep workspace.py about running one workspace; the engine is in bunshin/fork/)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Callable

from .. import config
from ..errors import BunshinError, ForkError, WorkspaceClosed
from .channel import Channel
from .state import Meta, own_start_time

if TYPE_CHECKING:
    from ..fork.template import Template
    from .rootfs.model import Rootfs
    from ..speculate.block import Speculation
    from .workspace import Workspace

_O_PATH = getattr(os, "O_PATH", 0o10000000)
log = logging.getLogger("bunshin.fork")


def rebase_enabled() -> bool:
    """``BUNSHIN_REBASE=0``: a workspace at the pid-namespace nesting limit is not moved back
    to the top level (ForkingMixin._rebase_if_deep); its next snapshot fails instead."""
    return config.rebase()


def _child_rootfs(core) -> "Rootfs":
    """What each child's ``ws.rootfs`` says: made (and its layers checked, ~0.3 ms) once per
    template or CRIU origin, whose layers never change."""
    from .rootfs.model import Rootfs

    rf = getattr(core, "child_rootfs", None)
    if rf is None:
        rf = core.child_rootfs = Rootfs(lowers=tuple(core.lowers), kind="fork",
                                        source=f"fork of {core.id}")
    return rf


def child_meta(core, d, cg, init_pid: int) -> Meta:
    """What a fork's child's meta file says (written at the fork, or ahead with its init)."""
    return Meta(id=d.id, owner_pid=os.getpid(), owner_start=own_start_time(), init_pid=init_pid,
                cgroup=cg.name, rootfs=_child_rootfs(core).source,
                lowers=[str(p) for p in core.lowers], parent=core.id)


def _cannot_rebase(ws: "Workspace", limit: int, why: str) -> str:
    return (f"workspace {ws.id} is at the kernel's limit of {limit} nested pid namespaces and "
            f"cannot be moved back to the top level through CRIU: {why}. Snapshot once "
            "(tpl = ws.snapshot()) and use tpl.fork() or ws.restore(tpl) instead of snapshotting "
            "a fork of a fork")


def _not_dumpable(ws: "Workspace") -> str | None:
    """Why CRIU would refuse the workspace, known without trying: a process whose session
    leader is outside its pid namespace (a shell's job started before a fork: its clone keeps
    the template's session, README "Forking"), which CRIU cannot dump."""
    from ..fork.plan import proc_status

    for hp in ws.host_pids():
        try:
            st = proc_status(hp)
        except OSError:
            continue
        if st.get("NSsid", "1").split()[-1] == "0" and st["NSpid"].split()[-1] != "1":
            return (f"process {st['NSpid'].split()[-1]} ({st.get('Name', '?')}) is in a session "
                    "whose leader is outside the workspace (a job its shell started before a fork)")
    return None


class ForkingMixin:
    """fork / snapshot / restore / speculate for Workspace."""

    def fork(self, n: int = 1, on_fork: Callable[["Workspace"], None] | None = None) -> list["Workspace"]:
        """``n`` live copies of this workspace: every process (same PIDs), file and terminal,
        memory shared copy-on-write. This workspace keeps running, unchanged for the agent.
        ``on_fork(child)`` runs once per child before its processes resume, in the fork engine's
        thread (bunshin/fork/keeper.py): it must not wait for a fork made by another thread
        (forks run there one at a time; calling fork() from on_fork is fine for another
        workspace)."""
        from ..fork.template import _check_n

        _check_n(n)
        tpl, kids = self._snapshot(n, on_fork)
        tpl.close()
        return kids

    def snapshot(self) -> "Template":
        """Freeze this workspace's current state as a :class:`bunshin.Template` (forkable many
        times). The workspace continues, as a fresh fork of the template."""
        return self._snapshot(0, None)[0]

    def _snapshot(self, n: int, on_fork) -> tuple["Template", list["Workspace"]]:
        """snapshot() and ``n`` more forks of the template in one pass over its processes (one
        seize and release for all): the first fork becomes this workspace."""
        from ..fork import slots
        from ..fork.template import Template, snapshot_parts

        self._rebase_if_deep()
        with self._close_lock:
            self._live_chan()
            if self._calls:
                raise ForkError(f"workspace {self.id}: {self._calls} tool call(s) running; their output "
                                "pipes lead to this process and cannot be forked: wait for them")
            shells = [sh._identity() for sh in list(self._shells) if sh.alive]
            config = {"env": self._env, "workdir": self._workdir, "max_output": self._max_output,
                      "limits": self._limits, "hostname": self._hostname,
                      "run_shell": self._run_shell}
            parts = self._parts()
            core = snapshot_parts(parts, config, shells)  # freezes; raises with parts untouched
            core.spares = self.__dict__.get("_spares")
            first = [True]

            def hook(kid: "Workspace") -> None:
                if first[0]:  # this workspace's own continuation: not a user's child
                    first[0] = False
                elif on_fork is not None:
                    on_fork(kid)

            try:
                # a snapshot's template is forked again: its processes stay seized for that
                kids = core.fork(1 + n, hook, keep=n == 0)
            except BaseException:
                core.closed = True  # the parts go back to this workspace, alive
                parts["cg"].thaw()
                raise
            core.masters = self._adopt(kids[0])
            core.spares = None
            if slots.enabled():  # the next ws.fork()/snapshot()'s directories and cgroups
                if "_spares" not in self.__dict__:
                    self._spares = slots.Spares(self._limits, f"workspace {self.id}")
                slots.request(self._spares, 1 + n)
            return Template(core), kids[1:]

    def _rebase_if_deep(self) -> None:
        """Each snapshot moves the workspace one pid namespace down (it continues as a fork of
        the template, and a clone can only be made below its source), and the kernel stops at
        32 levels. At the limit the workspace goes back to the top level first: a CRIU dump and
        restore into this same object (the same PIDs, files, shells and memory contents; its
        memory is no longer shared with earlier templates; ~0.3 s here, once every 31
        snapshots; the images go to /dev/shm for that while). Where CRIU cannot (_not_dumpable,
        no usable CRIU, a failed dump or restore) a ForkError says why and the workspace runs
        on; with ``BUNSHIN_REBASE=0`` the snapshot refuses with engine.check_depth's error."""
        from ..fork import engine

        with self._close_lock:
            self._live_chan()  # a closed workspace says so, as the snapshot would
            if not engine.too_deep(self.init_pid) or not rebase_enabled():
                return
        from .. import criu

        why = _not_dumpable(self)
        if why is not None:
            raise ForkError(_cannot_rebase(self, engine.MAX_PID_NS_LEVEL, why), step="depth")
        start = time.perf_counter()
        scratch = tempfile.mkdtemp(prefix="bunshin-rebase-",
                                   dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            images = os.path.join(scratch, "images")
            criu.dump_workspace(self, images)
            kid = criu.restore_workspace(images)
        except BunshinError as e:
            raise ForkError(_cannot_rebase(self, engine.MAX_PID_NS_LEVEL, str(e)), step="depth") from e
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self._become(kid)
        log.info("workspace %s: moved back to the top pid namespace level (CRIU) in %.0f ms",
                 self.id, (time.perf_counter() - start) * 1e3)

    def restore(self, tpl: "Template") -> None:
        """Roll back: this workspace becomes a fresh fork of ``tpl`` (the same object; shell
        sessions that existed in the template continue in their template state)."""
        self._become(tpl.fork(1)[0])

    def _become(self, kid: "Workspace") -> None:
        """This workspace (the same object, its Shell objects rebound) becomes ``kid``, a fork;
        its previous processes, cgroup and files are torn down. ``kid`` is spent."""
        with self._close_lock:
            if self._closed:
                kid.close()
                raise WorkspaceClosed(f"workspace {self.id} is closed")
            old = type(self)()
            old.__dict__.update({k: v for k, v in self.__dict__.items()
                                 if k not in ("_close_lock", "_closed", "_spares")})
            old._closed = False
            old._shells = []
            masters = self._adopt(kid)
        for m in masters:
            os.close(m)
        old._teardown()

    def _parts(self) -> dict:
        return {"dir": self._dir, "cg": self._cg, "init_pid": self.init_pid, "pidfd": self._pidfd,
                "init_is_child": self._init_is_child, "chan": self._chan, "root_fd": self._root_fd,
                "rootfs": self.rootfs, "template": self._template}

    def _adopt(self, kid: "Workspace") -> list[int]:
        """Take over ``kid``'s live parts (it is a fork of our own template); ``kid`` is spent.
        Returns the pty masters of our previous shells, for the caller to keep or close."""
        from .workspace import _live

        _live.discard(kid)
        mine = {sh.pid: sh for sh in self._shells}
        old_masters = []
        self._shells = []
        for ksh in kid._shells:
            sh = mine.pop(ksh.pid, None)
            if sh is None:
                sh = ksh
            else:
                old_masters.append(sh._rebind(ksh))
            sh._ws = self
            self._shells.append(sh)
        for sh in mine.values():
            if sh._master >= 0:
                old_masters.append(sh._master)
                sh._master = -1
            sh._exited = True
        for k in ("_dir", "id", "rootfs", "_cg", "init_pid", "_pidfd", "_init_is_child", "_chan",
                  "_root_fd", "_template", "_meta", "_run_shell"):
            setattr(self, k, getattr(kid, k))
        kid._closed = True
        kid._shells = []
        return old_masters

    @classmethod
    def _from_fork(cls, core, d, cg, init_pid: int, pidfd: int, chan: Channel, masters: dict,
                   hostname: str, meta: Meta | None = None) -> "Workspace":
        """The Workspace of a fork's child; ``meta``: its meta file, written already."""
        from .shell import Shell

        cfg = core.config
        self = cls()
        self._closed = False
        self._env, self._workdir, self._max_output = cfg["env"], cfg["workdir"], cfg["max_output"]
        self._limits, self._hostname, self._run_shell = cfg["limits"], hostname, cfg["run_shell"]
        self._shell_lock = threading.Lock()
        self._calls = 0
        self._dir, self.id, self._cg = d, d.id, cg
        self.rootfs = _child_rootfs(core)
        self.init_pid, self._pidfd, self._init_is_child, self._chan = init_pid, pidfd, False, chan
        self._template = core
        if meta is None:
            meta = child_meta(core, d, cg, init_pid)
            d.write_meta(meta)
        self._meta = meta
        self._root_fd = os.open(f"/proc/{init_pid}/root", _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._shells = [Shell._forked(self, masters[idx], pid, nonce)
                        for idx, pid, nonce in core.shells if idx in masters]
        from .workspace import _live

        _live.add(self)
        return self


    def speculate(self) -> "Speculation":
        """``with ws.speculate() as spec:`` run calls on ``spec.ws``, a fork; leaving the block
        keeps their state in this workspace, ``spec.rollback()`` or an exception drops it
        exactly (see :mod:`bunshin.speculate.block`)."""
        from ..speculate.block import Speculation

        return Speculation(self)

