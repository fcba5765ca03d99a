"""Rootfs resolution: real archives built here, extracted for real, mounted as real overlays."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import lzma
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from bunshin.errors import BunshinError, RootfsError
from bunshin.runtime import rootfs as R
from bunshin.runtime.rootfs import Rootfs, build_debian, resolve, store

BUSYBOX = Path("/usr/bin/busybox")  # Debian's busybox-static: runs in a root with nothing else
MTIME = 1_600_000_000
ROOT = os.geteuid() == 0

pytestmark = pytest.mark.skipif(not ROOT, reason="extraction keeps owners and makes device nodes: needs root")


# ---------------------------------------------------------------- fixtures and builders


@pytest.fixture
def work():
    """A scratch directory removed after the test, plus the cache inside it."""
    d = Path(tempfile.mkdtemp(prefix="bunshin-rootfs-test-"))
    yield d
    shutil.rmtree(d)
    assert not d.exists()


@pytest.fixture
def cache(work, monkeypatch):
    c = work / "cache"
    monkeypatch.setenv("BUNSHIN_CACHE_DIR", str(c))
    yield c
    stores = [c / "layers", c / "debian", c / "archives"]
    leftovers = [
        p
        for d in stores
        if d.exists()
        for p in d.iterdir()
        if p.name.startswith((".tmp-", ".old-")) or p.name.endswith(".lock")
    ]
    assert leftovers == [], f"temporaries left in the cache: {leftovers}"
    assert not (c / "tmp").exists(), "image scratch directory left behind"


class TarBuilder:
    """Builds tar archives member by member with exact metadata."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        # Kept open across calls on purpose; bytes() closes it.
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT)  # noqa: SIM115

    def _add(self, name, type_, data=b"", mode=0o644, uid=0, gid=0, **kw):
        ti = tarfile.TarInfo(name)
        ti.type = type_
        ti.mode = mode
        ti.uid, ti.gid = uid, gid
        ti.mtime = kw.pop("mtime", MTIME)
        for k, v in kw.items():
            setattr(ti, k, v)
        ti.size = len(data)
        self.tar.addfile(ti, io.BytesIO(data) if data else None)
        return self

    def dir(self, name, mode=0o755, **kw):
        return self._add(name, tarfile.DIRTYPE, mode=mode, **kw)

    def file(self, name, data=b"x\n", mode=0o644, **kw):
        return self._add(name, tarfile.REGTYPE, data, mode=mode, **kw)

    def symlink(self, name, target, **kw):
        return self._add(name, tarfile.SYMTYPE, mode=0o777, linkname=target, **kw)

    def hardlink(self, name, target, **kw):
        return self._add(name, tarfile.LNKTYPE, linkname=target, **kw)

    def chr(self, name, major, minor, **kw):
        return self._add(name, tarfile.CHRTYPE, devmajor=major, devminor=minor, **kw)

    def fifo(self, name, **kw):
        return self._add(name, tarfile.FIFOTYPE, **kw)

    def bytes(self, compression: str = "") -> bytes:
        self.tar.close()
        raw = self.buf.getvalue()
        if compression == "gz":
            return gzip.compress(raw)
        if compression == "xz":
            return lzma.compress(raw)
        if compression == "zst":
            import zstandard

            return zstandard.ZstdCompressor().compress(raw)
        return raw

    def write(self, path: Path, compression: str = "") -> Path:
        path.write_bytes(self.bytes(compression))
        return path


def busybox_root(tb: TarBuilder | None = None) -> TarBuilder:
    """A tiny runnable root: busybox as /bin/sh, with every kind of member a root holds."""
    tb = tb or TarBuilder()
    tb.dir("./")
    tb.dir("bin").file("bin/busybox", BUSYBOX.read_bytes(), mode=0o755)
    tb.symlink("bin/sh", "/bin/busybox").hardlink("bin/ls", "bin/busybox").symlink("bin/cat", "busybox")
    tb.hardlink("bin/sh-again", "bin/sh")  # a hard link to a symlink must stay a symlink
    tb.dir("etc").file("etc/passwd", b"root:x:0:0::/root:/bin/sh\n")
    tb.file("/etc/hostname", b"tiny\n")  # absolute names are root-relative
    tb.dir("usr/bin", mode=0o755).file("usr/bin/su", b"#!/bin/sh\n", mode=0o4755)
    tb.dir("usr/share/games", mode=0o2775, uid=0, gid=60)
    tb.dir("home/alice", mode=0o700, uid=1234, gid=5678)
    tb.file("home/alice/notes", b"hello\n", mode=0o600, uid=1234, gid=5678)
    tb.dir("dev").chr("dev/null", 1, 3, mode=0o666).fifo("dev/initctl", mode=0o600)
    tb.dir("tmp", mode=0o1777)
    return tb


def run_in_overlay(lowers, upper: Path, script: str) -> str:
    """Mount an overlay in a private mount namespace, run ``script`` with $M the merged root."""
    work = upper.parent / (upper.name + ".work")
    merged = upper.parent / (upper.name + ".merged")
    work.mkdir()
    merged.mkdir()
    lowerdir = ":".join(str(p) for p in lowers)
    out = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-euc",
            f'mount -t overlay overlay -o "lowerdir={lowerdir},upperdir={upper},workdir={work}" "$M"\n{script}',
        ],
        env={**os.environ, "M": str(merged)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    mounted = [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if str(merged) in ln]
    assert mounted == [], "the overlay outlived its mount namespace"
    assert out.returncode == 0, out.stderr
    return out.stdout


def fresh_upper(work: Path, rootfs: Rootfs, name: str = "upper") -> Path:
    upper = work / name
    upper.mkdir()
    rootfs.prepare_upper(upper)
    return upper


def layer_entries(cache: Path) -> list[str]:
    d = cache / "layers"
    return sorted(os.listdir(d)) if d.exists() else []


# ---------------------------------------------------------------- tar archives


@pytest.mark.parametrize("compression", ["", "gz", "xz", "zst"])
def test_tar_rootfs_keeps_owners_modes_links_devices(work, cache, compression):
    archive = busybox_root().write(work / f"root.tar{'.' + compression if compression else ''}", compression)
    rootfs = resolve(archive)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    assert rootfs.kind == "tar" and rootfs.source == str(archive)
    assert rootfs.lowers == (cache / "layers" / digest,)
    root = rootfs.lowers[0]
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o755

    su = os.lstat(root / "usr/bin/su")
    assert stat.S_IMODE(su.st_mode) == 0o4755 and (su.st_uid, su.st_gid) == (0, 0)
    games = os.lstat(root / "usr/share/games")
    assert stat.S_IMODE(games.st_mode) == 0o2775 and games.st_gid == 60
    alice = os.lstat(root / "home/alice/notes")
    assert (alice.st_uid, alice.st_gid, stat.S_IMODE(alice.st_mode)) == (1234, 5678, 0o600)
    assert os.lstat(root / "home/alice").st_uid == 1234
    assert alice.st_mtime == MTIME and os.lstat(root / "home/alice").st_mtime == MTIME
    assert os.readlink(root / "bin/sh") == "/bin/busybox"
    assert os.readlink(root / "bin/sh-again") == "/bin/busybox"
    assert os.lstat(root / "bin/ls").st_ino == os.lstat(root / "bin/busybox").st_ino
    null = os.lstat(root / "dev/null")
    assert stat.S_ISCHR(null.st_mode) and os.major(null.st_rdev) == 1 and os.minor(null.st_rdev) == 3
    assert stat.S_ISFIFO(os.lstat(root / "dev/initctl").st_mode)
    assert (root / "etc/hostname").read_bytes() == b"tiny\n"
    assert stat.S_IMODE(os.lstat(root / "tmp").st_mode) == 0o1777


def test_tar_rootfs_runs_in_an_overlay(work, cache):
    rootfs = resolve(busybox_root().write(work / "root.tar"))
    upper = fresh_upper(work, rootfs)
    out = run_in_overlay(
        rootfs.lowers, upper, 'chroot "$M" /bin/sh -c "echo ran; cat /etc/hostname"; ls "$M/bin"'
    )
    assert out.split() == ["ran", "tiny", "busybox", "cat", "ls", "sh", "sh-again"]


@pytest.mark.parametrize(
    "build, why",
    [
        (lambda tb, out: tb.file(f"../{out.name}/evil", b"pwned"), "escapes"),
        (lambda tb, out: tb.file(f"a/../../{out.name}/evil", b"pwned"), "escapes"),
        (lambda tb, out: tb.hardlink("evil", f"../../../../../../{out}/victim"), "escapes"),
        (lambda tb, out: tb.symlink("lnk", str(out)).file("lnk/evil", b"pwned"), "not a directory"),
        (lambda tb, out: tb.symlink("lnk", str(out)).hardlink("evil", "lnk/victim"), "not a directory"),
        (lambda tb, out: tb.dir("d").symlink("d", str(out)), "replace a directory"),
    ],
    ids=[
        "dotdot",
        "dotdot-deep",
        "hardlink-dotdot",
        "through-symlink",
        "hardlink-through-symlink",
        "dir-to-symlink",
    ],
)
def test_escaping_members_are_rejected(work, cache, build, why):
    outside = work / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"original")
    os.chmod(outside, 0o700)
    tb = busybox_root()
    build(tb, outside)
    archive = tb.write(work / "evil.tar")
    with pytest.raises(RootfsError, match=why) as e:
        resolve(archive)
    assert str(archive) in str(e.value)
    assert sorted(os.listdir(outside)) == ["victim"]
    assert (outside / "victim").read_bytes() == b"original"
    assert os.stat(outside).st_nlink == 2 and os.stat(outside / "victim").st_nlink == 1
    assert stat.S_IMODE(os.stat(outside).st_mode) == 0o700
    assert layer_entries(cache) == []


def test_second_resolve_neither_extracts_nor_hashes(work, cache):
    tb = busybox_root()
    tb.file("opt/blob", os.urandom(48 << 20))
    archive = tb.write(work / "big.tar")
    first = resolve(archive)
    layer = first.lowers[0]
    before = (os.stat(layer).st_ino, os.stat(layer).st_mtime_ns, os.stat(layer / "opt/blob").st_ino)

    def rchar() -> int:
        return int(dict(ln.split(": ") for ln in Path("/proc/self/io").read_text().splitlines())["rchar"])

    r0 = rchar()
    second = resolve(archive)
    read = rchar() - r0
    assert second == first
    assert (os.stat(layer).st_ino, os.stat(layer).st_mtime_ns, os.stat(layer / "opt/blob").st_ino) == before
    assert read < (1 << 20), f"re-resolve read {read} bytes: it re-hashed the archive"

    # Same path, new bytes, old mtime put back: the index must miss and a new layer appear.
    st = os.stat(archive)
    busybox_root().file("opt/blob", b"changed").write(archive)
    os.utime(archive, ns=(st.st_atime_ns, st.st_mtime_ns))
    third = resolve(archive)
    assert third.lowers != first.lowers
    assert (third.lowers[0] / "opt/blob").read_bytes() == b"changed"


def test_concurrent_resolvers_share_one_extraction(work, cache):
    archive = busybox_root().file("opt/blob", os.urandom(16 << 20)).write(work / "root.tar.gz", "gz")
    code = "import sys; from bunshin.runtime.rootfs import resolve; print(resolve(sys.argv[1]).lowers[0])"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(archive)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    assert len({o.strip() for o, _ in outs}) == 1
    assert layer_entries(cache) == [hashlib.sha256(archive.read_bytes()).hexdigest()]


def test_not_a_root_tarball_is_rejected_and_not_kept(work, cache):
    tb = TarBuilder().file("README.md", b"# project\n").file("src/main.py", b"print()\n")
    with pytest.raises(RootfsError, match="does not look like a root filesystem"):
        resolve(tb.write(work / "project.tar"))
    assert layer_entries(cache) == []


# ---------------------------------------------------------------- bad input


def test_missing_path(work, cache):
    with pytest.raises(RootfsError, match="does not exist") as e:
        resolve(work / "nope.tar")
    assert "nope.tar" in str(e.value)


@pytest.mark.parametrize(
    "content, why",
    [
        (b"", "not a tar archive"),
        (b"just some text\n" * 100, "not a tar archive"),
        (b"\x1f\x8bnot really gzip", "not a tar archive"),
    ],
    ids=["empty", "text", "bad-gzip-header"],
)
def test_not_a_tar(work, cache, content, why):
    path = work / "thing.tar"
    path.write_bytes(content)
    with pytest.raises(RootfsError, match=why) as e:
        resolve(path)
    assert str(path) in str(e.value)
    assert layer_entries(cache) == []


@pytest.mark.parametrize("compression", ["", "gz", "xz", "zst"])
def test_truncated_archive_leaves_nothing(work, cache, compression):
    data = busybox_root().bytes(compression)
    path = work / "cut.tar"
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(RootfsError, match="corrupt|truncated|could not be read") as e:
        resolve(path)
    assert str(path) in str(e.value)
    assert layer_entries(cache) == []


def test_unreadable_file(work, cache):
    path = busybox_root().write(work / "root.tar")
    os.chmod(path, 0o000)
    # Root without the capabilities that bypass file modes meets the 000 mode like anyone.
    code = (
        "import sys\n"
        "from bunshin.runtime.rootfs import resolve\n"
        "from bunshin.errors import RootfsError\n"
        "try: resolve(sys.argv[1])\n"
        "except RootfsError as e: print('RootfsError:', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run(
        ["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert out.stdout.startswith("RootfsError:"), out.stderr
    assert "cannot read" in out.stdout and str(path) in out.stdout
    assert layer_entries(cache) == []


def test_special_file_and_wrong_type(cache):
    with pytest.raises(RootfsError, match="neither a directory nor a regular file"):
        resolve("/dev/null")
    with pytest.raises(RootfsError, match="not int"):
        resolve(42)  # type: ignore[arg-type]
    with pytest.raises(RootfsError, match="empty string"):
        resolve("")
    assert issubclass(RootfsError, BunshinError)


# ---------------------------------------------------------------- directories


def test_directory_rootfs(work, cache):
    root = work / "root"
    busybox_root().tar.close()
    with tarfile.open(fileobj=io.BytesIO(busybox_root().bytes())) as t:
        t.extractall(root, filter="fully_trusted", numeric_owner=True)
    rootfs = resolve(str(root))
    assert rootfs == Rootfs(lowers=(root,), kind="directory", source=str(root))
    assert layer_entries(cache) == []  # used in place, nothing copied


def test_directory_that_is_not_a_root(work, cache):
    project = work / "project"
    (project / "src").mkdir(parents=True)
    with pytest.raises(RootfsError, match="does not look like a root filesystem") as e:
        resolve(project)
    assert str(project) in str(e.value)


# ---------------------------------------------------------------- OCI and docker images


def blob(layout: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def image_layers() -> list[bytes]:
    base = busybox_root().file("etc/motd", b"base motd\n").dir("srv/data").file("srv/data/old", b"old\n")
    base.file("srv/data/keep-not", b"gone after opaque\n")
    top = TarBuilder().dir("etc").file("etc/.wh.motd", b"").dir("srv/data").file("srv/data/.wh..wh..opq", b"")
    top.file("srv/data/new", b"new\n").file("etc/issue", b"layer two\n")
    return [base.bytes("gz"), top.bytes()]


def make_oci_layout(
    layout: Path, layers: list[bytes], platforms=(("linux", "arm64"), ("linux", "amd64")), nested=False
) -> list[str]:
    """An OCI layout whose index has one manifest per platform; returns the layer hex digests."""
    layout.mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    config = blob(layout, json.dumps({"architecture": "amd64", "os": "linux"}).encode())
    descs = [
        {
            **blob(layout, data),
            "mediaType": "application/vnd.oci.image.layer.v1.tar"
            + ("+gzip" if data[:2] == b"\x1f\x8b" else ""),
        }
        for data in layers
    ]
    manifests = []
    for os_, arch in platforms:
        chosen = descs if arch == "amd64" else descs[:1]
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {**config, "mediaType": "application/vnd.oci.image.config.v1+json"},
            "layers": chosen,
        }
        manifests.append(
            {
                **blob(layout, json.dumps(manifest).encode()),
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "platform": {"os": os_, "architecture": arch},
            }
        )
    attestation = {
        **manifests[0],
        "platform": {"os": "unknown", "architecture": "unknown"},
        "annotations": {"vnd.docker.reference.type": "attestation-manifest"},
    }
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [attestation, *manifests],
    }
    if nested:  # as buildkit and skopeo write it: index.json -> image index -> manifests
        inner = {**blob(layout, json.dumps(index).encode()), "mediaType": index["mediaType"]}
        index = {"schemaVersion": 2, "manifests": [inner]}
    (layout / "index.json").write_text(json.dumps(index))
    return [d["digest"].split(":")[1] for d in descs]


def check_image(rootfs: Rootfs, cache: Path, digests: list[str], work: Path) -> None:
    assert rootfs.lowers == tuple(cache / "layers" / d for d in reversed(digests))
    top = rootfs.lowers[0]
    wh = os.lstat(top / "etc/motd")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == os.makedev(0, 0)
    assert os.getxattr(top / "srv/data", "trusted.overlay.opaque") == b"y"
    assert not (top / "srv/data/.wh..wh..opq").exists() and not (top / "etc/.wh.motd").exists()
    assert (rootfs.lowers[1] / "etc/motd").read_bytes() == b"base motd\n"
    upper = fresh_upper(work, rootfs)
    out = run_in_overlay(
        rootfs.lowers, upper, 'ls "$M/srv/data"; ls "$M/etc"; chroot "$M" /bin/sh -c "cat /etc/issue"'
    )
    assert out.split() == ["new", "hostname", "issue", "passwd", "layer", "two"]


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested-index"])
def test_oci_layout_picks_amd64_and_converts_whiteouts(work, cache, nested):
    digests = make_oci_layout(work / "image", image_layers(), nested=nested)
    rootfs = resolve(work / "image")
    assert rootfs.kind == "oci"
    check_image(rootfs, cache, digests, work)
    again = resolve(work / "image")
    assert again == rootfs


def test_oci_archive(work, cache):
    digests = make_oci_layout(work / "image", image_layers())
    archive = work / "image.oci.tar"
    with tarfile.open(archive, "w") as t:
        for name in sorted(os.listdir(work / "image")):
            t.add(work / "image" / name, arcname=name)
    rootfs = resolve(archive)
    assert rootfs.kind == "oci"
    check_image(rootfs, cache, digests, work)


def test_docker_save_archive(work, cache):
    layers = [
        busybox_root().file("etc/motd", b"base motd\n").dir("srv/data").file("srv/data/old", b"old\n").bytes()
    ]
    top = TarBuilder().dir("etc").file("etc/.wh.motd", b"").dir("srv/data").file("srv/data/.wh..wh..opq", b"")
    layers.append(top.file("srv/data/new", b"new\n").file("etc/issue", b"layer two\n").bytes())
    digests = [hashlib.sha256(d).hexdigest() for d in layers]
    config = json.dumps(
        {
            "os": "linux",
            "architecture": "amd64",
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for d in digests]},
        }
    ).encode()
    tb = TarBuilder()
    for i, data in enumerate(layers):
        tb.dir(f"{i:064x}").file(f"{i:064x}/VERSION", b"1.0").file(f"{i:064x}/layer.tar", data)
    cfg_name = hashlib.sha256(config).hexdigest() + ".json"
    tb.file(cfg_name, config)
    tb.file(
        "manifest.json",
        json.dumps(
            [
                {
                    "Config": cfg_name,
                    "RepoTags": ["tiny:1"],
                    "Layers": [f"{i:064x}/layer.tar" for i in range(2)],
                }
            ]
        ).encode(),
    )
    rootfs = resolve(tb.write(work / "tiny.docker.tar"))
    assert rootfs.kind == "docker-archive"
    check_image(rootfs, cache, digests, work)


def test_oci_without_amd64(work, cache):
    make_oci_layout(work / "image", image_layers(), platforms=(("linux", "arm64"), ("linux", "s390x")))
    with pytest.raises(RootfsError, match="no linux/amd64 image") as e:
        resolve(work / "image")
    assert "linux/arm64" in str(e.value) and str(work / "image") in str(e.value)
    assert layer_entries(cache) == []


def test_oci_without_manifests(work, cache):
    make_oci_layout(work / "image", image_layers())
    (work / "image/index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": []}))
    with pytest.raises(RootfsError, match="no image manifest"):
        resolve(work / "image")
    (work / "image/index.json").write_text("{not json")
    with pytest.raises(RootfsError, match="not valid JSON"):
        resolve(work / "image")


def test_layer_digest_mismatch_leaves_nothing(work, cache):
    digests = make_oci_layout(work / "image", image_layers())
    tampered = work / "image/blobs/sha256" / digests[1]
    tb = TarBuilder().dir("etc").file("etc/issue", b"evil\n")
    tampered.write_bytes(tb.bytes())
    with pytest.raises(RootfsError, match=f"sha256:{digests[1]} was expected") as e:
        resolve(work / "image")
    assert digests[1] in str(e.value)
    assert layer_entries(cache) == [digests[0]]  # the good base layer stays cached


# ---------------------------------------------------------------- upper preparation


def test_prepare_upper_hides_and_masks(work, cache):
    base = resolve(busybox_root().file("srv/www/index.html", b"hi\n").write(work / "root.tar"))
    rootfs = Rootfs(
        lowers=base.lowers,
        kind="tar",
        source=base.source,
        hide=("/etc/passwd", "/opt/not/there"),
        mask=("/home", "/srv/www"),
    )
    upper = fresh_upper(work, rootfs)
    assert os.lstat(upper / "etc/passwd").st_rdev == os.makedev(0, 0)
    assert os.getxattr(upper / "home", "trusted.overlay.opaque") == b"y"
    home = os.lstat(base.lowers[0] / "home")
    assert (os.lstat(upper / "home").st_mode, os.lstat(upper / "etc").st_mtime) == (home.st_mode, MTIME)
    rootfs.prepare_upper(upper)  # twice is harmless
    out = run_in_overlay(
        rootfs.lowers,
        upper,
        'ls -A "$M/home" "$M/srv/www" "$M/etc"; touch "$M/home/mine"; test -e "$M/opt/not/there" || echo gone',
    )
    assert "passwd" not in out and "alice" not in out and "index.html" not in out and "gone" in out
    assert "hostname" in out
    assert (upper / "home/mine").exists() and not (base.lowers[0] / "home/mine").exists()


def test_rootfs_validation(work):
    with pytest.raises(RootfsError, match="not an existing absolute directory"):
        Rootfs(lowers=(work / "missing",), kind="directory", source="x")
    with pytest.raises(RootfsError, match="absolute path"):
        Rootfs(lowers=(work,), kind="directory", source="x", hide=("etc",))
    with pytest.raises(RootfsError, match="normalised"):
        Rootfs(lowers=(work,), kind="directory", source="x", mask=("/a/../b",))
    with pytest.raises(RootfsError, match="hidden"):
        Rootfs(lowers=(work,), kind="directory", source="x", hide=("/srv",), mask=("/srv/www",))
    with pytest.raises(RootfsError, match="cannot take in lowerdir"):
        (work / "a:b").mkdir()
        Rootfs(lowers=(work / "a:b",), kind="directory", source="x")
    with pytest.raises(RootfsError, match="kind"):
        Rootfs(lowers=(work,), kind="squashfs", source="x")


def test_prepare_upper_refuses_symlinked_parent(work, cache):
    rootfs = resolve(busybox_root().symlink("var", "srv").dir("srv").write(work / "root.tar"))
    odd = Rootfs(lowers=rootfs.lowers, kind="tar", source="x", mask=("/var/tmp",))
    upper = work / "upper"
    upper.mkdir()
    with pytest.raises(RootfsError, match="not a directory"):
        odd.prepare_upper(upper)


def test_store_builds_once_replaces_and_cleans_up(work):
    final = work / "store" / "entry"
    calls = []

    def build(n):
        def fill(tmp: Path) -> None:
            calls.append(tmp)
            (tmp / "content").write_text(str(n))

        return fill

    final.parent.mkdir()
    (final.parent / f".tmp-{final.name}-killed").mkdir()  # as a SIGKILLed builder leaves it
    assert store.install(final, build(1)) is True
    assert store.install(final, build(2)) is False and len(calls) == 1
    assert store.install(final, build(3), replace=True) is True
    assert (final / "content").read_text() == "3"

    def broken(tmp: Path) -> None:
        (tmp / "half").write_text("written")
        raise RootfsError("build failed")

    with pytest.raises(RootfsError):
        store.install(final, broken, replace=True)
    assert (final / "content").read_text() == "3"  # the old entry survives a failed rebuild
    assert sorted(os.listdir(final.parent)) == ["entry"]


# ---------------------------------------------------------------- the default root


def test_default_rootfs(cache, monkeypatch, work):
    state = Path(tempfile.mkdtemp(prefix="bunshin-test-state-", dir="/var/lib"))
    try:
        monkeypatch.setenv("BUNSHIN_STATE_DIR", str(state))
        rootfs = resolve(None)
        assert rootfs.kind == "default" and rootfs.lowers == (Path("/"),)
        exposed = set(R.default.EXPOSED) | {p[1:] for p in R.default.PRIVATE + R.default.MOUNT_POINTS}
        assert set(rootfs.hide) == {"/" + n for n in os.listdir("/") if n not in exposed}
        assert set(R.default.PRIVATE) | {"/proc", "/sys", "/dev", str(state)} == set(rootfs.mask)
        assert str(cache) not in rootfs.mask  # under /tmp, already masked

        (state / "secret").write_text("host state")
        upper = fresh_upper(work, rootfs)
        script = (
            'ls -A "$M/" | tr "\\n" " "; echo; ls -A "$M/tmp" "$M/root" "$M/proc" "$M/var/tmp" "$M'
            + str(state)
            + '"; '
            'chroot "$M" /bin/sh -c "echo shell-ok"; chroot "$M" /usr/bin/python3 -c "print(6*7)"'
        )
        out = run_in_overlay(rootfs.lowers, upper, script).splitlines()
        top = set(out[0].split())
        private_top = {p[1:] for p in R.default.PRIVATE + R.default.MOUNT_POINTS if p.count("/") == 1}
        assert top == (set(os.listdir("/")) - {h[1:] for h in rootfs.hide}) | private_top
        assert {"bin", "usr", "etc", "var", "proc", "tmp"} <= top
        listed = [ln for ln in out[1:] if ln and not ln.endswith(":")]
        assert listed == ["shell-ok", "42"], out
    finally:
        shutil.rmtree(state)


# ---------------------------------------------------------------- Debian


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.timeout(1800)
def test_build_debian(cache):
    t0 = time.monotonic()
    path = build_debian("bookworm")
    built = time.monotonic() - t0
    assert path.parent == cache / "debian" and path.name.startswith("bookworm-minbase-")
    assert os.path.lexists(path / "bin/sh") and (path / "usr/bin/apt-get").exists()
    assert "bookworm" in (path / "etc/os-release").read_text() or (
        path / "etc/debian_version"
    ).read_text().startswith("12")
    ino = os.stat(path).st_ino
    t0 = time.monotonic()
    assert build_debian("bookworm") == path and os.stat(path).st_ino == ino
    assert time.monotonic() - t0 < built / 10
    rootfs = resolve("debian:bookworm")
    assert rootfs.kind == "debian" and rootfs.lowers == (path,)


def test_build_debian_bad_arguments(cache):
    with pytest.raises(RootfsError, match="suite"):
        build_debian("Bookworm; rm -rf /")
    with pytest.raises(RootfsError, match="package names"):
        build_debian("bookworm", include=["ok", "bad name"])
    with pytest.raises(RootfsError, match="not one string"):
        build_debian("bookworm", include="git")  # type: ignore[arg-type]
    assert not (cache / "debian").exists()
