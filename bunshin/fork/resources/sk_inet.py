"""TCP and UDP sockets (IPv4, IPv6) inside the workspace's network namespace.

A child has a network namespace of its own (only ``lo``), so every inet socket is made anew
there: the clone, already inside that namespace, creates it with an injected socket(); the
trainer takes a pidfd_getfd copy of it and does the rest with ordinary socket calls, which act
in the socket's own namespace whoever makes them.

- ``fresh`` / ``bound`` (TCP never listened nor connected, UDP): same options, same address.
  A UDP socket connected to an address is connected again (its peer, if any, is in the
  workspace and is recreated too). Datagrams still queued (peeked, with SO_PEEK_OFF) are sent
  again, in order, once every inet socket of the child exists, each from the child's copy of
  the one workspace socket bound to its source address and port, and awaited at the receiver.
- ``listen``: bound to the same address and port, same backlog and options.
- ``established``: a loopback connection whose other end another workspace descriptor holds.
  The template's socket is read in TCP_REPAIR mode (sk_tcp.py) (sequence numbers, MSS, window scale, SACK,
  timestamps, windows, both queues, peeked, nothing consumed; every socket of the workspace
  read again until one pass sees no byte move, as the kernel keeps moving them between frozen
  ends), then left with
  TCP_REPAIR_OFF_NO_WP (no packet sent). The child's socket is built in repair mode (bind,
  connect without a handshake, queues refilled) and left with no packet either: its peer may
  not exist yet, and a packet to a missing socket would be answered with a reset. When the
  last inet socket of the child is made (``_finish``), every connection is nudged with a window
  probe and its never-sent bytes are sent.

SO_REUSEADDR is turned on while the child's sockets are bound (accepted connections share
their listener's port; either may come first) and set to the template's value in ``_finish``.

Refused, naming process, fd and 4-tuple: connections whose peer no workspace process holds
(not yet accepted, or closed), half-closed and closing states, listeners with connections not
yet accepted, UDP datagrams queued from a socket no longer there (or from an address several
are bound to, or other than the one the receiver is connected to), sockets bound to a device
other than ``lo`` (SO_BINDTODEVICE). A connection to outside the workspace cannot exist: the
workspace's namespace has only ``lo``.

Options carried: those a process can set (sockopts.py: SO_*, TCP_*, IP_TOS/TTL, IPv6 traffic
class and hops), IPV6_V6ONLY, O_NONBLOCK, the backlog, and the shutdown() state (sock_diag for
bound sockets, poll for the others; a connection shut down for reading only stays
ESTABLISHED). Urgent (MSG_OOB) data starts afresh.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from ...errors import ForkError
from . import sharing, sk_tcp, sockopts
from .sk_unix import diag_dump, diag_socket
from .sk_tcp import getint

_PROTOS = {b"TCP", b"TCPv6", b"UDP", b"UDPv6"}  # system.sockprotoname
_TCP = socket.IPPROTO_TCP
_TCP_INFO, _ESTABLISHED, _CLOSE, _LISTEN = 11, 1, 7, 10
_STATES = {2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT", 8: "CLOSE_WAIT",
           9: "LAST_ACK", 11: "CLOSING"}
_SO_PEEK_OFF = 42
_INET_DIAG_SHUTDOWN = 8


@dataclass
class InetSk:
    family: int
    type: int
    fate: str  # fresh, bound, listen, established
    local: tuple = ()
    peer: tuple = ()
    reuseaddr: int = 0
    opts: dict = field(default_factory=dict)
    v6only: int | None = None
    backlog: int = 0
    shutdown: int = 0  # RCV_SHUTDOWN 1 | SEND_SHUTDOWN 2
    queue: list = field(default_factory=list)  # UDP: (datagram, its sender's inode)
    # established only
    inq: bytes = b""
    outq: bytes = b""
    unsent: int = 0
    inq_seq: int = 0
    outq_seq: int = 0
    tcp_opts: bytes = b""
    timestamp: int | None = None
    window: bytes = b""
    bufs: dict = field(default_factory=dict)  # SO_RCVBUF, SO_SNDBUF: queues bigger than a fresh socket's


def claims(proc, f) -> bool:
    if not f.target.startswith("socket:"):
        return False
    try:
        return os.getxattr(f"/proc/{proc.hostpid}/fd/{f.fd}", "system.sockprotoname").rstrip(b"\0") in _PROTOS
    except OSError:
        return False


def _ends(s: socket.socket) -> tuple[tuple, tuple]:
    local = s.getsockname()[:2]
    try:
        peer = s.getpeername()[:2]
    except OSError:
        peer = ()
    return local, peer


def _name(sk: InetSk) -> str:
    proto = "TCP" if sk.type == socket.SOCK_STREAM else "UDP"
    fmt = (lambda a: f"[{a[0]}]:{a[1]}") if sk.family == socket.AF_INET6 else (lambda a: f"{a[0]}:{a[1]}")
    return f"{proto} socket {fmt(sk.local)}" + (f" -> {fmt(sk.peer)}" if sk.peer else "")


def _read_template(s: socket.socket, refuse) -> InetSk:
    """Everything a child needs to know of one template socket, which is left as it was."""
    sk = InetSk(family=s.family, type=s.type & 0xF, fate="fresh",
                reuseaddr=getint(s, socket.SOL_SOCKET, socket.SO_REUSEADDR))
    sk.local, sk.peer = _ends(s)
    p = select.poll()
    p.register(s, 0)  # POLLERR is always told; SO_ERROR, or a read (a peek too), would clear it
    if any(ev & select.POLLERR for _, ev in p.poll(0)):
        refuse(sk, "has an error pending (SO_ERROR, or the error queue of IP_RECVERR), which a fork "
                   "cannot set again")
    if sk.family == socket.AF_INET6:
        sk.v6only = getint(s, socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
    if sk.type == socket.SOCK_DGRAM:
        sk.queue = _peek_datagrams(s)
        sk.fate = "bound" if sk.local[1] or sk.peer else "fresh"
        _read_opts(s, sk, refuse)
        return sk
    info = s.getsockopt(_TCP, _TCP_INFO, 104)
    state = info[0]
    if state == _LISTEN:
        accept_q, sk.backlog = struct.unpack_from("II", info, 24)  # tcpi_unacked, tcpi_sacked
        if accept_q:
            refuse(sk, f"is listening with {accept_q} connection(s) not yet accepted")
        sk.fate = "listen"
    elif state == _CLOSE:
        sk.peer = ()
        sk.fate = "bound" if sk.local[1] else "fresh"
    elif state == _ESTABLISHED:
        sk.fate = "established"
        sk_tcp.save(s, sk, info)
    else:
        # its process closes it, or its peer finishes, once the workspace is thawed
        refuse(sk, f"is in state {_STATES.get(state, state)} (half-closed or closing)", transient=True)
    _read_opts(s, sk, refuse)
    return sk


def _polled_shutdown(s: socket.socket, sk: InetSk) -> int:
    """The shutdown() state of a socket sock_diag does not list (not bound: not hashed), as far
    as a process can tell it: RCV_SHUTDOWN shows as POLLRDHUP; SEND_SHUTDOWN alone changes
    nothing a process sees, but for UDP with RCV_SHUTDOWN it shows as POLLHUP."""
    p = select.poll()
    p.register(s, select.POLLIN | select.POLLRDHUP)
    ev = next((e for _, e in p.poll(0)), 0)
    if not ev & select.POLLRDHUP:
        return 0
    return 3 if sk.type == socket.SOCK_DGRAM and ev & select.POLLHUP else 1


def _peek_datagrams(s: socket.socket) -> list[tuple[bytes, tuple]]:
    """The datagrams queued at a template UDP socket, each with the address it came from, left
    where they are (SO_PEEK_OFF: each peek starts at the next one; the socket's own offset,
    which its peeks so far moved, put back after)."""
    out: list[tuple[bytes, tuple]] = []
    saved = s.getsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF)  # -1: off
    try:
        s.setsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF, 0)
    except OSError as e:  # UDP takes SO_PEEK_OFF from Linux 6.9 on (nor could the process set it)
        try:
            s.recvfrom(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return out  # nothing queued: no peek offset needed
        raise ForkError(f"UDP datagrams are queued and this kernel cannot peek past the first ({e})",
                        step="plan") from None
    try:
        while True:
            try:
                data, frm = s.recvfrom(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return out
            if not data:  # marked peeked, the kernel skips it at every later peek
                raise ForkError("an empty UDP datagram is queued: a fork cannot copy it", step="plan")
            out.append((data, frm[:2]))
    finally:
        s.setsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF, saved)


def _read_opts(s: socket.socket, sk: InetSk, refuse) -> None:
    sk.opts = sockopts.read(s, sockopts.table(sk.family, sk.type, sk.fate == "established"))
    sk.shutdown = _polled_shutdown(s, sk)
    why = sockopts.refusal(sk.opts)
    if why:
        refuse(sk, why)


SETTLE_S = 2.0  # how long a snapshot waits for the kernel to stop moving bytes between sockets


def _read_settled(socks: dict) -> dict[int, InetSk]:
    """Every socket read at one moment of quiet. The workspace is frozen but its connections
    are not: the kernel goes on sending queued bytes (small-queue tasklets, window probes)
    until each receiver's window is full, so a sender's queue read before its receiver's
    could miss bytes that then arrive there. Queues only drain (send) or fill (receive) while
    the processes are frozen, so unchanged counters after a pass mean nothing moved during it;
    otherwise the pass is made again, waiting a little longer each time."""
    deadline = time.monotonic() + SETTLE_S
    wait = 0.0005
    while True:
        before = {ino: sk_tcp.queues(s) for ino, (s, _, _) in socks.items()}
        read: dict[int, InetSk] = {}
        moved = None  # (ino, why) of the first socket seen changing
        for ino, (s, p, f) in socks.items():
            def refuse(sk, why: str, p=p, f=f, transient: bool = False):
                raise ForkError(f"process {p.vpid} ({p.name}) fd {f.fd}: {_name(sk)} {why}; a fork cannot "
                                "carry it", pid=p.hostpid, step="plan", transient=transient)
            try:
                read[ino] = _read_template(s, refuse)
            except sk_tcp.Moving as e:
                moved = (ino, str(e))
                break
            except ForkError as e:
                if e.pid is not None:
                    raise
                raise ForkError(f"process {p.vpid} ({p.name}) fd {f.fd}: {e}", pid=p.hostpid,
                                step=e.step) from None
        if moved is None:
            moved = next(((ino, "has queues that kept changing") for ino, (s, _, _) in socks.items()
                          if sk_tcp.queues(s) != before[ino]), None)
            if moved is None:
                return read
        if time.monotonic() + wait > deadline:
            s, p, f = socks[moved[0]]
            sk = InetSk(s.family, s.type & 0xF, "established", *_ends(s))
            raise ForkError(f"process {p.vpid} ({p.name}) fd {f.fd}: {_name(sk)} {moved[1]} for "
                            f"{SETTLE_S:g} s while the workspace was frozen; a fork cannot carry a "
                            "connection still moving: fork again", pid=p.hostpid, step="plan")
        time.sleep(wait)
        wait = min(wait * 2, 0.05)


def _key(addr: tuple) -> tuple:
    """An address as both ends see it: a dual-stack IPv6 socket names an IPv4 peer ::ffff:a.b.c.d."""
    host = addr[0].removeprefix("::ffff:") if addr[0].startswith("::ffff:") and "." in addr[0] else addr[0]
    return host, addr[1]


def check_tree(procs) -> None:
    """Read every template inet socket and refuse what cannot be carried, before anything in
    the template or a child is touched (the template sockets read are left as they were)."""
    mine = [(p, f) for p in procs for f in p.fds if f.handler is OPS]
    if not mine:
        return
    socks: dict[int, tuple[socket.socket, object, object]] = {}  # ino -> (copy, process, fd)
    try:
        for p, f in mine:
            if f.ino not in socks:
                socks[f.ino] = (socket.socket(fileno=sharing.getfd_here(p.hostpid, f.fd)), p, f)
        read = _read_settled(socks)
    finally:
        for s, _, _ in socks.values():
            s.close()
    shut = _shutdowns(procs[0].hostpid)
    for _, f in mine:
        f.inet = read[f.ino]
        f.inet.shutdown |= shut.get(f.ino, 0)
    for p, f in mine:
        if f.inet.queue and not isinstance(f.inet.queue[0][1], int):
            f.inet.queue = [(data, _sender(p, f, f.inet, frm, read)) for data, frm in f.inet.queue]
    held = {(_key(sk.local), _key(sk.peer)) for sk in read.values() if sk.fate == "established"}
    for p, f in mine:
        sk = f.inet
        if sk.fate == "established" and (_key(sk.peer), _key(sk.local)) not in held:
            raise ForkError(f"process {p.vpid} ({p.name}) fd {f.fd}: {_name(sk)} is connected to a socket no "
                            "workspace process holds (a connection not yet accepted, or its peer closed); "
                            "a fork cannot carry it", pid=p.hostpid, step="plan")


def _sender(p, f, sk: InetSk, frm: tuple, read: dict[int, InetSk]) -> int:
    """The workspace UDP socket (inode) a datagram queued at ``sk`` came from: the one bound to
    its source port, on its source address or on all. It sends it again in the child."""
    found = [ino for ino, o in read.items() if o.type == socket.SOCK_DGRAM and o.local[1] == frm[1]
             and _key(o.local)[0] in (_key(frm)[0], "0.0.0.0", "::")]
    why = None
    if len(found) != 1:
        why = f"came from {frm[0]}:{frm[1]}, where {len(found)} workspace UDP sockets are bound"
    elif sk.peer and _key(sk.peer) != _key(frm):
        why = f"came from {frm[0]}:{frm[1]}, not from the address it is now connected to"
    if why:
        raise ForkError(f"process {p.vpid} ({p.name}) fd {f.fd}: {_name(sk)} has a datagram queued that {why}; a "
                        "fork cannot carry it", pid=p.hostpid, step="plan")
    return found[0]


def _send_datagrams(ctx) -> None:
    """Every inet socket of the child exists: each datagram queued at a template UDP socket is
    sent again to its copy, in order, from the child's copy of its sender, and awaited there."""
    where = ctx.shared.get("inet-where", {})
    for pid, fd, sk in ctx.shared.pop("inet-datagrams", []):
        to = socket.socket(fileno=sharing.getfd_here(pid, fd))
        host = sk.local[0] if sk.local[0] not in ("0.0.0.0", "::") else \
            ("127.0.0.1" if sk.family == socket.AF_INET else "::1")
        try:
            for n, (data, ino) in enumerate(sk.queue, 1):
                frm = socket.socket(fileno=sharing.getfd_here(*where[ino]))
                try:
                    frm.sendto(data, (host, sk.local[1]))
                finally:
                    frm.close()
                _await_datagrams(to, n, sk)
        except OSError as e:
            raise ForkError(f"refilling the child's {_name(sk)}: {e}", step="inet") from None
        finally:
            to.close()


def _await_datagrams(s: socket.socket, n: int, sk: InetSk) -> None:
    """Wait until ``n`` datagrams are queued at ``s`` (loopback delivers them in a softirq)."""
    deadline = time.monotonic() + SETTLE_S
    while len(_peek_datagrams(s)) < n:
        if time.monotonic() > deadline:
            raise ForkError(f"the child's {_name(sk)}: a datagram sent again never arrived", step="inet")
        time.sleep(0.0005)


def _shutdowns(ns_pid: int) -> dict[int, int]:
    """shutdown() state (RCV_SHUTDOWN 1 | SEND_SHUTDOWN 2) of every bound TCP and UDP socket of
    ``ns_pid``'s net namespace that has some, by inode (inet sock_diag; no getsockopt tells)."""
    out: dict[int, int] = {}
    with diag_socket(ns_pid) as nl:
        for family in (socket.AF_INET, socket.AF_INET6):
            for proto in (socket.IPPROTO_TCP, socket.IPPROTO_UDP):
                req = struct.pack("=BBBBI", family, proto, 0, 0, 0xFFFFFFFF) + bytes(48)  # all states
                for msg in diag_dump(nl, req, "inet"):
                    _parse_shutdown(msg, out)
    return out


def _parse_shutdown(msg: bytes, out: dict[int, int]) -> None:
    """One inet_diag_msg's shutdown attribute into ``out``, by inode, where it has one."""
    ino = struct.unpack_from("I", msg, 68)[0]  # inet_diag_msg.idiag_inode
    off = 72
    while off + 4 <= len(msg):
        alen, atype = struct.unpack_from("=HH", msg, off)
        if atype == _INET_DIAG_SHUTDOWN and msg[off + 4]:
            out[ino] = msg[off + 4]
        off += (alen + 3) & ~3


def _shutdown(s: socket.socket, sk: InetSk) -> None:
    """Set the template's shutdown() state. On a socket neither connected nor listening the
    kernel sets it and says ENOTCONN; on a listener it would not set it (hence before listen)."""
    if sk.shutdown:
        try:
            s.shutdown(sk.shutdown - 1)  # SHUT_RD 0, SHUT_WR 1, SHUT_RDWR 2
        except OSError as e:
            if e.errno != errno.ENOTCONN:
                raise


def _build(s: socket.socket, sk: InetSk) -> None:
    """Give the child's new socket (``s``, a trainer-side copy) the template socket's state."""
    sockopts.apply(s, sk.opts)
    if sk.v6only is not None:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, sk.v6only)
    if sk.fate == "established":
        sk_tcp.restore(s, sk)
        _shutdown(s, sk)  # only RCV_SHUTDOWN: SEND_SHUTDOWN would have left ESTABLISHED
        return
    if sk.type == socket.SOCK_STREAM:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # until _finish
    else:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, sk.reuseaddr)
    if sk.fate == "bound":
        s.bind(sk.local)
        if sk.peer:
            s.connect(sk.peer)
    elif sk.fate == "listen":
        s.bind(sk.local)
        _shutdown(s, sk)
        s.listen(sk.backlog)
        return
    _shutdown(s, sk)


def _finish(ctx) -> None:
    """Every inet socket of the child exists: wake the connections, put SO_REUSEADDR back, send
    the queued datagrams again."""
    _send_datagrams(ctx)
    for pid, fd, sk in ctx.shared.pop("inet-made", []):
        s = socket.socket(fileno=sharing.getfd_here(pid, fd))
        try:
            if sk.fate == "established":
                sk_tcp.resume(s, sk)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, sk.reuseaddr)
        except OSError as e:
            raise ForkError(f"finishing the child's {_name(sk)}: {e}", step="inet") from None
        finally:
            s.close()


def fixup(ctx, proc, r, f) -> None:
    if "inet-left" not in ctx.shared:  # descriptors to make before _finish can run
        ctx.shared["inet-left"] = sum(1 for p in ctx.plans.values() if not p.is_init for g in p.fds
                                      if g.handler is OPS and g.dup_of is None)
    sk = f.inet
    where = sharing.find(ctx, "inet", proc, f)
    if where is not None:  # another process of the template holds the same socket
        newfd = sharing.grab(r, where)
    else:
        newfd = r.call("socket", sk.family, sk.type | socket.SOCK_CLOEXEC, 0)
        s = socket.socket(fileno=sharing.getfd_here(r.t.pid, newfd))
        try:
            _build(s, sk)
        except OSError as e:
            raise ForkError(f"process {proc.vpid} ({proc.name}) fd {f.fd}: recreating the {_name(sk)}: {e}",
                            pid=proc.hostpid, step="inet") from None
        finally:
            s.close()
    r.call("fcntl", newfd, 4, f.flags & os.O_NONBLOCK)  # F_SETFL
    r.install(newfd, f)
    if where is None:
        sharing.remember(ctx, "inet", proc, f, f.fd)
        ctx.shared.setdefault("inet-where", {})[f.ino] = (r.t.pid, f.fd)
        if sk.queue:
            ctx.shared.setdefault("inet-datagrams", []).append((r.t.pid, f.fd, sk))
        if sk.type == socket.SOCK_STREAM:
            ctx.shared.setdefault("inet-made", []).append((r.t.pid, f.fd, sk))
    ctx.shared["inet-left"] -= 1
    if ctx.shared["inet-left"] == 0:
        _finish(ctx)


OPS = SimpleNamespace(kind="inet-socket", claims=claims, check_tree=check_tree, fixup=fixup)
