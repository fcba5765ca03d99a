"""Restoring images: ``restore`` gives back what ``dump.dump`` wrote, a running body with its
settings and shell sessions (bunshin/criu/workspaces.py makes a Workspace or Template of it).

Each restore gets its own state directory, cgroup and overlay (copies of the image's layers,
in the state file system, as read-only lowers under a fresh upper: overlayfs refuses a lower
nested in another, and the host's root is one), so the images are only read and one directory
serves any number of restores, concurrently too. CRIU is asked through pycriu's RPC
(``RESTORE``), by a ``criu swrk`` worker that runs in a private mount namespace
(``unshare -m``) holding that overlay, moved into the new cgroup before it execs, so the
restored tasks are charged to the workspace from their first page. The worker is the trainer's
child and ``rst_sibling`` makes the restored init its sibling: the trainer's child, as a
created workspace's is. The control socket is a new socketpair and the host files the workspace used (``/dev/null``,
the init binary, its log) are reopened, all handed to Bunshin's CRIU plugin
(:mod:`bunshin.criu.plugin`; ``inherit_fd`` for what a stock CRIU or an image dumped without it
needs; see :mod:`bunshin.criu.externals`, :mod:`bunshin.criu.handover`). A sandbox's image is
restored in a user namespace with its maps, on rootfs layers idmapped alike (see
:mod:`bunshin.criu.sandbox`).
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import time
from pathlib import Path
from typing import NamedTuple

from ..errors import BunshinError, CheckpointError
from ..runtime.body import Body, SessionCopy, allocate, session_copies
from ..runtime.channel import Channel
from ..runtime.reap import reap_init
from ..runtime.rootfs.model import Rootfs
from ..runtime.statedir import Meta, own_start_time
from ..runtime.userns import UserNs
from ..runtime.workspace_config import WorkspaceConfig
from . import handover, images, initfds, layerstore, runner
from . import sandbox as _sandbox

log = logging.getLogger("bunshin.criu")

# The restore's worker joins the new cgroups and mounts the overlay in its own mount namespace,
# says which groups it is in (a sandbox's restore names them to CRIU as each hierarchy's root,
# where CRIU makes the image's groups of it again), then becomes `criu swrk` with its stdout
# joined to its stderr (only that first output is the handshake)
_SCRIPT = ('for f in $BX_CGROUPS; do echo $$ > "$f" || exit 71; done; '
           'mount -t overlay overlay -o "$BX_OVERLAY" "$BX_ROOT" || exit 72; '
           'cat /proc/self/cgroup || exit 73; exec "$@" >&2')
_PREFIX = ("unshare", "-m", "--propagation", "private", "/bin/sh", "-c", _SCRIPT, "sh")
_KSM_RUN = Path("/sys/kernel/mm/ksm/run")


class Restored(NamedTuple):
    """What :func:`restore` gives back (``Workspace.from_body(*restored)`` is its handle)."""

    config: WorkspaceConfig
    body: Body
    sessions: list[SessionCopy]


def restore(path: str | os.PathLike, *, ksm: bool = False) -> Restored:
    """A running body restored from the images at ``path`` (see :func:`dump.dump`), with the
    settings and shell sessions dumped with it; the caller owns all of it.

    Independent of the original and of other restores (own pid, mount, net, ipc and uts
    namespaces, cgroup and upper layer); the same PIDs, files, shell sessions and memory
    contents as at the dump. Safe to call many times, from several threads at once. ``ksm``:
    mark the restored processes' memory mergeable (``PR_SET_MEMORY_MERGE``) and make sure KSM
    runs, so that restores of one image share pages as KSM finds them. Images are only read;
    errors: :class:`ImageError` (missing, corrupt, foreign images), :class:`CriuError` (no
    CRIU ≥ 4), :class:`CheckpointError` (CRIU failed; its log is kept in the message).
    """
    src = Path(path).absolute()
    meta = images.read_meta(src)
    info = runner.criu()
    start = time.perf_counter()
    cfg = WorkspaceConfig.from_dict(meta["config"])
    alloc = allocate(cfg.limits, rootfs=f"image:{src}", disk_limit=cfg.disk_limit)
    d, cg = alloc.dir, alloc.cgroup
    dirs: list[int] = []
    ours = theirs = views = userns = None
    pidfd = -1
    try:
        lowers = []
        for i in range(meta["layers"]):  # copied: overlayfs refuses a lower nested in another
            lower = d.path / f"lower{i}"
            lower.mkdir()
            layerstore.copy_layer(images.layer_dir(src, i), lower)
            lowers.append(str(lower))
        lowers += meta["rootfs_lowers"]
        mounted = lowers
        if cfg.isolation == "sandbox":
            views = _sandbox.idmap_views(meta["rootfs_lowers"])
            mounted = views.layers(lowers)
            views.give_dirs(d.upper, d.work)
        work = d.path / "criu"
        work.mkdir()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        rpc = runner.rpc(info)
        opts = runner.options(info, log_file="restore.log", root=str(d.root), rst_sibling=True,
                              shell_job=True, network_lock=rpc.SKIP, tcp_established=True,
                              file_locks=True)
        env = runner.environ()
        setup = None
        if views is None:
            opts.manage_cgroups_mode = rpc.IGNORE
        else:
            _sandbox.restore_options(meta, opts, rpc)
            setup = _cgroup_roots
        env["BX_CGROUPS"] = " ".join(shlex.quote(f) for f in cg.procs_files())
        env["BX_OVERLAY"] = f"lowerdir={':'.join(mounted)},upperdir={d.upper},workdir={d.work}"
        env["BX_ROOT"] = str(d.root)
        view_fds = views.view_fds() if views is not None else []
        # CRIU opens both as /proc/<our pid>/fd/N: ours, not handed to the worker
        for where in (images.criu_dir(src), work):
            dirs.append(os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        opts.images_dir_fd, opts.work_dir_fd = dirs
        with handover.current().restore(opts, env, meta, theirs.fileno(), d.log_file, lowers,
                                        images.criu_dir(src), info) as fds:
            init_pid = runner.call(info, "restore", opts, what=f"CRIU restore of {src}",
                                   logfile=work / "restore.log", prefix=_PREFIX,
                                   pass_fds=(theirs.fileno(), *fds, *view_fds), env=env,
                                   setup=setup).pid
        pidfd = os.pidfd_open(init_pid)
        userns = (_sandbox.restored_userns(init_pid, meta["rootfs_lowers"]) if views is not None
                  else None)
        masters = initfds.take_masters(init_pid, {int(s[0]): int(s[3]) for s in meta["shells"]})
        body = _body(src, alloc.dir, cg, init_pid, pidfd, ours, masters, lowers, userns)
        pidfd, ours, userns = -1, None, None  # the body owns them now
        sessions = session_copies([(int(s[0]), int(s[1]), s[2]) for s in meta["shells"]], masters)
        for m in set(masters.values()) - {sc.master for sc in sessions}:
            os.close(m)
    except BaseException as e:
        if pidfd >= 0:
            reap_init(pidfd, is_child=True, grace=0)
        if ours is not None:
            ours.close()
        if userns is not None:
            userns.close()
        if isinstance(e, CheckpointError):
            runner.keep_log(e, "restore")
        alloc.destroy()
        raise
    finally:
        for fd in dirs:
            os.close(fd)
        if theirs is not None:
            theirs.close()
        if views is not None:
            try:
                views.close()  # the overlay holds its layers now
            except OSError as e:
                log.warning("cannot remove the idmapped views a restore of %s mounted its "
                            "overlay on (bunshin gc removes them): %s", src, e)
    try:
        if ksm:
            _ksm_on()
            initfds.mark_mergeable(cg.pids())
    except BaseException:
        for sc in sessions:
            os.close(sc.master)
        body.close()
        raise
    log.info("restored workspace %s from %s in %.1f ms", body.id, src, (time.perf_counter() - start) * 1e3)
    return Restored(cfg, body, sessions)


def _cgroup_roots(cgroups: str, opts) -> None:
    """Each group the restore's worker is in (``cgroups``: its /proc/self/cgroup) but a
    hierarchy's root, as CRIU's root of that hierarchy (``cg_root``)."""
    for line in cgroups.splitlines():
        _id, ctrls, path = line.split(":", 2)
        if path == "/":
            continue
        if ctrls:
            opts.cg_root.add(ctrl=ctrls, path=path)
        else:
            opts.cg_root.add(path=path)


def _body(src: Path, d, cg, init_pid: int, pidfd: int, ctl: socket.socket,
          masters: dict[int, int], lowers: list[str], userns: UserNs | None) -> Body:
    """The restored body (its init our child), as a fork's child's would be of a template
    whose layers are the image's."""
    chan = Channel(ctl, f"workspace {d.id}")
    try:
        chan.start()
        chan.ping(10)
        origin = f"image:{src}"
        rootfs = Rootfs(lowers=tuple(Path(p) for p in lowers), kind="fork", source=f"fork of {origin}")
        meta = Meta(id=d.id, owner_pid=os.getpid(), owner_start=own_start_time(), init_pid=init_pid,
                    cgroup=cg.name, rootfs=rootfs.source, lowers=list(lowers), parent=origin)
        d.write_meta(meta)
        body = Body(d, cg, meta, rootfs, init_pid=init_pid, pidfd=pidfd, init_is_child=True,
                    channel=chan, userns=userns)
        body.open_root()
        return body
    except BaseException:
        chan.close()
        for m in masters.values():
            os.close(m)
        masters.clear()
        raise


def _ksm_on() -> None:
    try:
        if _KSM_RUN.read_text().strip() != "1":
            _KSM_RUN.write_text("1")
            log.info("KSM was off: started it (/sys/kernel/mm/ksm/run = 1)")
    except OSError as e:
        raise BunshinError(f"cannot start KSM ({_KSM_RUN}): {e.strerror}; is CONFIG_KSM set?") from None


__all__ = ["Restored", "restore"]
