"""The README's first command, end to end: `bunshin demo` runs both modes and is honest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_demo_runs_every_mode_and_forks_save_memory(no_leaks, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = tmp_path / "demo.png"
    r = subprocess.run([sys.executable, "-m", "bunshin", "demo", "--group", "3", "--json", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    modes = json.loads(r.stdout.strip().splitlines()[-1])["modes"]
    assert {"fresh", "fork", "bunshin"} <= set(modes)
    for m in modes.values():
        assert m["turns"] == 3 * 8 and m["calls_failed"] == 0 and not m["errors"]
    fresh, fork = modes["fresh"], modes["fork"]
    # three copies of a 64 MiB kernel against one shared copy
    assert fork["peak_bytes"] < 0.6 * fresh["peak_bytes"]
    assert fork["gb_s"] < fresh["gb_s"]
    assert modes["bunshin"]["cache"]["hits"] > 0
    assert out.stat().st_size > 10_000
