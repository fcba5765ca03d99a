"""CRIU driven through pycriu's RPC: one ``criu swrk`` worker per request.

Bunshin starts the worker itself (not pycriu's ``use_binary``, which forks the whole trainer
and cannot bound its wait) and hands its socket to :class:`pycriu.criu.criu` (``use_fd``): a
restore's worker must first enter the new workspace's cgroups and mount namespace (a command
``prefix`` that ends in ``exec criu swrk FD``), and a worker that hangs is killed when its
time is up. pycriu is found next to the CRIU binary, in the private install or the system's
(any pycriu speaks to any CRIU: the protocol is protobuf's, fields only ever added); it needs
``protobuf`` from PyPI (``pip install 'bunshin[criu]'``).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from .errors import CriuError

__all__ = ["Swrk", "pycriu", "pycriu_dirs", "worker_env"]

_SYSTEM = Path("/usr/lib/python3/dist-packages")
_lock = threading.Lock()


def worker_env() -> dict[str, str]:
    """The environment a ``criu swrk`` worker starts from: the trainer's, less its
    ``PYTHONPATH`` (which is the trainer's, not CRIU's)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def pycriu_dirs(criu: Path, private: Path) -> list[Path]:
    """Where a pycriu for the CRIU at ``criu`` may live, the closest first: its own install's
    sysroot, the private install's (``private`` is its prefix), the system's."""
    own = criu.parent.parent / "sysroot" / "usr" / "lib" / "python3" / "dist-packages"
    mine = private / "sysroot" / "usr" / "lib" / "python3" / "dist-packages"
    out: list[Path] = []
    for d in (own, mine, _SYSTEM):
        if (d / "pycriu" / "__init__.py").is_file() and d not in out:
            out.append(d)
    return out


def pycriu(directory: str | os.PathLike) -> ModuleType:
    """The ``pycriu`` package of ``directory`` (imported once per process: its modules import
    each other as ``pycriu.*``, so a second one would be the first again); :class:`CriuError`
    when it cannot be imported (no protobuf, or one too old for its generated code)."""
    with _lock:
        mod = sys.modules.get("pycriu")
        if mod is not None:
            return mod
        init = Path(directory) / "pycriu" / "__init__.py"
        spec = importlib.util.spec_from_file_location("pycriu", init,
                                                      submodule_search_locations=[str(init.parent)])
        if spec is None or spec.loader is None:
            raise CriuError(f"no pycriu package at {init.parent}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["pycriu"] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001 - any import failure means the same to the user
            for name in [n for n in sys.modules if n == "pycriu" or n.startswith("pycriu.")]:
                del sys.modules[name]
            raise CriuError(f"pycriu at {init.parent} cannot be imported ({type(e).__name__}: {e}); "
                            "it needs protobuf: pip install 'bunshin[criu]'") from None
        return mod


class Swrk:
    """One ``criu swrk`` worker: started by :meth:`__init__`, asked through :meth:`client` (or
    :meth:`ask`), ended by :meth:`close`. ``prefix`` runs first and execs the worker's command
    line it is given as its last arguments; what it writes to stdout before that is
    :meth:`setup_output`. Everything the worker writes itself goes to :meth:`output`. The
    worker is killed ``timeout`` seconds after it started (:attr:`expired` then says so)."""

    def __init__(self, criu: str, rpc_module: ModuleType, *, prefix: tuple[str, ...] = (),
                 pass_fds: tuple[int, ...] = (), env: dict | None = None,
                 timeout: float = 300) -> None:
        self._pycriu = rpc_module
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._err = tempfile.TemporaryFile()
        self.expired = False
        self._deadline = time.monotonic() + timeout
        try:
            self.proc = subprocess.Popen(
                [*prefix, criu, "swrk", str(theirs.fileno())],
                pass_fds=(theirs.fileno(), *pass_fds), stdin=None,
                stdout=subprocess.PIPE if prefix else self._err, stderr=self._err, env=env)
        except OSError as e:
            self.sock.close()
            self._err.close()
            raise CriuError(f"cannot start `{criu} swrk`: {e.strerror}") from None
        finally:
            theirs.close()  # the worker's end: its exit is then our EOF
        self._timer = threading.Timer(timeout, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        self.expired = True
        self.proc.kill()

    def setup_output(self) -> str:
        """What ``prefix`` wrote to stdout before it exec'd the worker (until EOF: the worker's
        own stdout is elsewhere, see :data:`bunshin.criu.restore`)."""
        assert self.proc.stdout is not None
        data = self.proc.stdout.read()
        self.proc.stdout.close()
        return data.decode(errors="replace")

    def client(self, opts: Any = None) -> Any:
        """A :class:`pycriu.criu.criu` speaking to this worker, its requests carrying ``opts``
        (a ``criu_opts``); one request (no ``keep_open``) ends the worker."""
        c = self._pycriu.criu()  # the package exports the class under the module's name
        c.use_fd(self.sock.fileno())
        if opts is not None:
            c.opts = opts
        return c

    def ask(self, req: Any) -> Any:
        """Send one ``criu_req`` and read its ``criu_resp``, for requests pycriu's client has
        no method for (``VERSION``); :class:`OSError` or ``EOFError`` if the worker is gone."""
        self.sock.send(req.SerializeToString())
        size = len(self.sock.recv(1, socket.MSG_TRUNC | socket.MSG_PEEK))
        if size == 0:
            raise EOFError("the CRIU worker closed its socket")
        resp = self._pycriu.rpc.criu_resp()
        resp.ParseFromString(self.sock.recv(size))
        return resp

    def output(self, n: int = 2000) -> str:
        """The last ``n`` characters the worker (and ``prefix``) wrote to stderr."""
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-n:].strip()

    def close(self) -> int | None:
        """Close the socket (the worker ends after its last answer), wait for the worker until
        the deadline, kill it then; its exit status (negative: the signal)."""
        self.sock.close()
        try:
            self.proc.wait(max(0.0, self._deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._expire()
            self.proc.wait()
        finally:
            self._timer.cancel()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> Swrk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self._err.close()
