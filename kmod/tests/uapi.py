"""The /dev/bunshin ABI as the tests see it, read from the uapi header itself.

Constants, struct layouts and ioctl numbers all come from
kmod/include/uapi/linux/bunshin.h, so the tests cannot drift from it.
"""
import ctypes
import fcntl
import os
import re
from pathlib import Path

HEADER = Path(__file__).resolve().parents[1] / "include/uapi/linux/bunshin.h"
DEVICE = "/dev/bunshin"

_CTYPES = {"__u64": ctypes.c_uint64, "__u32": ctypes.c_uint32, "__s32": ctypes.c_int32,
           "__s64": ctypes.c_int64}
# asm-generic/ioctl.h (x86): nr 8 bits, type 8 bits, size 14 bits, then dir.
_IOC_DIR = {"_IOW": 1, "_IOR": 2, "_IOWR": 3}


def read_defines(path):
    """Object-like #defines of a C header, comments and line continuations removed."""
    text = re.sub(r"/\*.*?\*/", "", Path(path).read_text(), flags=re.DOTALL).replace("\\\n", " ")
    return text, dict(re.findall(r"^#define\s+(\w+)[ \t]+(.+?)\s*$", text, re.MULTILINE))


class Header:
    def __init__(self, path=HEADER):
        self.text, self.defines = read_defines(path)
        self.structs = {}
        for name, body in re.findall(r"struct\s+(\w+)\s*\{(.*?)\};", self.text, re.DOTALL):
            fields = []
            for ctype, field, count in re.findall(r"(\w+)\s+(\w+)(?:\[(\w+)\])?\s*;", body):
                t = _CTYPES[ctype]
                fields.append((field, t * self.value(count) if count else t))
            self.structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields})

    def value(self, expr):
        expr = expr.strip()
        m = re.fullmatch(r"(_IOW?R?)\((\w+),\s*(\w+),\s*struct\s+(\w+)\)", expr)
        if m:
            kind, typ, nr, struct = m.groups()
            size = ctypes.sizeof(self.structs[struct])
            return (_IOC_DIR[kind] << 30) | (size << 16) | (self.value(typ) << 8) | self.value(nr)
        m = re.fullmatch(r"'(.)'", expr)
        if m:
            return ord(m.group(1))
        m = re.fullmatch(r"\((.+)\)", expr)
        if m:
            return self.value(m.group(1))
        m = re.fullmatch(r"(.+?)\s*<<\s*(.+)", expr)
        if m:
            return self.value(m.group(1)) << self.value(m.group(2))
        m = re.fullmatch(r"(\w+)\s*\+\s*(.+)", expr)
        if m:
            return self.value(m.group(1)) + self.value(m.group(2))
        m = re.fullmatch(r"(\d+)U?L?L?", expr)
        if m:
            return int(m.group(1))
        return self.value(self.defines[expr])

    def __getattr__(self, name):
        if name in self.structs:
            return self.structs[name]
        if name in self.defines:
            return self.value(self.defines[name])
        raise AttributeError(name)

    def feature(self, nr):
        return 1 << nr

    def run_syscalls(self):
        """BUNSHIN_RUN_SYSCALLS_X86_64: the system call numbers RUN allows."""
        return {int(x) for x in self.defines["BUNSHIN_RUN_SYSCALLS_X86_64"].split(",")}

    def macro(self, name, arg):
        """A one-argument function-like #define of the header, applied to ``arg``."""
        m = re.search(rf"^#define\s+{name}\((\w+)\)\s+(.+?)\s*$", self.text, re.MULTILINE)
        return self.value(re.sub(rf"\b{m.group(1)}\b", str(arg), m.group(2)))


ABI = Header()


def _override(req, override):
    """Set request fields to exercise bad input; ``reserved`` goes to reserved[0]."""
    reserved = override.pop("reserved", None)
    if reserved:
        req.reserved[0] = reserved
    for field, value in override.items():
        setattr(req, field, value)


class Device:
    """An open /dev/bunshin; every call raises OSError with the kernel's errno."""

    def __init__(self, path=DEVICE):
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def close(self):
        os.close(self.fd)

    def get_version(self, reserved=None):
        v = ABI.bunshin_version()
        if reserved:
            v.reserved[0] = reserved
        fcntl.ioctl(self.fd, ABI.BUNSHIN_IOC_GET_VERSION, v, True)
        return v

    def share_stats(self, pids, **override):
        """SHARE_STATS over pids; override sets request fields (npids, pids_ptr,
        stats_ptr, stats_size, flags, reserved) to exercise bad input."""
        pid_array = (ctypes.c_int32 * max(len(pids), 1))(*pids)
        stats = (ABI.bunshin_pid_stats * max(len(pids), 1))()
        req = ABI.bunshin_share_stats(
            pids_ptr=ctypes.addressof(pid_array), stats_ptr=ctypes.addressof(stats),
            npids=len(pids), stats_size=ctypes.sizeof(ABI.bunshin_pid_stats))
        _override(req, override)
        fcntl.ioctl(self.fd, ABI.BUNSHIN_IOC_SHARE_STATS, req, True)
        return req, list(stats)[: len(pids)]


    def group_stats(self, pids, groups, ngroups=None, **override):
        """GROUP_STATS over pids, pids[i] in group groups[i]; override sets request
        fields to exercise bad input."""
        ngroups = max(groups, default=-1) + 1 if ngroups is None else ngroups
        pid_array = (ctypes.c_int32 * max(len(pids), 1))(*pids)
        group_array = (ctypes.c_uint32 * max(len(pids), 1))(*groups)
        stats = (ABI.bunshin_group_usage * max(ngroups, 1))()
        req = ABI.bunshin_group_stats(
            pids_ptr=ctypes.addressof(pid_array), groups_ptr=ctypes.addressof(group_array),
            stats_ptr=ctypes.addressof(stats), npids=len(pids), ngroups=ngroups,
            stats_size=ctypes.sizeof(ABI.bunshin_group_usage))
        _override(req, override)
        fcntl.ioctl(self.fd, ABI.BUNSHIN_IOC_GROUP_STATS, req, True)
        return req, list(stats)[:ngroups]

    def reparent(self, pid, new_parent, **override):
        """REPARENT pid under new_parent; override sets request fields (flags, pad, reserved)."""
        req = ABI.bunshin_reparent(pid=pid, new_parent=new_parent)
        _override(req, override)
        fcntl.ioctl(self.fd, ABI.BUNSHIN_IOC_REPARENT, req, True)
        return req

    def fork(self, pid, children, child_tid=0, **override):
        """FORK: clone ``pid`` once per ``(pidns_pid, tid, parent)`` in ``children``; returns
        (request, host pids of the children made). override sets request fields."""
        kids = (ABI.bunshin_fork_child * max(len(children), 1))(
            *[ABI.bunshin_fork_child(pidns_pid=a, tid=b, parent=c) for a, b, c in children])
        req = ABI.bunshin_fork(pid=pid, nchildren=len(children),
                               children_ptr=ctypes.addressof(kids),
                               child_size=ctypes.sizeof(ABI.bunshin_fork_child),
                               child_tid=child_tid)
        _override(req, override)
        try:
            fcntl.ioctl(self.fd, ABI.BUNSHIN_IOC_FORK, req, True)
        except OSError as e:
            e.made = [k.pid for k in list(kids)[: req.done]]
            e.resumed = bool(req.resumed)
            raise
        return req, [k.pid for k in list(kids)[: req.done]]

    def join_session(self, pid, session_of, pgrp_of, **override):
        """JOIN_SESSION pid into session_of's session and pgrp_of's group; override sets
        request fields (flags, reserved)."""
        req = ABI.bunshin_join_session(pid=pid, session_of=session_of, pgrp_of=pgrp_of)
        _override(req, override)
        fcntl.ioctl(self.fd, ABI.BUNSHIN_IOC_JOIN_SESSION, req, True)
        return req

    def run(self, pid, calls, data=b"", **override):
        """RUN: ``calls`` (``(nr, args, flags, ok_errno)``) made by ``pid`` with ``data``;
        returns (request, results of the calls that ran). override sets request fields."""
        arr = (ABI.bunshin_run_call * max(len(calls), 1))()
        for c, (nr, args, flags, ok) in zip(arr, calls):
            c.nr, c.flags, c.ok_errno = nr, flags, ok
            for i, a in enumerate(args):
                c.args[i] = a & 0xFFFFFFFFFFFFFFFF
        buf = ctypes.create_string_buffer(bytes(data), max(len(data), 1))
        req = ABI.bunshin_run(pid=pid, ncalls=len(calls), calls_ptr=ctypes.addressof(arr),
                              data_ptr=ctypes.addressof(buf) if data else 0, data_size=len(data),
                              call_size=ctypes.sizeof(ABI.bunshin_run_call))
        _override(req, override)
        try:
            fcntl.ioctl(self.fd, ABI.BUNSHIN_IOC_RUN, req, True)
        except OSError as e:
            e.resumed = bool(req.resumed)
            raise
        return req, [c.ret for c in list(arr)[: req.done]]


def refs(path="/sys/kernel/debug/bunshin/refs"):
    """{kind: (gets, puts)} from the module's debugfs counters."""
    out = {}
    for line in Path(path).read_text().splitlines():
        kind, gets, puts = line.split()
        out[kind] = (int(gets), int(puts))
    return out
