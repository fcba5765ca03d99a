"""Escape attempts from a sandbox workspace (``isolation="sandbox"``), from a fork of it
(``ws.fork``) and from a snapshot's fork (``tpl.fork``): each must fail, and the host, checked
from the host, must be unchanged. The attempts themselves are tests/victims/escape.py.

Attempts only a user namespace per workspace stops (root of the workspace is root of the host
for mounts, remounts and cgroupfs until then) are marked xfail, strictly: once the user
namespace is in, they pass and the marker must go.

With ``BUNSHIN_ESCAPE_OUT=PATH`` the session writes the table of attempts and their outcome
per path to PATH (markdown, docs/escape-table.md; JSON when PATH ends in ``.json``)."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
import struct
import time
from pathlib import Path

import pytest

import bunshin

WHERE = ("workspace", "ws.fork", "tpl.fork")
CORE_PATTERN = "/proc/sys/kernel/core_pattern"
SWAPPINESS = "/proc/sys/vm/swappiness"
PIDS_LIMIT = 64
DISK_LIMIT = 64 << 20

# attempt -> (what it tries, what stops it); the README table's rows
ATTEMPTS: dict[str, tuple[str, str]] = {}
_results: dict[tuple[str, str], str] = {}


def attempt(name: str, what: str, stopped_by: str):
    ATTEMPTS[name] = (what, stopped_by)
    return name


def _read(path: str) -> str:
    try:
        text = Path(path).read_text()
    except OSError as e:
        return f"<{e.strerror}>"
    if path == "/proc/keys":  # which keys exist, not their timeouts and use counts, which tick
        return "\n".join(sorted(" ".join(ln.split()[:1] + ln.split()[7:9]) for ln in text.splitlines()))
    return text


@pytest.fixture(scope="module")
def boxes():
    """A sandbox workspace with the attempts' script, its fork and its snapshot's fork."""
    ws = bunshin.Workspace.create(isolation="sandbox", pids_limit=PIDS_LIMIT,
                                  memory_limit="256M", disk_limit=DISK_LIMIT)
    made = [ws]
    try:
        ws.write_file("/escape.py", (Path(__file__).parent / "victims" / "escape.py").read_text())
        ws.spawn(["sleep", "100000"])  # a process of the template, cloned into each fork
        made += ws.fork(1)
        with ws.snapshot() as tpl:
            made += tpl.fork(1)
        yield dict(zip(WHERE, made))
    finally:
        for w in reversed(made):
            w.close()
        _write_table()


@pytest.fixture(params=WHERE)
def box(request, boxes):
    return request.param, boxes[request.param]


def _try(box, name: str, *args: str) -> dict:
    where, w = box
    r = w.run(" ".join(["python3", "/escape.py", name, *map(str, args)]), timeout=60)
    assert r.exit_code == 0, r.stderr.decode()
    got = json.loads(r.stdout.decode().splitlines()[-1])
    _results[(name, where)] = (f"**got through**: {got['detail']}" if got["done"] else
                               f"refused ({errno.errorcode.get(got['errno'], got['errno'])})")
    return got


def _refused(box, name: str, *args: str, want: tuple[int, ...] = ()) -> dict:
    got = _try(box, name, *args)
    assert not got["done"], got["detail"]
    if want:
        assert got["errno"] in want, got
    return got


def _refused_leaving(box, name: str, host_file: str, *args: str) -> None:
    """The attempt is refused and ``host_file`` is as it was (put back if it was not, so that
    one finding does not leave the host changed)."""
    before = _read(host_file)
    try:
        _refused(box, name, *args)
    finally:
        changed = _read(host_file) != before
        if changed:
            Path(host_file).write_text(before)
    assert not changed


def _write_table() -> None:
    out = os.environ.get("BUNSHIN_ESCAPE_OUT")
    if not out:
        return
    rows = [{"attempt": n, "tries": what, "stopped by": by,
             **{w: _results.get((n, w), "not run") for w in WHERE}}
            for n, (what, by) in ATTEMPTS.items()]
    if out.endswith(".json"):
        Path(out).write_text(json.dumps(rows, indent=1) + "\n")
        return
    head = ["attempt", "tries", "stopped by", *WHERE]
    lines = [f"# Sandbox escape attempts — `BUNSHIN_ESCAPE_OUT={out} pytest tests/test_escape.py`", "",
             "Each attempt from inside a sandbox workspace (`isolation=\"sandbox\"`), a `ws.fork()`",
             "child and a `tpl.fork()` child; the test checks from the host that nothing changed there.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[h]).replace("|", "/") for h in head) + " |" for r in rows]
    Path(out).write_text("\n".join(lines) + "\n")


# --- host sysctls and /proc


@pytest.mark.parametrize("name,path", [
    (attempt("core_pattern", "write kernel.core_pattern", "/proc/sys read-only"), CORE_PATTERN),
    (attempt("swappiness", "write a host sysctl (vm.swappiness)", "/proc/sys read-only"),
     SWAPPINESS)])
def test_host_sysctls_are_read_only(box, name, path):
    before = _read(path)
    value = "|/bin/false bunshin-escape" if name == "core_pattern" else "37"
    try:
        _refused(box, name, repr(value), want=(errno.EROFS,))
    finally:
        assert _read(path) == before or Path(path).write_text(before) is None
    assert _read(path) == before


@pytest.mark.parametrize("name", [
    attempt("core_pattern_remount", "remount /proc/sys read-write, write kernel.core_pattern",
            "user namespace (locked mounts)"),
    attempt("core_pattern_new_proc", "mount a new proc, write kernel.core_pattern",
            "user namespace (a masked /proc is not fully visible)")])
def test_host_sysctls_stay_read_only_against_mounts(box, name):
    """The value written is the host's own: where the write gets through (this branch), the
    host's core dumps never see another handler; the write's success is the finding."""
    _refused_leaving(box, name, CORE_PATTERN, repr(_read(CORE_PATTERN).strip()))


def test_sysrq_trigger(box):
    attempt("sysrq_trigger", "write /proc/sysrq-trigger", "read-only bind (or no sysrq)")
    printk = _read("/proc/sys/kernel/printk")
    _refused(box, "sysrq_trigger", "9", want=(errno.EROFS, errno.ENOENT))
    assert _read("/proc/sys/kernel/printk") == printk


def test_masked_paths_show_nothing(box):
    attempt("masked_paths", "read /proc/kcore, keys, timer_list, sched_debug, acpi, "
            "/sys/firmware", "masked (/dev/null, empty tmpfs)")
    where, w = box
    leaked = []
    for p in ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug",
              "/proc/latency_stats", "/proc/interrupts"):
        r = w.run(f"test -e {p} && head -c 64 {p} | wc -c")
        if r.stdout.strip() not in (b"", b"0"):
            leaked.append(p)
    for d in ("/proc/acpi", "/proc/scsi", "/proc/asound", "/sys/firmware"):
        r = w.run(f"ls -A {d} 2>/dev/null | head -1")
        if r.stdout.strip():
            leaked.append(d)
    _results[("masked_paths", where)] = (f"**shown**: {leaked}" if leaked else "empty")
    assert not leaked


def test_own_net_sysctls_stay_writable(box):
    where, w = box
    host = _read("/proc/sys/net/ipv4/tcp_fin_timeout")
    r = w.run("echo 17 > /proc/sys/net/ipv4/tcp_fin_timeout && cat /proc/sys/net/ipv4/tcp_fin_timeout")
    assert r.stdout == b"17\n", r
    assert _read("/proc/sys/net/ipv4/tcp_fin_timeout") == host  # the workspace's netns only


# --- mounts


@pytest.mark.parametrize("name", [
    attempt("mount_devtmpfs", "mount devtmpfs (the host's devices)", "user namespace"),
    attempt("mount_sysfs", "mount a sysfs (writable)", "user namespace"),
    attempt("mount_cgroup", "mount a cgroupfs, see another group or raise its limit through it",
            "cgroup namespace (its own group alone), its files host root's")])
def test_mounts_of_host_file_systems(box, name):
    _refused(box, name)


def _host_binfmt(name: str, remove: bool) -> bool:
    """Whether the host's binfmt_misc table has ``name`` (removed with ``remove``): looked at
    through a mount of its own, in a mount namespace of its own."""
    import subprocess

    entry = f"/proc/sys/fs/binfmt_misc/{name}"
    script = (f"mount -t binfmt_misc none /proc/sys/fs/binfmt_misc || exit 2; test -e {entry} || exit 1; "
              + (f"echo -1 > {entry}; " if remove else "") + "exit 0")
    return subprocess.run(["unshare", "-m", "sh", "-c", script], timeout=30).returncode == 0


def test_binfmt_misc_is_not_the_hosts(box):
    attempt("binfmt_misc", "register a binfmt_misc interpreter (run as root by the host)",
            "user namespace (its own binfmt_misc, Linux ≥ 6.7)")
    name = f"bunshin_escape_{os.getpid()}"
    got = _try(box, "binfmt_misc", name)
    assert not _host_binfmt(name, remove=True)
    if got["done"]:  # in the workspace's own table, which the host never reads
        _results[("binfmt_misc", box[0])] = "its own table only (the host's unchanged)"


def _root_dev() -> tuple[int, int]:
    st = os.stat("/")
    return os.major(st.st_dev), os.minor(st.st_dev)


def test_mount_a_block_device(box):
    attempt("mount_block", "mknod the host's disk and mount it",
            "the kernel (EBUSY: the disk is held); else the user namespace")
    got = _try(box, "mount_block", *_root_dev())
    assert not got["done"], got


def test_read_a_block_device(box):
    attempt("read_block", "mknod the host's disk in /dev and read it raw",
            "the kernel (EPERM opening the node); else the user namespace")
    got = _try(box, "read_block", *_root_dev())
    assert not got["done"], got


# --- the clock, the kernel, the machine


@pytest.mark.parametrize("name", [
    attempt("settimeofday", "settimeofday", "seccomp; CAP_SYS_TIME dropped"),
    attempt("clock_settime", "clock_settime(CLOCK_REALTIME)", "seccomp; CAP_SYS_TIME dropped"),
    attempt("adjtimex", "adjtimex(ADJ_MAXERROR)", "CAP_SYS_TIME dropped"),
    attempt("clock_adjtime", "clock_adjtime(CLOCK_REALTIME, ADJ_MAXERROR)",
            "CAP_SYS_TIME dropped")])
def test_the_clock(box, name):
    start, mono = time.time(), time.monotonic()
    _refused(box, name, want=(errno.EPERM,))
    assert abs((time.time() - start) - (time.monotonic() - mono)) < 1.0


@pytest.mark.parametrize("name,host_file", [
    (attempt("init_module", "init_module", "seccomp; CAP_SYS_MODULE dropped"), "/proc/modules"),
    (attempt("finit_module", "finit_module", "seccomp; CAP_SYS_MODULE dropped"), "/proc/modules"),
    (attempt("delete_module", "delete_module", "seccomp; CAP_SYS_MODULE dropped"), "/proc/modules"),
    (attempt("kexec_load", "kexec_load", "seccomp; CAP_SYS_BOOT dropped"),
     "/sys/kernel/kexec_loaded"),
    (attempt("kexec_file_load", "kexec_file_load", "seccomp; CAP_SYS_BOOT dropped"),
     "/sys/kernel/kexec_loaded"),
    (attempt("reboot", "reboot(CAD_OFF)", "seccomp; CAP_SYS_BOOT dropped"), "/proc/uptime"),
    (attempt("swapon", "swapon", "seccomp"), "/proc/swaps"),
    (attempt("i386_keyctl", "keyctl through the i386 ABI (int $0x80)", "seccomp (its i386 part)"),
     "/proc/keys")])
def test_the_kernel_and_the_machine(box, name, host_file):
    before = _read(host_file) if host_file != "/proc/uptime" else ""
    _refused(box, name, want=(errno.EPERM,))
    if host_file != "/proc/uptime":
        assert _read(host_file) == before
    assert box[1].run("echo alive").stdout == b"alive\n"


# --- the host's files and processes


def _handle(path: str) -> str:
    """A struct file_handle of the host's ``path`` (name_to_handle_at, here)."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(struct.pack("Ii", 128, 0) + b"\0" * 128)
    mount_id = ctypes.c_int()
    if libc.name_to_handle_at(-100, path.encode(), buf, ctypes.byref(mount_id), 0):
        raise OSError(ctypes.get_errno(), "name_to_handle_at")
    size = struct.unpack_from("I", buf.raw)[0]
    return buf.raw[:8 + size].hex()


@pytest.fixture(scope="module")
def host_marker():
    """A host file no workspace shows (/run is a private tmpfs in each)."""
    d = Path(f"/run/bunshin-escape-{os.getpid()}")
    d.mkdir(exist_ok=True)
    (d / "marker").write_text("host secret\n")
    yield str(d / "marker")
    (d / "marker").unlink()
    d.rmdir()


def test_open_by_handle_at_a_host_inode(box, host_marker):
    attempt("open_by_handle_at", "open_by_handle_at on a host inode", "seccomp")
    _refused(box, "open_by_handle_at", _handle(host_marker), want=(errno.EPERM,))


def test_host_root_is_out_of_reach(box, host_marker):
    attempt("host_root", "reach the host's root: /proc/*/root, `..`, a chroot breakout",
            "pid namespace, pivot_root")
    _refused(box, "host_root", host_marker)


@pytest.mark.parametrize("name", [
    attempt("kill_trainer", "kill the trainer", "pid namespace"),
    attempt("ptrace_trainer", "ptrace the trainer", "pid namespace"),
    attempt("vm_readv_trainer", "process_vm_readv the trainer", "pid namespace")])
def test_the_trainer_is_out_of_reach(box, name):
    _refused(box, name, os.getpid(), want=(errno.ESRCH, errno.EPERM))
    assert Path("/proc/self/status").read_text().count("TracerPid:\t0\n") == 1


def test_no_process_holds_a_host_descriptor(box):
    """Checked from the host: every descriptor of the workspace's processes is on one of its
    own mounts, or a pipe, socket or anonymous inode."""
    attempt("leaked_descriptor", "use a descriptor of the host's", "none held (checked)")
    where, w = box
    own = set()
    init = w.host_pids()[0] if w.host_pids() else None
    for line in Path(f"/proc/{w.init_pid}/mountinfo").read_text().splitlines():
        major, minor = line.split()[2].split(":")
        own.add(os.makedev(int(major), int(minor)))
    # the host's /dev/null & co. (ws.spawn's stdio) open nothing the workspace's own lack
    same = {os.stat(f"/dev/{n}").st_rdev for n in ("null", "zero", "full", "random", "urandom")}
    bad = []
    for pid in w.host_pids():
        for fd in os.listdir(f"/proc/{pid}/fd"):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            st = os.stat(f"/proc/{pid}/fd/{fd}")
            if link.split(":")[0] in ("pipe", "socket", "anon_inode") or st.st_dev in own:
                continue
            if not (stat.S_ISCHR(st.st_mode) and st.st_rdev in same):
                bad.append((pid, int(fd), link))
    _results[("leaked_descriptor", where)] = f"**held**: {bad}" if bad else "none held"
    assert init is not None and not bad


def test_the_init_binary_cannot_be_overwritten(box):
    attempt("init_exe", "overwrite the host's bunshin-init through /proc/1/exe",
            "the user namespace (the file is host root's: EACCES); else the kernel (ETXTBSY "
            "while an init runs it)")
    _refused(box, "init_exe", want=(errno.EACCES, errno.ETXTBSY))


def test_a_nested_user_namespace_gains_nothing(box):
    attempt("nested_userns", "unshare -U (full capabilities there), then devtmpfs, the clock, "
            "a module, a sysctl", "seccomp; capabilities of a child namespace")
    before = _read(SWAPPINESS)
    _refused(box, "nested_userns")
    assert _read(SWAPPINESS) == before


# --- limits and the network


def test_cgroup_limits_and_membership(box):
    attempt("cgroup_limits", "raise its own pids limit, move itself out of its cgroup",
            "user namespace (no cgroupfs)")
    where, w = box
    (pids_max,) = [f"{d}/pids.max" for d in w.cgroup.dirs() if os.path.exists(f"{d}/pids.max")]
    _refused_leaving(box, "cgroup_limits", pids_max, "max")


def test_fork_bomb_stays_within_the_pids_limit(box):
    attempt("fork_bomb", "fork bomb", "the workspace's pids limit")
    where, w = box
    keep = set(w.host_pids())
    w.run(":(){ :|:& };:", timeout=3)
    time.sleep(0.5)
    most = len(w.host_pids())
    # not w.kill_all(): a kill of all in the source reaches its children's processes too
    w.cgroup.freeze()
    try:
        for pid in set(w.host_pids()) - keep:
            os.kill(pid, 9)
    finally:
        w.cgroup.thaw()
    deadline = time.monotonic() + 10
    while set(w.host_pids()) - keep and time.monotonic() < deadline:
        time.sleep(0.05)
    _results[("fork_bomb", where)] = f"held at {most} ≤ {PIDS_LIMIT} processes"
    assert most <= PIDS_LIMIT
    assert w.run("echo alive").stdout == b"alive\n"


def test_memory_hog_stays_within_the_memory_limit(box):
    attempt("memory_hog", "allocate 1 GiB", "the workspace's memory limit (OOM inside)")
    where, w = box
    r = w.run("python3 -c 'b = bytearray(1 << 30); b[::4096] = b\"x\" * (len(b) // 4096)'",
              timeout=60)
    _results[("memory_hog", where)] = f"killed inside ({r.signal and 'SIGKILL'}, oom)"
    assert r.oom_killed and r.signal == 9, r
    assert w.run("echo alive").stdout == b"alive\n"


def test_filling_the_disk_stops_at_its_quota(box, boxes):
    attempt("fill_disk", "write a file until the disk is full",
            "the workspace's disk quota (`disk_limit`, a btrfs quota of its own)")
    from bunshin.runtime import quota

    if not quota.supported():
        pytest.skip("no btrfs simple quotas (Linux < 6.7): disk_limit is not enforced")
    where, w = box
    try:
        got = _refused(box, "fill_disk", "/fill", 4 * DISK_LIMIT, want=(errno.EDQUOT, errno.ENOSPC))
        wrote = int(got["detail"].split()[1])
        _results[("fill_disk", where)] = (f"stopped at {wrote >> 20} MiB of {DISK_LIMIT >> 20} "
                                          f"({errno.errorcode[got['errno']]})")
        assert DISK_LIMIT - (8 << 20) <= wrote <= DISK_LIMIT
        # the trainer's state directory and another workspace go on writing
        probe = bunshin.config.state_dir() / f"probe-{os.getpid()}"
        try:
            probe.write_bytes(b"y" * (1 << 20))
        finally:
            probe.unlink(missing_ok=True)
        other = next(b for n, b in boxes.items() if n != where)
        assert other.run("head -c 1M /dev/zero > /w && rm /w").exit_code == 0
    finally:
        assert w.run("rm -f /fill").exit_code == 0
    assert w.run("head -c 16M /dev/zero > /w && rm /w").exit_code == 0  # its room back


def _host_addresses() -> list[str]:
    import socket

    addrs = {"1.1.1.1", "192.0.2.1"}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("1.1.1.1", 53))  # no packet: picks the source address of the route
            addrs.add(s.getsockname()[0])
        except OSError:
            pass
    return sorted(addrs)


def test_no_route_out(box):
    attempt("route", "connect to the host and beyond", "network namespace (loopback only)")
    _refused(box, "route", ",".join(_host_addresses()), want=(errno.ENETUNREACH,))
