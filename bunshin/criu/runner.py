"""Driving CRIU: which one (``bunshin.criu_locate``, judged once per binary), its requests sent
through pycriu's RPC to a ``criu swrk`` worker (:mod:`bunshin.criu_rpc`), and how their failures
become :class:`CheckpointError` with the log's error lines."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import criu_rpc
from ..criu_locate import CriuInfo, find_criu
from ..errors import CheckpointError, CriuError

log = logging.getLogger("bunshin.criu")

_lock = threading.Lock()
_cache: dict[tuple, CriuInfo] = {}


def criu() -> CriuInfo:
    """The usable CRIU ≥ 4, checked once per binary; :class:`CriuError` otherwise."""
    from ..criu_locate import candidate

    cand = candidate()  # CriuError for a BUNSHIN_CRIU that is not executable
    if cand is None:
        raise CriuError("no CRIU found; run `bunshin criu provision` for a private CRIU 4 "
                        "(or set BUNSHIN_CRIU to a CRIU >= 4)")
    try:
        st = cand[0].stat()
    except OSError as e:
        raise CriuError(f"CRIU at {cand[0]}: {e}") from None
    key = (str(cand[0]), st.st_mtime_ns, st.st_size)
    with _lock:
        info = _cache.get(key)
        if info is None:
            info = find_criu()
            if info is None:
                raise CriuError("no CRIU found; run `bunshin criu provision`")
            if info.usable:
                _cache[key] = info
    if not info.usable:
        raise CriuError(f"CRIU {'.'.join(map(str, info.version))} at {info.path} refused: {info.reason}")
    return info


def version_string(info: CriuInfo) -> str:
    return ".".join(map(str, info.version))


def errors_in(logfile: Path, n: int = 6) -> str:
    """The last ``n`` error lines of a CRIU log (or its tail when it has none)."""
    try:
        lines = logfile.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    errs = [ln.strip() for ln in lines if "Error (" in ln and "RLIMIT_NOFILE" not in ln]
    return "\n  ".join((errs or lines)[-n:])


def options(info: CriuInfo, **fields: Any) -> Any:
    """pycriu's ``criu_opts`` for a request to ``info``'s CRIU: ``fields`` set, logs verbose."""
    opts = rpc(info).criu_opts(images_dir_fd=-1, log_level=4)
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


def rpc(info: CriuInfo) -> Any:
    """pycriu's message module (``rpc_pb2``): the enums and repeated entries of ``criu_opts``."""
    return pycriu(info).rpc


def pycriu(info: CriuInfo) -> Any:
    """The pycriu package that drives ``info``'s CRIU (its ``rpc`` and ``images`` modules)."""
    if not info.pycriu:
        raise CriuError(f"no pycriu for the CRIU at {info.path}: run `bunshin criu provision`")
    return criu_rpc.pycriu(info.pycriu)


def call(info: CriuInfo, request: str, opts: Any, *, what: str, logfile: Path,
         prefix: tuple[str, ...] = (), pass_fds: tuple[int, ...] = (), env: dict | None = None,
         timeout: float = 300, setup: Callable[[str, Any], None] | None = None) -> Any:
    """Send one request (pycriu's ``dump`` or ``restore``) with ``opts`` to a new ``criu
    swrk`` worker, started behind ``prefix`` (see :class:`bunshin.criu_rpc.Swrk`), and give its
    answer; ``setup(prefix's stdout, opts)`` runs first. :class:`CheckpointError` naming
    ``what`` failed and why (the log's error lines), also when the worker took longer than
    ``timeout`` seconds and was killed."""
    mod = pycriu(info)
    log.debug("%s: RPC %s to %s swrk: %s", what, request.upper(), info.path, opts)
    with criu_rpc.Swrk(info.path, mod, prefix=prefix, pass_fds=pass_fds, env=env,
                       timeout=timeout) as w:
        try:
            if setup is not None:
                setup(w.setup_output(), opts)
            return getattr(w.client(opts), request)()
        except mod.CRIUException as e:
            failed = str(e)
        status = w.close()
        said = w.output(300)
    if w.expired:
        raise CheckpointError(f"{what}: CRIU did not finish within {timeout} s and was killed "
                              f"(log: {logfile})", log=str(logfile))
    extra = said
    if "Can't get 1:16 opt" in errors_in(logfile):
        extra += ("\n  CRIU < 4.2 cannot dump TCP/UDP sockets on Linux >= 6.16 "
                  "(checkpoint-restore/criu#2705): `bunshin criu provision` installs 4.2 "
                  "(Debian forky), or close the workspace's inet sockets first")
    raise CheckpointError(f"{what} failed ({failed}; CRIU worker exit {status}); log {logfile}:\n  "
                          f"{errors_in(logfile)}" + (f"\n  {extra}" if extra else ""),
                          log=str(logfile))


def keep_log(e: CheckpointError, prefix: str) -> None:
    """Copy the log of a failed CRIU run (``e.log``) to a temporary file before its directory
    is removed, and point ``e`` (message and ``log``) at the copy."""
    import tempfile

    if not e.log:
        return
    try:
        data = Path(e.log).read_bytes()
    except OSError:
        return
    fd, name = tempfile.mkstemp(prefix=f"bunshin-criu-{prefix}-", suffix=".log")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    e.args = (str(e).replace(e.log, name),)
    e.log = name


environ = criu_rpc.worker_env  # what a request's worker starts from
