"""The sandbox's seccomp filter, compiled by libseccomp (through cffi, ABI mode: no compiler
needed) into the classic BPF program the workspace init loads (``sandbox.c``).

A deny list over default allow, as Docker's profile is for a container given the capabilities
a workspace keeps: what is listed returns EPERM (a program probing for a feature sees "not
permitted", as under Docker; nothing is killed). The fork's injected calls are not subject to
it (the fork thread seizes with PTRACE_O_SUSPEND_SECCOMP), and the init's own calls (mount,
setns, pivot_root, sethostname at a fork) are not on the list."""

from __future__ import annotations

import errno
import functools
import os

from ..errors import BunshinError

_CDEF = """
typedef void *scmp_filter_ctx;
scmp_filter_ctx seccomp_init(uint32_t def_action);
void seccomp_release(scmp_filter_ctx ctx);
int seccomp_arch_add(scmp_filter_ctx ctx, uint32_t arch_token);
int seccomp_attr_set(scmp_filter_ctx ctx, int attr, uint32_t value);
int seccomp_syscall_resolve_name(const char *name);
int seccomp_rule_add(scmp_filter_ctx ctx, uint32_t action, int syscall, unsigned int arg_cnt, ...);
int seccomp_export_bpf(const scmp_filter_ctx ctx, int fd);
"""

_ACT_ALLOW = 0x7FFF0000
_ACT_ERRNO = 0x00050000
_ARCH_X86 = 0x40000003  # AUDIT_ARCH_I386
_ARCH_X32 = 0x4000003E  # AUDIT_ARCH_X86_64 with libseccomp's x32 marker
_FLTATR_CTL_TSYNC = 4
_NR_SCMP_ERROR = -1

# syscall -> why a workspace is refused it (Docker's default profile refuses each one for a
# container without the capability named, or for every container).
DENIED: dict[str, str] = {
    # kernel modules are the host's (CAP_SYS_MODULE)
    "init_module": "loads a module into the host's kernel",
    "finit_module": "loads a module into the host's kernel",
    "delete_module": "unloads a module of the host's kernel",
    "create_module": "obsolete module call",
    "query_module": "obsolete module call",
    "get_kernel_syms": "obsolete module call",
    # the machine's (CAP_SYS_BOOT)
    "kexec_load": "replaces the host's kernel",
    "kexec_file_load": "replaces the host's kernel",
    "reboot": "reboots the host (in a pid namespace: kills its init)",
    # swap is the host's (Docker: CAP_SYS_ADMIN, which a workspace keeps for the fork)
    "swapon": "changes the host's swap",
    "swapoff": "changes the host's swap",
    # the clock is the host's (CAP_SYS_TIME); adjtimex and clock_adjtime stay: their reads
    # are common (ntp_gettime) and their writes need CAP_SYS_TIME, which is dropped
    "clock_settime": "sets the host's clock",
    "settimeofday": "sets the host's clock",
    "stime": "sets the host's clock",
    # host-wide kernel facilities not confined by a namespace
    "bpf": "loads programs into the host's kernel",
    "perf_event_open": "observes the host's kernel and other processes",
    "keyctl": "the kernel keyrings are not namespaced",
    "add_key": "the kernel keyrings are not namespaced",
    "request_key": "the kernel keyrings are not namespaced",
    "open_by_handle_at": "opens a host inode by handle, around the mount tree (the 'shocker' escape)",
    "acct": "process accounting is the host's (CAP_SYS_PACCT)",
    "lookup_dcookie": "reads the host's kernel profiling cookies",
    "quotactl": "changes the host's disk quotas",
    "quotactl_fd": "changes the host's disk quotas",
    "syslog": "reads and clears the host's kernel log (CAP_SYSLOG)",
    "iopl": "raw port I/O on the host (CAP_SYS_RAWIO)",
    "ioperm": "raw port I/O on the host (CAP_SYS_RAWIO)",
    "vm86": "obsolete (i386)",
    "vm86old": "obsolete (i386)",
    "nfsservctl": "obsolete",
    "uselib": "obsolete",
    "ustat": "obsolete",
    "sysfs": "obsolete",
    "_sysctl": "obsolete",
    # io_uring's operations are not seen by seccomp (Docker refuses it since moby 25)
    "io_uring_setup": "its operations pass around the seccomp filter",
    "io_uring_enter": "its operations pass around the seccomp filter",
    "io_uring_register": "its operations pass around the seccomp filter",
}


@functools.lru_cache(maxsize=1)
def _lib():
    import cffi  # type: ignore[import-untyped]

    ffi = cffi.FFI()
    ffi.cdef(_CDEF)
    try:
        return ffi, ffi.dlopen("libseccomp.so.2")
    except OSError as e:
        raise BunshinError(f"isolation='sandbox' needs libseccomp (libseccomp.so.2): {e}") from None


@functools.lru_cache(maxsize=1)
def program() -> bytes:
    """The filter as ``struct sock_filter`` instructions (8 bytes each), for x86-64 and the
    i386 and x32 ABIs a process on it can also call with (each with its own numbers)."""
    ffi, lib = _lib()
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if ctx == ffi.NULL:
        raise BunshinError("libseccomp: seccomp_init failed")
    try:
        for arch in (_ARCH_X86, _ARCH_X32):
            rc = lib.seccomp_arch_add(ctx, arch)
            if rc not in (0, -errno.EEXIST):
                raise BunshinError(f"libseccomp: add arch {arch:#x}: {os.strerror(-rc)}")
        for name in DENIED:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr == _NR_SCMP_ERROR:
                raise BunshinError(f"libseccomp does not know the system call {name}")
            rc = lib.seccomp_rule_add(ctx, _ACT_ERRNO | errno.EPERM, ffi.cast("int", nr),
                                      ffi.cast("unsigned int", 0))
            if rc:
                raise BunshinError(f"libseccomp: deny {name}: {os.strerror(-rc)}")
        r, w = os.pipe()
        try:
            rc = lib.seccomp_export_bpf(ctx, w)
            os.close(w)
            w = -1
            if rc:
                raise BunshinError(f"libseccomp: export the filter: {os.strerror(-rc)}")
            chunks = []
            while chunk := os.read(r, 65536):
                chunks.append(chunk)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        return b"".join(chunks)
    finally:
        lib.seccomp_release(ctx)
