"""Unix sockets (stream, datagram, seqpacket) inside the workspace.

Plan: the workspace's net namespace is asked for every unix socket (sock_diag: type, state,
peer, bound name, queue lengths) and each descriptor gets one of four fates:

- ``pair``: connected to a socket another workspace descriptor holds (a socketpair, or both
  ends of an accepted connection), or to a peer already closed. The first clone that meets
  either end makes a new socketpair, keeps the other end aside for whichever clone holds it
  (sharing.py), and copies the bytes queued at each end. The queues are read in the trainer
  from a pidfd_getfd copy of the template's socket with MSG_PEEK and SO_PEEK_OFF (each peek
  continues where the last stopped, one datagram at a time), which consumes nothing; the
  socket's peek offset is put back. A closed peer stays closed: the reader gets the bytes, then
  EOF.
- ``listen``: bound to a path or an abstract name and listening: bound again in the child (its
  own root, its own net namespace: the name is free there) with the same backlog.
- ``bound``: an unconnected datagram socket bound to a name, with nothing queued.
- ``fresh``: never bound nor connected.

Refused, naming process, fd and why: connections not yet accepted, peers outside the
workspace's processes, datagram sockets connected to a server socket, queued ancillary data
(SCM_RIGHTS, credentials). Names of connected sockets (getsockname/getpeername of an accepted
connection) are not kept: a socketpair has none.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NoReturn

from ...errors import ForkError
from . import sharing

_STREAM, _LISTEN = 1, 10  # SOCK_STREAM; TCP_LISTEN as unix sockets report it
_SO_PEEK_OFF = 42
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLMSG_DONE, _NLMSG_ERROR = 4, 20, 3, 2
_SHOW = 0x1 | 0x4 | 0x8 | 0x10  # UDIAG_SHOW_NAME, _PEER, _ICONS, _RQLEN
_NAME, _PEER, _ICONS, _RQLEN, _SHUTDOWN = 0, 2, 3, 4, 6  # UNIX_DIAG_* attributes
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass
class UnixSk:
    ino: int
    type: int
    state: int
    peer: int = 0
    name: bytes = b""  # raw sun_path: "\0..." is abstract; a path ends with its NUL
    rq: int = 0  # bytes queued (listening: connections waiting)
    wq: int = 0  # listening: the backlog
    icons: int = 0  # connections waiting to be accepted
    shutdown: int = 0


def claims(proc, f) -> bool:
    if not f.target.startswith("socket:"):
        return False
    try:
        return os.getxattr(f"/proc/{proc.hostpid}/fd/{f.fd}", "system.sockprotoname").startswith(b"UNIX")
    except OSError:
        return False


def _diag_socket(ns_pid: int) -> socket.socket:
    """A sock_diag socket in ``ns_pid``'s net namespace: made by a thread that enters it (the
    net namespace is per thread) and ends, so the trainer itself never moves."""
    out: list = []

    def enter() -> None:
        try:
            nsfd = os.open(f"/proc/{ns_pid}/ns/net", os.O_RDONLY)
            try:
                if _libc.setns(nsfd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(nsfd)
            out.append(socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG))
        except OSError as e:
            out.append(e)

    t = threading.Thread(target=enter, name="bunshin-unix-diag")
    t.start()
    t.join()
    if isinstance(out[0], OSError):
        raise ForkError(f"cannot list the workspace's unix sockets: {out[0]}", step="plan")
    return out[0]


def unix_sockets(ns_pid: int) -> dict[int, UnixSk]:
    """Every unix socket of ``ns_pid``'s net namespace, by inode."""
    req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, _SHOW, 0xFFFFFFFF, 0xFFFFFFFF)
    table: dict[int, UnixSk] = {}
    with _diag_socket(ns_pid) as nl:
        nl.send(struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, 0x301, 1, 0) + req)  # REQUEST|DUMP
        while True:
            buf = nl.recv(1 << 16)
            while buf:
                ln, typ = struct.unpack_from("=IH", buf)
                if typ == _NLMSG_DONE:
                    return table
                if typ == _NLMSG_ERROR:
                    raise ForkError("sock_diag refused to list unix sockets", step="plan")
                _parse(buf[16:ln], table)
                buf = buf[(ln + 3) & ~3:]


def _parse(msg: bytes, table: dict[int, UnixSk]) -> None:
    _fam, typ, state, _pad, ino = struct.unpack_from("=BBBBI", msg)
    sk = UnixSk(ino=ino, type=typ, state=state)
    off = 16
    while off + 4 <= len(msg):
        alen, atype = struct.unpack_from("=HH", msg, off)
        val = msg[off + 4 : off + alen]
        if atype == _NAME:
            sk.name = val
        elif atype == _PEER:
            sk.peer = struct.unpack("I", val)[0]
        elif atype == _RQLEN:
            sk.rq, sk.wq = struct.unpack("II", val)
        elif atype == _ICONS:
            sk.icons = len(val) // 4
        elif atype == _SHUTDOWN:
            sk.shutdown = val[0]
        off += (alen + 3) & ~3
    table[ino] = sk


def _refuse(p, f, why: str) -> NoReturn:
    raise ForkError(f"process {p.vpid} ({p.name}) fd {f.fd} is a unix socket ({f.target}) {why}; "
                    "a fork cannot carry it", pid=p.hostpid, step="plan")


def check_tree(procs) -> None:
    """Decide each unix socket's fate (module docstring), refusing before anything is touched."""
    mine = [(p, f) for p in procs for f in p.fds if f.handler is OPS]
    if not mine:
        return
    table = unix_sockets(procs[0].hostpid)
    held: dict[int, tuple[int, int]] = {}
    for p, f in mine:
        held.setdefault(f.ino, (p.hostpid, f.fd))
    for p, f in mine:
        sk = table.get(f.ino)
        if sk is None:
            _refuse(p, f, "that the workspace's net namespace does not list")
        f.sk, f.sk_peer_holder, f.sk_fate = sk, None, None
        if sk.state == _LISTEN:
            if sk.icons or sk.rq:
                _refuse(p, f, f"with {max(sk.icons, sk.rq)} connection(s) not yet accepted")
            if not sk.name or (sk.name[0] != 0 and sk.name[0] != ord("/")):
                _refuse(p, f, f"listening on {sk.name!r}, not an absolute path or abstract name")
            f.sk_fate = "listen"
        elif sk.peer:
            peer = table.get(sk.peer)
            if peer is not None and sk.peer not in held:
                _refuse(p, f, "connected to a socket no workspace process holds (outside, or not yet accepted)")
            if peer is not None and peer.peer != sk.ino:
                _refuse(p, f, "connected to a datagram server socket (only pairs are carried)")
            f.sk_peer_holder = held.get(sk.peer)  # None: the peer is closed
            f.sk_fate = "pair"
        elif sk.name:
            if sk.type == _STREAM or sk.rq:
                _refuse(p, f, "bound but neither listening nor connected, or with datagrams queued")
            f.sk_fate = "bound"
        else:
            f.sk_fate = "fresh"


def _peek_all(hostpid: int, fd: int, sk: UnixSk, what: str) -> list[bytes]:
    """The messages (stream: one chunk) queued at a template socket, left where they are."""
    s = socket.socket(fileno=sharing.getfd_here(hostpid, fd))
    out: list[bytes] = []
    try:
        saved = s.getsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF)
        s.setsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF, 0)
        try:
            while True:
                try:
                    data, _anc, flags, _ = s.recvmsg(1 << 20, 0, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                if flags & socket.MSG_CTRUNC:
                    raise ForkError(f"{what}: unix socket has descriptors or credentials queued (SCM_RIGHTS/"
                                    "SCM_CREDENTIALS); a fork cannot carry them", pid=hostpid, step="unix")
                if not data:
                    if sk.type == _STREAM or len(out) > 100000:
                        break  # stream: EOF (peer gone)
                    raise ForkError(f"{what}: an empty datagram is queued; a fork cannot copy it",
                                    pid=hostpid, step="unix")
                out.append(data)
        finally:
            s.setsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF, saved)
    finally:
        s.close()
    if sk.type != 2 and sum(map(len, out)) != sk.rq:  # stream and seqpacket report the bytes
        raise ForkError(f"{what}: read {sum(map(len, out))} queued bytes of {sk.rq}", pid=hostpid, step="unix")
    return out


def _fill(clone_pid: int, fd: int, msgs: list[bytes], what: str) -> None:
    """Send ``msgs`` from descriptor ``fd`` of a clone: they land in its peer's queue."""
    if not msgs:
        return
    s = socket.socket(fileno=sharing.getfd_here(clone_pid, fd))
    try:
        for m in msgs:
            try:
                s.sendall(m, socket.MSG_DONTWAIT)
            except (BlockingIOError, OSError) as e:
                raise ForkError(f"{what}: cannot copy {len(m)} queued bytes: {e}", step="unix") from None
    finally:
        s.close()


def _pair(ctx, proc, r, f) -> int:
    sk, what = f.sk, f"process {proc.vpid} ({proc.name}) fd {f.fd}"
    addr = r.put(bytes(8))
    r.call("socketpair", socket.AF_UNIX, sk.type | socket.SOCK_CLOEXEC, 0, addr)
    mine, theirs = struct.unpack("ii", r.t.read(addr, 8))
    # bytes queued at this end were sent by the peer: send them again from the peer's copy
    _fill(r.t.pid, theirs, _peek_all(proc.hostpid, f.fd, sk, what), what)
    if f.sk_peer_holder is not None:
        holder_pid, holder_fd = f.sk_peer_holder
        peer = ctx.shared["unix-table"].get(sk.peer, sk)
        _fill(r.t.pid, mine, _peek_all(holder_pid, holder_fd, peer, what), what)
        ctx.shared.setdefault("unix", {})[sk.peer] = (proc.vpid, theirs)
        ctx.shared.setdefault("close_later", []).append((r.t, theirs))  # shmem.finish closes it
    else:
        r.call("close", theirs)  # the peer was closed in the template: EOF after the bytes
    if sk.shutdown & 2:  # SEND_SHUTDOWN: this end called shutdown(SHUT_WR)
        r.call("shutdown", mine, socket.SHUT_WR)
    return mine


def _bind(proc, r, f, listen: bool) -> int:
    sk = f.sk
    fd = r.call("socket", socket.AF_UNIX, sk.type | socket.SOCK_CLOEXEC, 0)
    if sk.name[0] != 0:  # a path: the child's root has the template's socket file; replace it
        r.call("unlinkat", -100 & 0xFFFFFFFFFFFFFFFF, r.put(sk.name), 0, ok_errnos=(2,))
    addr = r.put(struct.pack("H", socket.AF_UNIX) + sk.name, 256)
    r.call("bind", fd, addr, 2 + len(sk.name))
    if sk.name[0] != 0:
        path = sk.name.rstrip(b"\0").decode()
        try:
            os.chmod(f"/proc/{r.t.pid}/root{path}", os.stat(f"/proc/{proc.hostpid}/root{path}").st_mode & 0o7777)
        except OSError:
            pass  # the template's file is gone: keep the mode bind gave
    if listen:
        r.call("listen", fd, sk.wq)
    return fd


def fixup(ctx, proc, r, f) -> None:
    made = ctx.shared.setdefault("unix", {})
    if "unix-table" not in ctx.shared:
        ctx.shared["unix-table"] = {g.ino: g.sk for p in ctx.plans.values() for g in p.fds
                                    if getattr(g, "sk", None) is not None}
    if f.ino in made:  # an earlier clone made it (or kept this end of a pair aside)
        newfd = sharing.grab(r, made[f.ino])
    elif f.sk_fate == "pair":
        newfd = _pair(ctx, proc, r, f)
    elif f.sk_fate in ("listen", "bound"):
        newfd = _bind(proc, r, f, f.sk_fate == "listen")
    else:
        newfd = r.call("socket", socket.AF_UNIX, f.sk.type | socket.SOCK_CLOEXEC, 0)
    r.call("fcntl", newfd, 4, f.flags & os.O_NONBLOCK)  # F_SETFL
    r.install(newfd, f)
    made[f.ino] = (proc.vpid, f.fd)


OPS = SimpleNamespace(kind="unix-socket", claims=claims, check_tree=check_tree, fixup=fixup)
