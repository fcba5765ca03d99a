"""Escape attempts, run as root inside a workspace (``python3 /escape.py NAME [ARG...]``) by
tests/test_escape.py. Each prints one JSON line: ``{"done": bool, "errno": int, "detail": str}``
where ``done`` means the attempt got through. Each runs in a mount namespace of its own (but
those in LASTING), so what a successful one mounts goes with it and later attempts start from
the workspace's mounts."""

import ctypes
import errno
import json
import os
import socket
import struct
import sys

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

NR = {"init_module": 175, "finit_module": 313, "delete_module": 176, "kexec_load": 246,
      "kexec_file_load": 320, "reboot": 169, "swapon": 167, "settimeofday": 164,
      "clock_settime": 227, "adjtimex": 159, "clock_adjtime": 305, "open_by_handle_at": 304,
      "ptrace": 101, "process_vm_readv": 310, "unshare": 272, "mount": 165}
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
CLONE_NEWNS, CLONE_NEWUSER = 0x20000, 0x10000000


class Refused(Exception):
    def __init__(self, err: int, what: str):
        super().__init__(what)
        self.err, self.what = err, what


def sys_(name, *args):
    got = libc.syscall(ctypes.c_long(NR[name]), *args)
    if got < 0:
        e = ctypes.get_errno()
        raise Refused(e, f"{name}: {os.strerror(e)}")
    return got


def mount(src, target, fstype, flags=0, data=None):
    os.makedirs(target, exist_ok=True) if target.startswith("/tmp/") else None
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)):
        e = ctypes.get_errno()
        raise Refused(e, f"mount {fstype or src} on {target}: {os.strerror(e)}")


def write(path, text):
    try:
        with open(path, "w") as fh:
            fh.write(text)
    except OSError as e:
        raise Refused(e.errno, f"write {path}: {e.strerror}") from None


# --- the attempts: each returns a detail string when it got through, raises Refused if not

def core_pattern(value):
    write("/proc/sys/kernel/core_pattern", value)
    return "wrote kernel.core_pattern"


def core_pattern_remount(value):
    mount(None, "/proc/sys", None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    write("/proc/sys/kernel/core_pattern", value)
    return "remounted /proc/sys read-write and wrote kernel.core_pattern"


def core_pattern_new_proc(value):
    mount("proc", "/tmp/newproc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    write("/tmp/newproc/sys/kernel/core_pattern", value)
    return "mounted a new proc and wrote kernel.core_pattern"


def swappiness(value):
    write("/proc/sys/vm/swappiness", value)
    return "wrote vm.swappiness"


def sysrq_trigger(key):
    write("/proc/sysrq-trigger", key)
    return "wrote /proc/sysrq-trigger"


def mount_devtmpfs():
    mount("none", "/tmp/dev", "devtmpfs")
    return "mounted devtmpfs: " + " ".join(sorted(os.listdir("/tmp/dev"))[:8])


def mount_sysfs():
    mount("none", "/tmp/sys", "sysfs")
    return "mounted sysfs"


def mount_cgroup():
    """A cgroupfs of its own is allowed (its cgroup namespace is rooted at its own group): what
    must fail is seeing any other group through it, or raising its limit."""
    mount("none", "/tmp/cg", "cgroup", 0, "pids")
    others = [d for d in os.listdir("/tmp/cg") if os.path.isdir(f"/tmp/cg/{d}")]
    if others:
        return f"mounted the pids hierarchy and sees other groups: {others}"
    try:
        with open("/tmp/cg/pids.max", "w") as f:
            f.write("max")
    except OSError as e:
        raise Refused(e.errno, f"write pids.max: {e}") from None
    return "raised its pids limit through a cgroupfs mount"


# attempts whose mounts must outlive them (in the workspace's mount namespace), for the host
# to look: a binfmt_misc table goes with its last mount
LASTING = {"binfmt_misc"}


def binfmt_misc(name):
    """An interpreter registered with the kernel: the host's table runs it as root for any
    file with its magic (here bytes no file starts with, and /bin/false)."""
    os.makedirs(f"/tmp/binfmt-{name}", exist_ok=True)
    mount("binfmt_misc", f"/tmp/binfmt-{name}", "binfmt_misc")
    write(f"/tmp/binfmt-{name}/register", f":{name}:M::\\xde\\xad\\xbe\\xef\\x42\\x55::/bin/false:")
    return f"registered {name} in a binfmt_misc"


def mount_block(major, minor):
    node = f"/tmp/blk-{os.getpid()}"
    try:
        os.mknod(node, 0o600 | 0o060000, os.makedev(int(major), int(minor)))
    except OSError as e:
        raise Refused(e.errno, f"mknod: {e.strerror}") from None
    try:
        mount(node, "/tmp/blkmnt", "ext4", MS_RDONLY)
    finally:
        os.unlink(node)
    return "mounted the host's disk: " + " ".join(sorted(os.listdir("/tmp/blkmnt"))[:8])


class Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


def settimeofday():
    tv = struct.pack("qq", int(__import__("time").time()), 0)
    sys_("settimeofday", ctypes.c_char_p(tv), None)
    return "set the clock"


def clock_settime():
    ts = Timespec(int(__import__("time").time()), 0)
    sys_("clock_settime", 0, ctypes.byref(ts))
    return "set the clock"


_ADJ_MAXERROR = 0x0004


def adjtimex():
    buf = ctypes.create_string_buffer(208)  # struct timex; modes first
    struct.pack_into("I", buf, 0, 0)
    sys_("adjtimex", buf)  # a read: allowed
    maxerror = struct.unpack_from("q", buf, 24)[0]
    struct.pack_into("I", buf, 0, _ADJ_MAXERROR)
    struct.pack_into("q", buf, 24, maxerror)
    sys_("adjtimex", buf)
    return "adjusted the clock"


def clock_adjtime():
    buf = ctypes.create_string_buffer(208)
    struct.pack_into("I", buf, 0, _ADJ_MAXERROR)
    sys_("clock_adjtime", 0, buf)
    return "adjusted the clock"


def i386_keyctl():
    """keyctl (denied, and needing no capability) through the i386 ABI (int $0x80), which a
    filter for x86-64 numbers alone would let through."""
    import mmap

    code = bytes.fromhex("53"            # push rbx (callee-saved)
                         "b820010000"    # mov eax, 288 (i386 keyctl)
                         "31db"          # xor ebx, ebx (KEYCTL_GET_KEYRING_ID)
                         "b9fdffffff"    # mov ecx, -3 (KEY_SPEC_SESSION_KEYRING)
                         "31d2"          # xor edx, edx
                         "cd80"          # int $0x80
                         "5b" "c3")      # pop rbx; ret
    buf = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(code)
    fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
    got = fn()
    if got < 0:
        raise Refused(-got, f"i386 keyctl: {os.strerror(-got)}")
    return f"i386 keyctl gave the session keyring {got}"


def init_module():
    image = b"\x7fELF" + b"\0" * 60  # not a module: an allowed call fails with ENOEXEC
    sys_("init_module", ctypes.c_char_p(image), len(image), ctypes.c_char_p(b""))
    return "loaded a module"


def finit_module():
    fd = os.open("/dev/null", os.O_RDONLY)
    sys_("finit_module", fd, ctypes.c_char_p(b""), 0)
    return "loaded a module"


def delete_module():
    sys_("delete_module", ctypes.c_char_p(b"bunshin_no_such_module"), 0)
    return "unloaded a module"


def kexec_load():
    sys_("kexec_load", 0, 0, None, 0xDEAD0000)  # flags no kernel takes: EINVAL if allowed
    return "loaded a kernel"


def kexec_file_load():
    sys_("kexec_file_load", -1, -1, 0, None, 0)  # EBADF if allowed
    return "loaded a kernel"


def reboot():
    sys_("reboot", 0xFEE1DEAD, 672274793, 0)  # CAD_OFF: harmless; EINVAL in a pid ns
    return "reboot accepted"


def swapon():
    sys_("swapon", ctypes.c_char_p(b"/bunshin-no-such-swap"), 0)
    return "swapon accepted"


def open_by_handle_at(handle_hex):
    raw = bytes.fromhex(handle_hex)  # struct file_handle from the host's name_to_handle_at
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    got = sys_("open_by_handle_at", fd, ctypes.c_char_p(raw), os.O_RDONLY)
    return "opened a host inode: " + os.read(got, 100).decode(errors="replace")


def kill_trainer(pid):
    try:
        os.kill(int(pid), 0)
    except OSError as e:
        raise Refused(e.errno, f"kill {pid}: {e.strerror}") from None
    return "signalled the trainer's pid"


def ptrace_trainer(pid):
    sys_("ptrace", 0x4206, int(pid), 0, 0)  # PTRACE_SEIZE
    return "seized the trainer's pid"


def vm_readv_trainer(pid):
    buf = ctypes.create_string_buffer(8)
    local = struct.pack("QQ", ctypes.addressof(buf), 8)
    remote = struct.pack("QQ", 0x400000, 8)
    sys_("process_vm_readv", int(pid), ctypes.c_char_p(local), 1, ctypes.c_char_p(remote), 1, 0)
    return "read the trainer's pid's memory"


def host_root(marker):
    """The host's file ``marker`` (outside every workspace) through /proc/*/root, ``..`` and
    a chroot breakout."""
    tries = [f"/proc/{p}/root{marker}" for p in os.listdir("/proc") if p.isdigit()]
    tries += ["/.." * 8 + marker]
    found = [t for t in tries if os.path.exists(t)]
    os.makedirs("/tmp/jail", exist_ok=True)
    top = os.open("/", os.O_RDONLY)
    os.chroot("/tmp/jail")
    os.fchdir(top)  # the classic breakout: a directory outside the new root, then up
    for _ in range(16):
        os.chdir("..")
    tries.append("chroot breakout")
    if os.path.exists("." + marker):
        found.append("chroot breakout")
    if found:
        return "reached " + found[0]
    raise Refused(errno.ENOENT, f"{len(tries)} ways, none reaches {marker}")


def init_exe():
    try:
        os.open("/proc/1/exe", os.O_WRONLY)
    except OSError as e:
        raise Refused(e.errno, f"open /proc/1/exe for writing: {e.strerror}") from None
    return "opened the host's bunshin-init for writing"


def read_block(major, minor):
    """The host's disk, read raw through a node of its own making (in /dev, which is not
    nodev)."""
    node = f"/dev/blk-{os.getpid()}"
    try:
        os.mknod(node, 0o600 | 0o060000, os.makedev(int(major), int(minor)))
        fd = os.open(node, os.O_RDONLY)
        data = os.pread(fd, 2, 1080)  # ext2/3/4 superblock magic
    except OSError as e:
        raise Refused(e.errno, f"{e.strerror}") from None
    finally:
        if os.path.exists(node):
            os.unlink(node)
    return f"read the host's disk (superblock magic {data.hex()})"


def nested_userns():
    """Full capabilities in a new user namespace, then what they were for."""
    uid, gid = os.getuid(), os.getgid()
    sys_("unshare", CLONE_NEWUSER | CLONE_NEWNS)
    try:  # root inside mapped to whom it was: the most the new namespace can be
        write("/proc/self/setgroups", "deny")
        write("/proc/self/uid_map", f"0 {uid} 1")
        write("/proc/self/gid_map", f"0 {gid} 1")
    except Refused:
        pass
    caps = [ln for ln in open("/proc/self/status") if ln.startswith("CapEff")][0].split()[1]
    got = []
    for name, fn in (("devtmpfs", mount_devtmpfs), ("settimeofday", settimeofday),
                     ("init_module", init_module), ("swappiness", lambda: swappiness("61"))):
        try:
            got.append(f"{name}: {fn()}")
        except (Refused, OSError):
            pass
    if got:
        return "; ".join(got)
    raise Refused(errno.EPERM, f"CapEff {caps} in a new user namespace, but each refused")


def cgroup_limits(limit):
    """Raise the workspace's pids limit and leave its cgroup, through a cgroupfs of its own."""
    mount("none", "/tmp/cg", "cgroup", 0, "pids")
    own = [ln.split(":", 2)[2].strip() for ln in open("/proc/self/cgroup") if ":pids:" in ln][0]
    write(f"/tmp/cg{own}/pids.max", limit)
    write("/tmp/cg/cgroup.procs", str(os.getpid()))
    return f"raised {own}/pids.max and moved to the root cgroup"


def route(addrs):
    reached = []
    last = None
    for a in addrs.split(","):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect((a, 80))
            reached.append(a)
        except ConnectionRefusedError:
            reached.append(a + " (refused: routed)")
        except OSError as e:
            last = e
        finally:
            s.close()
    if reached:
        return "reached " + ", ".join(reached)
    raise Refused(last.errno or 0, f"connect: {last}")


def fill_disk(path, most):
    """Write ``path`` until a write fails (or ``most`` bytes are written)."""
    chunk, n = b"\xa5" * (1 << 20), 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while n < int(most):
            n += os.write(fd, chunk)
        os.fsync(fd)
    except OSError as e:
        raise Refused(e.errno, f"wrote {n} bytes") from None
    finally:
        os.close(fd)
    return f"wrote {n} bytes"


def main():
    name, args = sys.argv[1], sys.argv[2:]
    try:
        if name not in LASTING:
            sys_("unshare", CLONE_NEWNS)
            mount(None, "/", None, 0x4000 | 0x40000)  # MS_REC | MS_PRIVATE
        detail = globals()[name](*args)
        out = {"done": True, "errno": 0, "detail": detail}
    except Refused as r:
        out = {"done": False, "errno": r.err, "detail": r.what}
    print(json.dumps(out))


main()
