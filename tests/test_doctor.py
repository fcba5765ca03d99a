"""Kernel probes, ``bunshin doctor``, CRIU location/provisioning and the CLI, on the real machine.

Each probe result is compared with evidence gathered another way (util-linux ``unshare``,
/proc/cgroups, ``stat -f``, setrlimit), so a probe that lies fails here.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bunshin import criu_locate, doctor, kerndat
from bunshin.cli import CommandUnavailable, _resolve
from bunshin.errors import UnsupportedKernel
from fake_criu import fake_criu

ROOT = Path(__file__).resolve().parent.parent
KVER = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache dir and no CRIU override, so tests see only what they set up."""
    monkeypatch.setenv("BUNSHIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("BUNSHIN_CRIU", raising=False)
    monkeypatch.setattr(kerndat, "_memo", None)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def kd():
    return kerndat.probe()


def _bunshin(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # the caller's PYTHONPATH stays behind ours: a git worktree's sitecustomize loads its sources
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    full = {**os.environ, "PYTHONPATH": path, **(env or {})}
    return subprocess.run([sys.executable, "-m", "bunshin", *argv], capture_output=True,
                          text=True, env=full, timeout=60)


def _fake_criu(path: Path, version: str, check_rc: int = 0) -> Path:
    return fake_criu(path, version, check_ok=check_rc == 0)


def _unshare_works(flag: str) -> bool:
    argv = ["unshare", flag, *(["--fork"] if flag == "--pid" else []), "true"]
    return subprocess.run(argv, capture_output=True).returncode == 0


# ---- kerndat against independent evidence -----------------------------------------------------

def test_namespaces_match_util_linux(kd):
    flags = {"mnt": "--mount", "uts": "--uts", "ipc": "--ipc", "user": "--user", "pid": "--pid",
             "net": "--net", "cgroup": "--cgroup", "time": "--time"}
    assert kd.namespaces == {ns: _unshare_works(f) for ns, f in flags.items()}
    for ns, ok in kd.namespaces.items():
        assert ok or f"ns_{ns}" in kd.why  # a refusal carries the kernel's errno


def test_filesystems_and_cgroups_match_proc(kd):
    listed = {ln.split()[-1] for ln in Path("/proc/filesystems").read_text().splitlines()}
    assert kd.overlayfs_listed == ("overlay" in listed)
    assert kd.overlayfs_mount == (kd.overlayfs_listed and _unshare_works("--mount"))
    rows = [ln.split() for ln in Path("/proc/cgroups").read_text().splitlines()[1:]]
    mounted_v1 = {r[0] for r in rows if r[1] != "0"}
    assert {c for c in kd.cgroup_v1 if not c.startswith("name=")} == mounted_v1
    for mountpoint in kd.cgroup_v1.values():
        assert os.path.ismount(mountpoint)
    if kd.cgroup_v2_mount:
        fstype = subprocess.run(["stat", "-f", "-c", "%T", kd.cgroup_v2_mount],
                                capture_output=True, text=True).stdout.strip()
        assert fstype == "cgroup2fs"
        ctl = Path(kd.cgroup_v2_mount, "cgroup.controllers").read_text().split()
        assert list(kd.cgroup_v2_controllers) == ctl
    assert kd.freezer_v1 == ("freezer" in mounted_v1)
    assert kd.freezer_v2 == (kd.cgroup_v2_mount is not None and KVER >= (5, 2))


def test_process_features_match_kernel_version_and_caps(kd):
    admin = _unshare_works("--mount")  # CAP_SYS_ADMIN, shown by a real mount namespace
    assert kd.cap_sys_admin == admin
    assert kd.clone3_set_tid == (admin and KVER >= (5, 5))
    assert kd.pidfd_open == (KVER >= (5, 3))
    assert kd.ptrace_seize == (os.geteuid() == 0 or kd.ptrace_scope in (None, 0))
    unfiltered = "Seccomp:\t0" in Path("/proc/self/status").read_text()
    assert kd.ptrace_suspend_seccomp == (admin and unfiltered and kd.ptrace_seize)
    assert kd.pagemap_pfn == admin
    assert kd.kpagecount == (admin and os.path.exists("/proc/kpagecount"))
    assert kd.userfaultfd_dev == (os.geteuid() == 0 and os.path.exists("/dev/userfaultfd"))
    ksm = Path("/sys/kernel/mm/ksm/run")
    assert kd.ksm_run == (int(ksm.read_text()) if ksm.exists() else None)
    assert kd.ksm_prctl == (ksm.exists() and KVER >= (6, 4))


def test_limits_caps_and_devices_match(kd):
    import resource

    assert kd.nofile_hard == resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    # Raising a hard limit back after lowering it needs CAP_SYS_RESOURCE.
    code = ("import resource as r; s, h = r.getrlimit(r.RLIMIT_NOFILE)\n"
            "r.setrlimit(r.RLIMIT_NOFILE, (min(s, h - 1), h - 1))\n"
            "r.setrlimit(r.RLIMIT_NOFILE, (min(s, h - 1), h))")
    raised = subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
    assert kd.cap_sys_resource == raised
    assert kd.config_modules == os.path.exists("/proc/modules")
    assert kd.bunshin_dev == os.path.exists("/dev/bunshin")
    if not kd.bunshin_dev:
        assert kd.bunshin_abi is None
    yama = Path("/proc/sys/kernel/yama/ptrace_scope")
    assert kd.ptrace_scope == (int(yama.read_text()) if yama.exists() else None)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    want = re.search(r"\[(\w+)\]", thp.read_text())[1] if thp.exists() else None
    assert kd.thp_mode == want
    assert kd.release == os.uname().release


def test_probe_leaves_nothing_behind(cache):
    fresh = kerndat.probe()  # its time is doctor's to show ("probed in N ms"), not a test's
    assert fresh.probe_seconds > 0
    mounts = list(fresh.cgroup_v1.values()) + [fresh.cgroup_v2_mount or "/nonexistent"]
    assert not [p for m in mounts for p in glob.glob(f"{m}/bunshin-probe-*")]
    assert not glob.glob(os.path.join(tempfile.gettempdir(), "bunshin-probe-*"))


def test_child_failure_and_hang_are_contained():
    def refuse():
        raise PermissionError(1, "Operation not permitted")

    pid, fd = kerndat._spawn(refuse)
    value, err = kerndat._collect(pid, fd, time.monotonic() + 5)
    assert value is None and err.startswith("EPERM")

    pid, fd = kerndat._spawn(lambda: time.sleep(60))
    t0 = time.monotonic()
    value, err = kerndat._collect(pid, fd, time.monotonic() + 0.2)
    assert time.monotonic() - t0 < 5 and value is None and "hung" in err
    assert not os.path.exists(f"/proc/{pid}")  # killed and reaped


# ---- cache ------------------------------------------------------------------------------------

def test_cache_hit_is_fast_and_a_new_boot_reprobes(cache):
    t0 = time.monotonic()
    first = kerndat.get()
    probe_time = time.monotonic() - t0
    path = kerndat.cache_path()
    stored = json.loads(path.read_text())
    assert stored["key"]["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()

    # Mark the stored answers so a cache hit is distinguishable from a re-probe.
    stored["data"]["probe_seconds"] = -1.0
    path.write_text(json.dumps(stored))
    kerndat._memo = None
    t0 = time.monotonic()
    hit = kerndat.get()
    assert time.monotonic() - t0 < probe_time
    assert hit.probe_seconds == -1.0
    assert dataclasses.replace(hit, probe_seconds=first.probe_seconds) == first

    for field, value in (("boot_id", "another-boot"), ("release", "5.10.0-old")):
        stale = json.loads(path.read_text())
        stale["key"][field] = value
        stale["data"]["probe_seconds"] = -1.0
        path.write_text(json.dumps(stale))
        kerndat._memo = None
        assert kerndat.get().probe_seconds >= 0  # re-probed
        assert json.loads(path.read_text())["key"][field] != value

    assert kerndat.get().probe_seconds >= 0
    path.write_text(json.dumps({**json.loads(path.read_text()), "data": {"junk": 1}}))
    assert kerndat.get(refresh=True).probe_seconds >= 0  # forced, and a bad file is no obstacle


def test_new_criu_changes_the_key(cache, tmp_path, monkeypatch):
    kerndat.get()
    monkeypatch.setenv("BUNSHIN_CRIU", str(_fake_criu(tmp_path / "criu", "3.17.1")))
    kd = kerndat.get()
    assert kd.criu is not None and kd.criu.version == (3, 17, 1) and not kd.criu.usable


# ---- CRIU location ----------------------------------------------------------------------------

def test_old_criu_is_refused_with_the_reason(cache, tmp_path, monkeypatch):
    fake = _fake_criu(tmp_path / "criu", "3.17.1")
    monkeypatch.setenv("BUNSHIN_CRIU", str(fake))
    info = criu_locate.find_criu()
    assert info.path == str(fake) and info.version == (3, 17, 1) and not info.usable
    assert "kernels ≥ 6.13" in info.reason and "bunshin criu provision" in info.reason
    assert info.check_ok is None  # a refused CRIU is not even asked to check
    with pytest.raises(UnsupportedKernel, match="3.17.1"):
        criu_locate.require_criu()
    out = _bunshin("doctor", env={"BUNSHIN_CRIU": str(fake), "BUNSHIN_CACHE_DIR": str(cache)})
    assert "3.17.1 found and refused" in " ".join(out.stdout.split())


def test_failed_criu_check_is_refused(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("BUNSHIN_CRIU", str(_fake_criu(tmp_path / "criu", "4.1.0", check_rc=1)))
    info = criu_locate.find_criu()
    assert info.version == (4, 1, 0) and info.check_ok is False and not info.usable
    assert "no vdso" in info.reason


def test_missing_bunshin_criu_is_a_clear_error(cache, tmp_path, monkeypatch):
    missing = tmp_path / "no-such-criu"
    monkeypatch.setenv("BUNSHIN_CRIU", str(missing))
    with pytest.raises(UnsupportedKernel, match="BUNSHIN_CRIU.*not an executable"):
        criu_locate.find_criu()
    out = _bunshin("criu", "which", env={"BUNSHIN_CRIU": str(missing)})
    assert out.returncode == 1
    assert "BUNSHIN_CRIU" in out.stderr and "Traceback" not in out.stderr


def _apt_state() -> dict[str, float]:
    paths = [*glob.glob("/etc/apt/**", recursive=True), *glob.glob("/var/lib/apt/lists/*"),
             "/var/lib/dpkg/status"]
    return {p: os.stat(p).st_mtime for p in paths if os.path.exists(p)}


@pytest.mark.slow
@pytest.mark.network
def test_provision_private_criu(tmp_path, monkeypatch):
    monkeypatch.delenv("BUNSHIN_CRIU", raising=False)
    monkeypatch.setenv("BUNSHIN_CACHE_DIR", str(tmp_path))
    before = _apt_state()
    info = criu_locate.provision_criu()
    assert _apt_state() == before  # apt's own configuration and lists are untouched
    assert info.path == str(tmp_path / "criu" / "bin" / "criu") and info.source == "private"
    assert info.version >= (4, 0, 0) and info.check_ok and info.usable
    assert info.pycriu and Path(info.pycriu, "pycriu", "__init__.py").is_file()
    assert not (tmp_path / "criu.new").exists() and not (tmp_path / "criu" / "debs").exists()
    assert criu_locate.find_criu(check=False).path == info.path  # found by the default search

    with pytest.raises(UnsupportedKernel, match="CRIU provisioning"):
        criu_locate.provision_criu(tmp_path / "other", suite="no-such-suite")
    assert not (tmp_path / "other.new").exists() and not (tmp_path / "other").exists()


# ---- doctor and CLI ---------------------------------------------------------------------------

def test_doctor_exits_zero_here_and_json_parses(cache):
    out = _bunshin("doctor", env={"BUNSHIN_CACHE_DIR": str(cache)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "clone3 set_tid" in out.stdout and "Everything Bunshin needs" in out.stdout
    js = _bunshin("doctor", "--json", "--refresh", env={"BUNSHIN_CACHE_DIR": str(cache)})
    assert js.returncode == 0
    data = kerndat.KernDat.from_dict(json.loads(js.stdout))
    assert data.release == os.uname().release and data.namespaces["pid"]
    assert doctor.missing_needs(data) == []


def test_doctor_names_what_a_missing_need_costs(kd):
    crippled = dataclasses.replace(kd, clone3_set_tid=False, freezer_v1=False, freezer_v2=False)
    missing = {c.name: c.cost for c in doctor.missing_needs(crippled)}
    assert set(missing) == {"clone3 set_tid", "cgroup freezer"}
    assert "forks cannot keep PIDs" in missing["clone3 set_tid"]
    optional = {c.name: c for c in doctor.checks(dataclasses.replace(kd, bunshin_dev=False))}
    assert "user-space fork engine" in optional["/dev/bunshin"].cost
    assert not optional["/dev/bunshin"].required


def test_cli_reports_missing_modules_but_not_broken_ones(tmp_path, monkeypatch):
    with pytest.raises(CommandUnavailable, match="bunshin.no_such_module"):
        _resolve("bunshin.no_such_module:main")
    with pytest.raises(CommandUnavailable, match="no_such_function"):
        _resolve("bunshin.doctor:no_such_function")
    (tmp_path / "brokencmd.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        _resolve("brokencmd:main")
    assert _bunshin("--version").stdout.startswith("bunshin ")
    assert _bunshin().returncode == 2
