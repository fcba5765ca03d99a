"""Dumping a workspace's body (``dump``), a workspace (``dump_workspace``) or a template
(``save``) into an image directory."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import config
from ..compel import in_group_stop
from ..errors import CheckpointError
from ..fork.plan import proc_status
from . import bases, externals, handover, images, initfds, layerstore, runner, sandbox

if TYPE_CHECKING:
    from ..runtime.body import Body
    from ..runtime.template import Template
    from ..runtime.workspace import Workspace
    from ..runtime.workspace_config import WorkspaceConfig

#: ((pty index, bash pid, session id), master fd) of each shell session to dump
Terminals = list[tuple[tuple[int, int, str], int]]

log = logging.getLogger("bunshin.criu")


def _layers(body: Body) -> tuple[list[Path], list[str]]:
    """(the workspace's own layers, topmost first; the rootfs lowers below them)."""
    state = config.state_dir().resolve()
    store = layerstore.store_dir().resolve()
    own = [body.dir.upper]
    rootfs: list[str] = []
    for p in body.rootfs.lowers:
        rp = Path(p).resolve()
        if not rootfs and (rp == state or state in rp.parents) and rp.parent != store:
            own.append(Path(p))  # a template's layer: as ephemeral as the workspace
        else:
            rootfs.append(str(p))
    return own, rootfs


def _freezer_dir(body: Body) -> str | None:
    dirs = body.cgroup.dirs()
    for d in dirs:
        if "/freezer/" in d:
            return d
    return dirs[0] if len(dirs) == 1 else None  # v2: the one directory


def _own_hierarchies(init_pid: int) -> list[str]:
    """The cgroup hierarchies (named as in /proc/PID/cgroup) where the workspace has a group of
    its own, the only ones CRIU is to record. In the others it sits in the trainer's group,
    often the hierarchy's root, under which CRIU records every group, the host's passing ones
    too (podman's, probes): a restore that moves the tasks into existing groups (a sandbox's
    ``CG_NONE``) then fails for each one gone since."""
    def groups(pid: int | str) -> dict[str, str]:
        with open(f"/proc/{pid}/cgroup") as f:
            return dict(ln.rstrip("\n").split(":", 2)[1:] for ln in f)

    trainer = groups("self")
    return [h for h, path in groups(init_pid).items() if path != trainer.get(h)]


def dump_workspace(ws: Workspace, path: str | os.PathLike) -> dict:
    """Write ``ws``'s current state into ``path`` (new or empty directory); ``ws`` continues.

    Everything a restore needs: the process tree and its namespaces (CRIU), the workspace's
    own overlay layers (copied), its configuration and shell sessions. No tool call may run
    meanwhile (as for ``ws.snapshot()``). Returns the metadata written (``meta.json``).
    """
    with ws.steady("wait for them before dumping (their pipes lead to the trainer)"):
        return dump(ws.config, ws.body, ws.terminals(), path)


def dump(cfg: WorkspaceConfig, body: Body, terminals: Terminals, path: str | os.PathLike) -> dict:
    """Write a workspace's body, settings and shell sessions (``terminals``) into ``path`` (new
    or empty directory); nothing may use the body meanwhile. :func:`restore.restore` gives
    them back. Returns the metadata written."""
    if body.holds:
        raise CheckpointError(f"workspace {body.id} has live forks: their inits are children of its "
                              "init, which CRIU would take along (and cannot, in their own cgroups): "
                              "close them first, or save a snapshot (ws.snapshot().save(path))")
    info = runner.criu()
    start = time.perf_counter()
    existed = Path(path).exists()
    out = images.prepare(path)
    try:
        meta = _dump(cfg, body, terminals, out, info)
    except BaseException as e:
        if isinstance(e, CheckpointError):
            runner.keep_log(e, "dump")
        images.discard(out, keep_dir=existed)
        raise
    meta["dump_seconds"] = time.perf_counter() - start
    images.write_meta(out, meta)
    log.info("dumped workspace %s into %s in %.0f ms", body.id, out, meta["dump_seconds"] * 1e3)
    return meta


def _dump(cfg: WorkspaceConfig, body: Body, terminals: Terminals, out: Path, info) -> dict:
    idents = [ident for ident, _master in terminals]  # (pty index, bash pid, session id)
    masters = {ident[0]: master for ident, master in terminals}
    own, rootfs_lowers = _layers(body)
    init_pid = body.init_pid
    assert body.channel is not None
    prep = initfds.prepare(init_pid, body.channel.sock, masters)
    cg = body.cgroup
    try:
        cg.freeze()
        try:
            pids = cg.pids()
            _refuse_group_stopped(pids)
            _refuse_nested_userns(init_pid, pids)
            exts = externals.scan(init_pid, pids, body.dir.path, [body.dir.upper, *body.rootfs.lowers])
            binds = sandbox.device_binds(init_pid) if body.userns is not None else []
            for i, layer in enumerate(own):
                dst = images.layer_dir(out, i)
                dst.mkdir()
                layerstore.copy_layer(layer, dst)
            logfile = out / "criu" / "dump.log"
            opts = runner.options(info, pid=init_pid, log_file=logfile.name,
                                  leave_running=True, tcp_established=True, file_locks=True,
                                  network_lock=runner.rpc(info).SKIP)
            env = runner.environ()
            taken_by = handover.current().dump(opts, env, prep.stand_in_ino, exts, info)
            frz = _freezer_dir(body)
            if frz:
                opts.freeze_cgroup = frz
            opts.cgroup_dump_controller.extend(_own_hierarchies(init_pid))
            for point, host in sandbox.dump_binds(binds):
                opts.ext_mnt.add(key=point, val=host)
            images_fd = os.open(out / "criu", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                opts.images_dir_fd = images_fd  # CRIU opens it as /proc/<our pid>/fd/N
                runner.call(info, "dump", opts, what=f"CRIU dump of workspace {body.id}",
                            logfile=logfile, env=env)
            finally:
                os.close(images_fd)
            exts = handover.current().dumped(out / "criu", taken_by, exts, info)
        finally:
            cg.thaw()
    finally:
        initfds.undo(prep)
    return {
        "criu_version": runner.version_string(info),
        "workspace": body.id,
        "created": time.time(),
        "init_pid": init_pid,
        "processes": len(pids),
        "config": cfg.to_dict(),
        "shells": [[idx, pid, nonce, prep.master_fds[idx]] for idx, pid, nonce in idents],
        "ctl_socket_ino": prep.stand_in_ino,
        **taken_by,  # ctl_socket_by, files_by
        "externals": [e.to_dict() for e in exts],
        "device_binds": sorted({host for _point, host in binds}),
        "layers": len(own),
        "bases": bases.record(rootfs_lowers),
        "rootfs_source": str(body.rootfs.source),
        "init_binary": _init_binary(),
    }


def _named(pid: int) -> str | None:
    """``process VPID (comm)`` as the workspace names it; None once it is gone."""
    try:
        vpid = proc_status(pid)["NSpid"].split()[-1]
        with open(f"/proc/{pid}/comm") as f:
            return f"process {vpid} ({f.read().strip()})"
    except (OSError, KeyError):
        return None


def _refuse_nested_userns(init_pid: int, pids: list[int]) -> None:
    """CRIU dumps the user namespace of the workspace's init with its tree (a sandbox's own,
    or the host's) and no other: one a process made inside (``unshare -U``) stops the dump
    ("Can't dump nested user namespace"). Say which process, before CRIU starts."""
    own = os.stat(f"/proc/{init_pid}/ns/user").st_ino
    for pid in pids:
        try:
            if os.stat(f"/proc/{pid}/ns/user").st_ino == own:
                continue
        except OSError:
            continue  # gone meanwhile
        if (who := _named(pid)) is not None:
            raise CheckpointError(
                f"{who} is in a user namespace of its own, nested in the workspace's: CRIU "
                "dumps only the workspace's user namespace with its processes. End that "
                "process (and what it started in its namespace), then dump")


def _refuse_group_stopped(pids: list[int]) -> None:
    """CRIU seizes the processes of a frozen cgroup, and the attach to one stopped by a signal
    waits, uninterruptibly, for the thaw it would do only afterwards (compel.in_group_stop):
    it would give up after its timeout at best. Say so before it starts."""
    for pid in pids:
        if in_group_stop(pid) and (who := _named(pid)) is not None:
            raise CheckpointError(
                f"{who} is stopped by a signal (kill -STOP, a shell job "
                "suspended with Ctrl-Z): CRIU cannot dump a stopped process of a frozen "
                "workspace. Resume it (SIGCONT, fg) or end it, then dump; ws.fork() and "
                "ws.snapshot() keep it stopped")


def _init_binary() -> dict:
    from .. import _core

    p = Path(_core.init_path())
    st = p.stat()
    return {"path": str(p), "size": st.st_size}


def save(tpl: Template, path: str | os.PathLike) -> dict:
    """Write the frozen template ``tpl`` into ``path``: a fork of it is dumped, then closed (the
    template itself is never touched; its init has its children's inits as children, which CRIU
    would take along)."""
    kid = tpl.fork(1)[0]
    try:
        return dump_workspace(kid, path)
    finally:
        kid.close()


__all__ = ["CheckpointError", "dump", "dump_workspace", "save"]
