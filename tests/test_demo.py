"""The README's first command, end to end: `bunshin demo` runs both modes and is honest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_demo_runs_and_forks_save_memory(no_leaks, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = tmp_path / "demo.png"
    r = subprocess.run([sys.executable, "-m", "bunshin", "demo", "--group", "3", "--json", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    fresh, fork = figures["fresh"], figures["fork"]
    assert fresh["calls_ok"] == fork["calls_ok"] == 9
    # three copies of a 64 MiB kernel against one shared copy
    assert fork["memory_bytes"] < 0.6 * fresh["memory_bytes"]
    assert out.stat().st_size > 10_000
