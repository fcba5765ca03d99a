"""mountinfo parsing (runtime/cgroup/_fs.mounts) against real mounts whose paths need escapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")

# In a mount namespace of its own, so that no other test sees these mounts: a tmpfs at a
# point whose name holds a space and a backslash, and a bind of a subdirectory of it whose
# name holds a space (the kernel escapes both in mountinfo).
_SCRIPT = textwrap.dedent(r"""
    import ctypes, json, os, sys, tempfile
    from bunshin.runtime.cgroup import _fs
    libc = ctypes.CDLL(None, use_errno=True)
    def mount(src, dst, fs, flags):
        if libc.mount(src.encode(), dst.encode(), fs and fs.encode(), flags, None) < 0:
            raise OSError(ctypes.get_errno(), dst)
    top = tempfile.mkdtemp()
    point, bound = os.path.join(top, "m n\\x"), os.path.join(top, "b")
    os.mkdir(point); os.mkdir(bound)
    mount("none", point, "tmpfs", 0)
    os.mkdir(os.path.join(point, "s t"))
    mount(os.path.join(point, "s t"), bound, None, 0x1000)
    got = {m.point: [m.root, m.fstype, m.device] for m in _fs.mounts()}
    json.dump({"point": point, "bound": bound, "got": got,
               "cgroups": [m.fstype for m in _fs.cgroup_mounts()]}, sys.stdout)
    for p in (bound, point):
        libc.umount2(p.encode(), 2)
        os.rmdir(p)
    os.rmdir(top)
""")


def test_mounts_unescape_root_and_point_and_cgroup_mounts_filter_them():
    out = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", _SCRIPT],
                         capture_output=True, text=True, env=os.environ, check=True).stdout
    r = json.loads(out)
    root, fstype, dev = r["got"][r["point"]]
    assert (root, fstype) == ("/", "tmpfs")
    assert r["got"][r["bound"]] == ["/s t", "tmpfs", dev]
    assert r["cgroups"] and set(r["cgroups"]) <= {"cgroup", "cgroup2"}
