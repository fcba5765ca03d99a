"""A stand-in CRIU for location tests: an executable that answers ``criu swrk FD`` as an old
or broken CRIU would, over pycriu's RPC (Bunshin asks CRIU nothing any other way).

Its answers are encoded here with pycriu's messages and written into the script, which then
needs no pycriu of its own: it reads each request, looks at its type and sends the answer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def _pycriu_dirs() -> list[Path]:
    from bunshin import criu_locate, criu_rpc

    return criu_rpc.pycriu_dirs(Path("/nonexistent/bin/criu"), criu_locate.private_prefix())


#: Where pycriu is, looked up before any test points the cache directory elsewhere
PYCRIU_DIRS = _pycriu_dirs()


def _rpc():
    from bunshin import criu_rpc

    if not PYCRIU_DIRS:
        pytest.skip("no pycriu on this machine to encode a fake CRIU's answers with "
                    "(`bunshin criu provision` installs one)")
    return criu_rpc.pycriu(PYCRIU_DIRS[0]).rpc


def fake_criu(prefix: Path, version: str, check_ok: bool = True) -> Path:
    """Install at ``prefix`` (``bin/criu``, and its pycriu in ``sysroot/``, as a provisioned
    CRIU has it: Bunshin speaks to it with that pycriu) a CRIU of ``version`` ("3.17",
    "4.1.0") whose CHECK passes or, with ``check_ok`` False, fails saying "Error: no vdso" on
    its stderr as a real one logs; returns the binary's path."""
    rpc = _rpc()
    major, minor, *rest = (int(x) for x in version.split("."))
    ver = rpc.criu_resp(type=rpc.VERSION, success=True,
                        version=rpc.criu_version(major_number=major, minor_number=minor,
                                                 **({"sublevel": rest[0]} if rest else {})))
    chk = rpc.criu_resp(type=rpc.CHECK, success=check_ok)
    answers = {rpc.VERSION: ver.SerializeToString(), rpc.CHECK: chk.SerializeToString()}
    site = prefix / "sysroot" / "usr" / "lib" / "python3" / "dist-packages"
    site.mkdir(parents=True)
    (site / "pycriu").symlink_to(PYCRIU_DIRS[0] / "pycriu")
    path = prefix / "bin" / "criu"
    path.parent.mkdir()
    path.write_text(f"""#!{sys.executable}
import os, socket, sys
answers = {answers!r}
if sys.argv[1:2] != ["swrk"]:
    sys.exit("this fake CRIU only speaks RPC: " + " ".join(sys.argv))
sk = socket.socket(fileno=int(sys.argv[2]))
while req := sk.recv(1 << 16):
    kind = req[1]  # criu_req.type: field 1, a one-byte varint
    if kind == {rpc.CHECK} and not {check_ok!r}:
        print("Error: no vdso", file=sys.stderr, flush=True)
    sk.send(answers[kind])
""")
    path.chmod(0o755)
    return path
