"""What this kernel can do, probed once and cached (the counterpart of CRIU's kerndat.c).

Every probe that calls into the kernel (unshare, mount, clone3, prctl, ptrace, cgroup freeze)
runs in a forked child, all children at once, so a crash or hang costs the caller nothing and
the whole set takes well under a second. Answers are cached in ``config.cache_dir()/kerndat.json``
keyed by kernel release, boot id and the CRIU that would be used: a reboot, a new kernel or a new
CRIU re-probes; ``get(refresh=True)`` (``bunshin doctor --refresh``) forces it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import json
import logging
import mmap
import os
import resource
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import config, criu_locate
from .criu_locate import CriuInfo
from .fdwait import readable

__all__ = ["KernDat", "get", "probe", "cache_path", "NAMESPACES"]

log = logging.getLogger("bunshin.kerndat")

_SCHEMA = 3
_DEADLINE = 3.0  # seconds; a probe still running then is killed and reported as hung
NAMESPACES = {  # name -> CLONE_NEW* flag
    "mnt": 0x00020000, "uts": 0x04000000, "ipc": 0x08000000, "user": 0x10000000,
    "pid": 0x20000000, "net": 0x40000000, "cgroup": 0x02000000, "time": 0x00000080,
}
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
_SYS_PIDFD_OPEN, _SYS_CLONE3, _SYS_USERFAULTFD, _SYS_OPEN_TREE = 434, 435, 323, 428
_OPEN_TREE_CLONE = 1
_PR_SET_MEMORY_MERGE, _PR_GET_MEMORY_MERGE = 67, 68
_PTRACE_SEIZE = 0x4206
_PTRACE_O_SUSPEND_SECCOMP = 1 << 21
_USERFAULTFD_IOC_NEW = 0xAA00  # _IO(0xAA, 0x00) from linux/userfaultfd.h
_CAP_SYS_ADMIN, _CAP_SYS_RESOURCE = 21, 24
_PROBE_TID = 77  # any pid but 2 proves set_tid was honoured in a fresh pid namespace

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


@dataclasses.dataclass(frozen=True)
class KernDat:
    """The kernel's answers. ``why`` maps a failed probe's name to what the kernel said."""

    release: str
    boot_id: str
    namespaces: dict[str, bool]
    overlayfs_listed: bool
    overlayfs_mount: bool
    overlayfs_detached_layer: bool  # a detached mount (open_tree clone) taken as a layer
    cgroup_v1: dict[str, str]  # controller (or name=...) -> mount point
    cgroup_v2_mount: str | None
    cgroup_v2_controllers: tuple[str, ...]
    freezer_v1: bool
    freezer_v2: bool
    clone3_set_tid: bool
    pidfd_open: bool
    pagemap_pfn: bool
    kpagecount: bool
    userfaultfd_syscall: bool
    userfaultfd_dev: bool
    ksm_run: int | None  # /sys/kernel/mm/ksm/run; None when the kernel has no KSM
    ksm_prctl: bool
    thp_mode: str | None
    ptrace_scope: int | None  # None when Yama is not built in
    ptrace_seize: bool
    ptrace_suspend_seccomp: bool  # PTRACE_O_SUSPEND_SECCOMP allowed to this process
    nofile_hard: int
    cap_sys_admin: bool
    cap_sys_resource: bool
    config_modules: bool
    bunshin_dev: bool
    bunshin_abi: int | None
    criu: CriuInfo | None
    why: dict[str, str]
    probe_seconds: float

    @property
    def freezer(self) -> bool:
        """A cgroup freezer works (v1 ``freezer`` hierarchy or v2 ``cgroup.freeze``)."""
        return self.freezer_v1 or self.freezer_v2

    @property
    def ksm(self) -> bool:
        """KSM exists and processes may opt in whole (``PR_SET_MEMORY_MERGE``)."""
        return self.ksm_run is not None and self.ksm_prctl

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready form (``bunshin doctor --json``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KernDat:
        """Inverse of :meth:`to_dict`; raises ``TypeError``/``KeyError`` on a foreign shape."""
        d = dict(d)
        d["cgroup_v2_controllers"] = tuple(d["cgroup_v2_controllers"])
        d["criu"] = CriuInfo.from_dict(d["criu"]) if d["criu"] else None
        return cls(**d)


# ---- children -------------------------------------------------------------------------------

def _check(ret: int) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret


def _spawn(fn: Callable[[], Any]) -> tuple[int, int]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into the caller's code
        code = 0
        try:
            os.setpgid(0, 0)  # one group per probe, so a hung probe is killed with its helpers
            os.close(r)
            try:
                out: dict[str, Any] = {"ok": fn()}
            except OSError as e:
                out = {"err": f"{errno.errorcode.get(e.errno or 0, 'E?')}: {e.strerror or e}"}
            except Exception as e:  # noqa: BLE001 - reported to the parent verbatim
                out = {"err": f"{type(e).__name__}: {e}"}
            os.write(w, json.dumps(out).encode())
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with contextlib.suppress(OSError):  # the child may not have run yet, or already exited
        os.setpgid(pid, pid)
    return pid, r


def _collect(pid: int, fd: int, deadline: float) -> tuple[Any, str | None]:
    buf = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not readable(fd, left):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    os.kill(pid, signal.SIGKILL)
                return None, f"probe hung for more than {_DEADLINE:.0f} s and was killed"
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
    finally:
        os.close(fd)
        os.waitpid(pid, 0)
    if not buf:
        return None, "probe child died without an answer"
    out = json.loads(buf)
    return out.get("ok"), out.get("err")


def _wait_exit(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


# ---- probes run in a child ------------------------------------------------------------------

def _p_unshare(flag: int) -> Callable[[], bool]:
    return lambda: _check(_libc.unshare(flag)) == 0


def _overlay_dirs(tmp: str) -> tuple[str, str, str, str]:
    """lower, upper, work and merged directories on a tmpfs of a private mount namespace."""
    _check(_libc.unshare(NAMESPACES["mnt"]))
    _check(_libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None))
    _check(_libc.mount(b"tmpfs", tmp.encode(), b"tmpfs", 0, b"size=1m"))
    lo, up, wk, mp = (os.path.join(tmp, d) for d in ("lower", "upper", "work", "merged"))
    for d in (lo, up, wk, mp):
        os.mkdir(d)
    return lo, up, wk, mp


def _p_overlay(tmp: str) -> bool:
    lo, up, wk, mp = _overlay_dirs(tmp)
    Path(lo, "f").write_text("lower")
    opts = f"lowerdir={lo},upperdir={up},workdir={wk}".encode()
    _check(_libc.mount(b"overlay", mp.encode(), b"overlay", 0, opts))
    Path(mp, "g").write_text("upper")
    return Path(mp, "f").read_text() == "lower" and Path(up, "g").read_text() == "upper"


def _p_overlay_detached(tmp: str) -> bool:
    """Whether overlayfs takes a layer that is a detached mount, named as /proc/self/fd/N:
    6.1 refuses one ("failed to clone lowerpath": it clones only mounts of the caller's mount
    namespace), newer kernels take it (how a sandbox's idmapped layers are named)."""
    lo, up, wk, mp = _overlay_dirs(tmp)
    fd = _check(_libc.syscall(_SYS_OPEN_TREE, -100, lo.encode(), _OPEN_TREE_CLONE | os.O_CLOEXEC))
    opts = f"lowerdir=/proc/self/fd/{fd},upperdir={up},workdir={wk}".encode()
    if _libc.mount(b"overlay", mp.encode(), b"overlay", 0, opts) == 0:
        return True
    e = ctypes.get_errno()
    if e == errno.EINVAL:
        return False
    raise OSError(e, os.strerror(e))


def _p_freeze(root: str, v2: bool) -> bool:
    cg = os.path.join(root, f"bunshin-probe-{os.getpid()}")
    os.mkdir(cg)
    victim = os.fork()
    if victim == 0:
        while True:
            signal.pause()
    ctl, on, off = (("cgroup.freeze", "1", "0") if v2 else ("freezer.state", "FROZEN", "THAWED"))
    try:
        Path(cg, "cgroup.procs").write_text(str(victim))
        Path(cg, ctl).write_text(on)
        for _ in range(200):
            state = Path(cg, "cgroup.events" if v2 else ctl).read_text()
            if ("frozen 1" in state) if v2 else state.strip() == "FROZEN":
                return True
            time.sleep(0.002)
        return False
    finally:
        Path(cg, ctl).write_text(off)
        os.kill(victim, signal.SIGKILL)
        os.waitpid(victim, 0)
        os.rmdir(cg)


def _clone3_set_tid(tid: int) -> int:
    set_tid = (ctypes.c_int32 * 1)(tid)
    args = (ctypes.c_uint64 * 11)()
    args[4] = signal.SIGCHLD  # exit_signal
    args[8] = ctypes.addressof(set_tid)
    args[9] = 1  # set_tid_size
    ret = _libc.syscall(ctypes.c_long(_SYS_CLONE3), ctypes.byref(args),
                        ctypes.c_size_t(ctypes.sizeof(args)))
    if ret == 0:  # the clone: leave at once, it shares nothing worth running
        os._exit(0)
    return _check(ret)


def _p_clone3() -> bool:
    _check(_libc.unshare(NAMESPACES["pid"]))
    init = os.fork()  # PID 1 of the new namespace
    if init == 0:
        code = 0
        try:
            child = _clone3_set_tid(_PROBE_TID)
            _wait_exit(child)
            code = 0 if child == _PROBE_TID else 100
        except OSError as e:
            code = min(e.errno or 99, 99)
        os._exit(code)
    code = _wait_exit(init)
    if code == 100:
        raise RuntimeError(f"clone3 ignored set_tid={_PROBE_TID}")
    if code:
        raise OSError(code, os.strerror(code))
    return True


def _p_pidfd() -> bool:
    os.close(_check(_libc.syscall(ctypes.c_long(_SYS_PIDFD_OPEN), os.getpid(), 0)))
    return True


def _p_pagemap() -> dict[str, bool]:
    page = mmap.mmap(-1, mmap.PAGESIZE)
    page[0] = 1  # fault it in so it has a frame
    addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(addr // mmap.PAGESIZE * 8)
        entry = int.from_bytes(f.read(8), "little")
    pfn = entry & ((1 << 55) - 1) if entry >> 63 else 0
    count = 0
    if pfn:
        with open("/proc/kpagecount", "rb") as f:
            f.seek(pfn * 8)
            count = int.from_bytes(f.read(8), "little")
    return {"pagemap_pfn": pfn != 0, "kpagecount": count >= 1}


def _p_uffd_syscall() -> bool:
    flags = os.O_CLOEXEC | os.O_NONBLOCK
    os.close(_check(_libc.syscall(ctypes.c_long(_SYS_USERFAULTFD), flags)))
    return True


def _p_uffd_dev() -> bool:
    dev = os.open("/dev/userfaultfd", os.O_RDWR | os.O_CLOEXEC)
    try:
        os.close(fcntl.ioctl(dev, _USERFAULTFD_IOC_NEW, os.O_CLOEXEC))
    finally:
        os.close(dev)
    return True


def _p_ksm_prctl() -> bool:
    _check(_libc.prctl(_PR_SET_MEMORY_MERGE, 1, 0, 0, 0))
    return _libc.prctl(_PR_GET_MEMORY_MERGE, 0, 0, 0, 0) == 1


def _p_ptrace(options: int = 0) -> bool:
    victim = os.fork()
    if victim == 0:
        while True:
            signal.pause()
    try:
        _libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        _check(_libc.ptrace(_PTRACE_SEIZE, victim, None, options or None))
        return True
    finally:
        os.kill(victim, signal.SIGKILL)
        os.waitpid(victim, 0)


# ---- probes read in place (plain files; nothing here can disturb the caller) ----------------

def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _cgroup_mounts() -> tuple[dict[str, str], str | None]:
    # Mount options also carry flags (xattr, noprefix, clone_children): only names the kernel
    # lists as controllers, or named hierarchies, count.
    known = {ln.split()[0] for ln in (_read("/proc/cgroups") or "").splitlines()[1:] if ln}
    v1: dict[str, str] = {}
    v2 = None
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        fstype, _src, superopts = (right.split() + ["", "", ""])[:3]
        mountpoint = left.split()[4]
        if fstype == "cgroup2" and v2 is None:
            v2 = mountpoint
        elif fstype == "cgroup":
            for opt in superopts.split(","):
                if opt in known or opt.startswith("name="):
                    v1.setdefault(opt, mountpoint)
    return v1, v2


def _caps() -> int:
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _bunshin_module_version() -> int | None:
    """ABI version reported by /dev/bunshin (GET_VERSION), or None when the module is absent
    or does not answer."""
    if not os.path.exists("/dev/bunshin"):
        return None
    from ._core import _kmod

    try:
        fd = os.open("/dev/bunshin", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _kmod.get_version(fd)[0]
    except OSError:
        return None
    finally:
        os.close(fd)


def _key() -> dict[str, Any]:
    try:
        cand = criu_locate.candidate()
        criu = f"{cand[0]}:{cand[0].stat().st_mtime_ns}" if cand else None
    except Exception as e:  # noqa: BLE001 - a bad BUNSHIN_CRIU is part of the state we cache
        criu = f"invalid: {e}"
    boot_id = (_read("/proc/sys/kernel/random/boot_id") or "").strip()
    return {"schema": _SCHEMA, "release": os.uname().release, "boot_id": boot_id, "criu": criu,
            "criu_plugin": criu_locate.plugin_key()}


def probe() -> KernDat:
    """Run every probe now (no cache) and return the answers."""
    t0 = time.monotonic()
    v1, v2 = _cgroup_mounts()
    tmp = tempfile.mkdtemp(prefix="bunshin-probe-")
    jobs: dict[str, Callable[[], Any]] = {f"ns_{n}": _p_unshare(f) for n, f in NAMESPACES.items()}
    tmp_detached = tempfile.mkdtemp(prefix="bunshin-probe-")
    jobs |= {"overlayfs_mount": lambda: _p_overlay(tmp),
             "overlayfs_detached_layer": lambda: _p_overlay_detached(tmp_detached), "clone3_set_tid": _p_clone3,
             "pidfd_open": _p_pidfd, "pagemap": _p_pagemap, "ksm_prctl": _p_ksm_prctl,
             "userfaultfd_syscall": _p_uffd_syscall, "userfaultfd_dev": _p_uffd_dev,
             "ptrace_seize": _p_ptrace,
             "ptrace_suspend_seccomp": lambda: _p_ptrace(_PTRACE_O_SUSPEND_SECCOMP)}
    if "freezer" in v1:
        jobs["freezer_v1"] = lambda: _p_freeze(v1["freezer"], v2=False)
    if v2:
        jobs["freezer_v2"] = lambda: _p_freeze(v2, v2=True)
    children = {name: _spawn(fn) for name, fn in jobs.items()}
    why: dict[str, str] = {}
    criu = None
    try:  # CRIU runs as its own processes while the children work
        criu = criu_locate.find_criu(check=True)
    except Exception as e:  # noqa: BLE001 - doctor shows it; require_criu raises it again
        why["criu"] = str(e)
    deadline = time.monotonic() + _DEADLINE
    res: dict[str, Any] = {}
    for name, (pid, fd) in children.items():
        res[name], err = _collect(pid, fd, deadline)
        if err:
            why[name] = err
        if name.startswith("freezer"):  # a killed probe cannot clean up after itself
            root = v1.get("freezer") if name == "freezer_v1" else v2
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(root or "", f"bunshin-probe-{pid}"))
    os.rmdir(tmp)
    os.rmdir(tmp_detached)
    pagemap = res.get("pagemap") or {}
    v2_controllers = (_read(f"{v2}/cgroup.controllers") or "").split() if v2 else []
    caps = _caps()
    return KernDat(
        release=os.uname().release,
        boot_id=(_read("/proc/sys/kernel/random/boot_id") or "").strip(),
        namespaces={n: bool(res.get(f"ns_{n}")) for n in NAMESPACES},
        overlayfs_listed=any(ln.split()[-1:] == ["overlay"]
                             for ln in (_read("/proc/filesystems") or "").splitlines()),
        overlayfs_mount=bool(res.get("overlayfs_mount")),
        overlayfs_detached_layer=bool(res.get("overlayfs_detached_layer")),
        cgroup_v1=v1,
        cgroup_v2_mount=v2,
        cgroup_v2_controllers=tuple(v2_controllers),
        freezer_v1=bool(res.get("freezer_v1")),
        freezer_v2=bool(res.get("freezer_v2")),
        clone3_set_tid=bool(res.get("clone3_set_tid")),
        pidfd_open=bool(res.get("pidfd_open")),
        pagemap_pfn=bool(pagemap.get("pagemap_pfn")),
        kpagecount=bool(pagemap.get("kpagecount")),
        userfaultfd_syscall=bool(res.get("userfaultfd_syscall")),
        userfaultfd_dev=bool(res.get("userfaultfd_dev")),
        ksm_run=_int_or_none(_read("/sys/kernel/mm/ksm/run")),
        ksm_prctl=bool(res.get("ksm_prctl")),
        thp_mode=_thp_mode(),
        ptrace_scope=_int_or_none(_read("/proc/sys/kernel/yama/ptrace_scope")),
        ptrace_seize=bool(res.get("ptrace_seize")),
        ptrace_suspend_seccomp=bool(res.get("ptrace_suspend_seccomp")),
        nofile_hard=resource.getrlimit(resource.RLIMIT_NOFILE)[1],
        cap_sys_admin=bool(caps >> _CAP_SYS_ADMIN & 1),
        cap_sys_resource=bool(caps >> _CAP_SYS_RESOURCE & 1),
        config_modules=os.path.exists("/proc/modules"),
        bunshin_dev=os.path.exists("/dev/bunshin"),
        bunshin_abi=_bunshin_module_version(),
        criu=criu,
        why=why,
        probe_seconds=round(time.monotonic() - t0, 4),
    )


def _thp_mode() -> str | None:
    text = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    if text and "[" in text:
        return text.split("[", 1)[1].split("]", 1)[0]
    return None


def cache_path() -> Path:
    """The JSON file holding the cached answers."""
    return config.cache_dir() / "kerndat.json"


_memo: tuple[dict[str, Any], KernDat] | None = None


def get(refresh: bool = False) -> KernDat:
    """The kernel's answers: from memory, else from the cache file, else probed (and cached)."""
    global _memo
    key = _key()
    if not refresh and _memo is not None and _memo[0] == key:
        return _memo[1]
    path = cache_path()
    if not refresh:
        try:
            stored = json.loads(path.read_text())
            if stored.get("key") == key:
                kd = KernDat.from_dict(stored["data"])
                _memo = (key, kd)
                return kd
        except (OSError, ValueError, TypeError, KeyError):
            pass  # absent, unreadable or from another schema: probe afresh
    kd = probe()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "data": kd.to_dict()}, indent=1))
        tmp.replace(path)
    except OSError as e:
        log.warning("kerndat: cannot cache probe results in %s: %s", path, e)
    _memo = (key, kd)
    return kd
