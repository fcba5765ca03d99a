"""Templates that travel (bunshin.criu.pack/unpack, the layer store): what it costs to move a
saved template to a node that never saw its rootfs layer, against loading it where it was saved.

For each rootfs layer size L (a busybox root plus L MiB of random files, a cached tar layer), a
workspace on it with a waiting busybox shell is snapshotted and:

* save: ``tpl.save(dir)``, the first one (the layer's digest computed) and a second one (the
  digest kept beside the layer; read, not recomputed);
* digest: ``layerstore.tree_digest`` of the layer alone;
* local load: ``Template.load(dir)`` + ``fork(1)`` on the saving node;
* travel: ``pack(dir, layers=...)`` streamed through a pipe into another process (a node of its
  own: fresh state dir and layer cache) that runs ``unpack`` (the layer checked against its
  digest on arrival), then ``Template.load`` + ``fork(1)`` there; the stream's bytes and the
  receiver's timings. The total = save + pack/unpack + load.

usage: python bench/travel.py [--quick]   (last stdout line: JSON; PNG in bench/out/)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, png_path

import bunshin
from bunshin import criu
from bunshin.criu import layerstore, runner

_M = 1 << 20
ROOT = Path(__file__).resolve().parents[1]
BUSYBOX = Path("/bin/busybox")

# The receiving node: unpack the stream on stdin, load, fork one child that answers, report.
_RECEIVER = r'''
import json, sys, time
import bunshin
from bunshin import criu
from bunshin.runtime import statefs
dest = sys.argv[1]
def chunks():  # fd 3: what the receiver's own children (mkfs, mount) inherit is stdin
    with open(3, "rb") as f:
        while b := f.read(1 << 20):
            yield b
t0 = time.perf_counter()
got = criu.unpack(chunks(), dest)
t1 = time.perf_counter()
tpl = bunshin.Template.load(dest)
t2 = time.perf_counter()
kid = tpl.fork(1)[0]
t3 = time.perf_counter()
tpl.close()
t4 = time.perf_counter()
bunshin.Template.load(dest).close()  # once the node is warm (state file system, pools)
t5 = time.perf_counter()
ok = kid.run("echo go > /tmp/fifo; while [ ! -s /tmp/answer ]; do /bin/busybox sleep 0.02; done; cat /tmp/answer")
kid.close()
released = statefs.release()
print(json.dumps({"unpack_s": t1 - t0, "load_s": t2 - t1, "fork_s": t3 - t2, "load_again_s": t5 - t4,
                  "received": got,
                  "answer": ok.stdout.decode().strip(), "released": released}))
'''


def rootfs_tar(path: Path, mib: int) -> Path:
    """A busybox root with ``mib`` MiB of random files (1 MiB each) in /data."""
    with tarfile.open(path, "w") as t:
        def add(name: str, data: bytes = b"", mode: int = 0o644, kind: bytes = tarfile.REGTYPE,
                link: str = "") -> None:
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode, ti.linkname, ti.size = kind, mode, link, len(data)
            t.addfile(ti, io.BytesIO(data) if data else None)
        for d in ("bin", "etc", "tmp", "data"):
            add(d, mode=0o1777 if d == "tmp" else 0o755, kind=tarfile.DIRTYPE)
        add("bin/busybox", BUSYBOX.read_bytes(), 0o755)
        add("bin/sh", kind=tarfile.SYMTYPE, link="/bin/busybox")
        add("etc/passwd", b"root:x:0:0::/root:/bin/sh\n")
        for i in range(mib):
            add(f"data/{i:05d}", os.urandom(_M))
    return path


def one_size(mib: int, tmp: Path) -> dict:
    arch = rootfs_tar(tmp / f"root-{mib}.tar", mib)
    res: dict = {"layer_mib": mib}
    with bunshin.Workspace.create(rootfs=arch) as ws:
        ws.run("mkfifo /tmp/fifo")
        ws.spawn(["/bin/busybox", "sh", "-c",
                  "X=41; read l < /tmp/fifo; echo $((X+1)) > /tmp/answer"])
        with ws.snapshot() as tpl:
            for key, d in (("save_first_s", tmp / f"img-{mib}"), ("save_again_s", tmp / f"img2-{mib}")):
                t = time.perf_counter()
                tpl.save(d)
                res[key] = time.perf_counter() - t
    img = tmp / f"img-{mib}"
    [digest] = criu.image_layers(img)
    layer = layerstore.local(digest)
    assert layer is not None
    t = time.perf_counter()
    layerstore.tree_digest(layer)
    res["digest_s"] = time.perf_counter() - t
    t = time.perf_counter()
    loaded = bunshin.Template.load(img)
    res["local_load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    kid = loaded.fork(1)[0]
    res["local_fork_s"] = time.perf_counter() - t
    loaded.close()
    kid.close()

    node = tmp / f"node-{mib}"
    env = dict(os.environ, BUNSHIN_STATE_DIR=str(node / "state"), BUNSHIN_CACHE_DIR=str(node / "cache"),
               BUNSHIN_CRIU=runner.criu().path, BUNSHIN_OWNER_WATCH="0",
               PYTHONPATH=f"{os.environ.get('PYTHONPATH', '')}:{ROOT}")
    env.pop("BUNSHIN_LAYER_STORE", None)
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(tmp / f"recv-{mib}")], stdout=subprocess.PIPE,
                         env=env, pass_fds=[r], preexec_fn=lambda: os.dup2(r, 3))
    os.close(r)
    sent = 0
    t = time.perf_counter()
    with open(w, "wb") as pipe:
        for chunk in criu.pack(img, layers=[digest]):
            pipe.write(chunk)
            sent += len(chunk)
    res["pack_s"] = time.perf_counter() - t  # the receiver unpacks as it arrives
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    recv = json.loads(out.decode().splitlines()[-1])
    assert recv["answer"] == "42" and recv["received"] == [digest] and recv["released"], recv
    res["stream_bytes"] = sent
    res["remote"] = {k: recv[k] for k in ("unpack_s", "load_s", "fork_s", "load_again_s")}
    res["travel_total_s"] = res["save_again_s"] + recv["unpack_s"] + recv["load_s"]
    res["local_total_s"] = res["save_again_s"] + res["local_load_s"]
    layerstore.remove(digest)  # a link into this run's temporary cache
    return res


def plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.6))
    rows = res["travel"]
    x = range(len(rows))
    w = 0.38
    parts = [("save_again_s", "save"), ("unpack", "pack+unpack (streamed)"), ("load", "load")]
    for side, off in (("local", -w / 2), ("travel", w / 2)):
        bottom = [0.0] * len(rows)
        for key, lab in parts:
            if side == "local" and key == "unpack":
                continue
            vals = [(r[key] if key == "save_again_s" else
                     r["local_load_s"] if side == "local" else r["remote"][f"{key}_s"]) for r in rows]
            ax.bar([i + off for i in x], vals, w, bottom=bottom, label=f"{side}: {lab}")
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(list(x), [f"{r['layer_mib']} MiB layer" for r in rows])
    ax.set_ylabel("s")
    ax.set_title("save + (pack/unpack) + load: on the saving node vs on a node without the layer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path("travel"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small layers (under 2 minutes)")
    args = ap.parse_args()
    sizes = [16, 128] if args.quick else [16, 256, 1024]
    with tempfile.TemporaryDirectory(prefix="bunshin-travel-") as d:
        tmp = Path(d)
        os.environ.setdefault("BUNSHIN_CRIU", runner.criu().path)
        os.environ["BUNSHIN_CACHE_DIR"] = str(tmp / "cache")  # the layer is new to this node too
        rows = [one_size(mib, tmp) for mib in sizes]
    res = {"quick": args.quick, "travel": rows}
    try:
        plot(res)
    except ImportError:
        pass
    emit("travel", res)


if __name__ == "__main__":
    main()
