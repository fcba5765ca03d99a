"""Running the CRIU binary: which one (``bunshin.criu_locate``, judged once per process) and
how its failures become :class:`CheckpointError` with the log's error lines."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from pathlib import Path

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


def run(argv: list[str], *, what: str, logfile: Path, pass_fds=(), timeout: float = 300,
        env: dict | None = None) -> None:
    """Run a CRIU command line; :class:`CheckpointError` naming ``what`` failed and why."""
    log.debug("%s: %s", what, " ".join(argv))
    try:
        p = subprocess.run(argv, pass_fds=tuple(pass_fds), capture_output=True, text=True,
                           timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        raise CheckpointError(f"{what}: CRIU did not finish within {timeout} s (log: {logfile})",
                              log=str(logfile)) from None
    except OSError as e:
        raise CheckpointError(f"{what}: cannot run CRIU: {e}") from None
    if p.returncode != 0:
        extra = (p.stderr or "").strip()[-300:]
        if "Can't get 1:16 opt" in errors_in(logfile):
            extra += ("\n  CRIU < 4.2 cannot dump TCP/UDP sockets on Linux >= 6.16 "
                      "(checkpoint-restore/criu#2705): `bunshin criu provision` installs 4.2 "
                      "(Debian forky), or close the workspace's inet sockets first")
        raise CheckpointError(f"{what} failed (CRIU exit {p.returncode}); log {logfile}:\n  "
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


def environ() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env
