"""Socket options a process can set, carried from a template socket (unix or inet) to the
child's copy of it.

Each is read in the trainer from a pidfd_getfd copy of the template's socket and set on a
trainer-side copy of the child's new socket only where it differs from what that new socket
starts with: an option left alone by the process keeps the kernel's own value (and a TCP
buffer the kernel grows by itself stays free to grow). Options a kind of socket does not have
are not read (getsockopt fails) and so not set.

Used by sk_unix.py and sk_inet.py, not an ops table itself.
"""

from __future__ import annotations

import socket

_SOL, _TCP, _IP, _IP6 = socket.SOL_SOCKET, socket.IPPROTO_TCP, socket.IPPROTO_IP, socket.IPPROTO_IPV6
_INT, _TIMEVAL, _LINGER, _IFNAME, _U64 = 4, 16, 8, 16, 8  # getsockopt lengths
_SO_RCVBUF, _SO_SNDBUF, _SO_RCVBUFFORCE, _SO_SNDBUFFORCE = 8, 7, 33, 32
_SO_BINDTODEVICE = 25
_SO_PRIORITY = 12
_SO_GET_FILTER = 26  # a classic filter's program (an eBPF one, SO_ATTACH_BPF, shows none)
_TCP_ULP = 31
_UDP = socket.IPPROTO_UDP

# (level, option, length). SO_REUSEADDR and IPV6_V6ONLY of inet sockets are set by sk_inet.py
# itself (bind order). A TCP connection whose buffers the kernel grew keeps their size, no
# longer grown (set, a size stays); sk_tcp.py makes them bigger where queued bytes need it.
SOCKET = [(_SOL, o, n) for o, n in (
    (1, _INT),              # SO_DEBUG
    (2, _INT),              # SO_REUSEADDR
    (5, _INT),              # SO_DONTROUTE
    (6, _INT),              # SO_BROADCAST
    (_SO_SNDBUF, _INT), (_SO_RCVBUF, _INT),
    (9, _INT),              # SO_KEEPALIVE
    (10, _INT),             # SO_OOBINLINE
    (_SO_PRIORITY, _INT),
    (13, _LINGER),          # SO_LINGER
    (15, _INT),             # SO_REUSEPORT
    (16, _INT),             # SO_PASSCRED
    (18, _INT),             # SO_RCVLOWAT
    (20, _TIMEVAL), (21, _TIMEVAL),  # SO_RCVTIMEO, SO_SNDTIMEO
    (_SO_BINDTODEVICE, _IFNAME),
    (29, _INT), (35, _INT), (37, _INT),  # SO_TIMESTAMP, SO_TIMESTAMPNS, SO_TIMESTAMPING
    (34, _INT),             # SO_PASSSEC
    (36, _INT),             # SO_MARK
    (40, _INT),             # SO_RXQ_OVFL
    (42, _INT),             # SO_PEEK_OFF
    (43, _INT),             # SO_NOFCS
    (45, _INT),             # SO_SELECT_ERR_QUEUE
    (46, _INT),             # SO_BUSY_POLL
    (47, _U64),             # SO_MAX_PACING_RATE
    (60, _INT),             # SO_ZEROCOPY
    (69, _INT), (70, _INT),  # SO_PREFER_BUSY_POLL, SO_BUSY_POLL_BUDGET
    (74, _INT),             # SO_TXREHASH
    (75, _INT),             # SO_RCVMARK
    (76, _INT),             # SO_PASSPIDFD
    (82, _INT),             # SO_RCVPRIORITY
    (83, _INT),             # SO_PASSRIGHTS
    (_SO_GET_FILTER, 64),   # read to be refused (refusal): a program cannot be set back from it
)]
TCP = [(_TCP, o, n) for o, n in (
    (1, _INT),              # TCP_NODELAY
    (3, _INT),              # TCP_CORK
    (4, _INT), (5, _INT), (6, _INT),  # TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT
    (7, _INT),              # TCP_SYNCNT
    (8, _INT),              # TCP_LINGER2
    (9, _INT),              # TCP_DEFER_ACCEPT
    (13, _IFNAME),          # TCP_CONGESTION
    (18, _INT),             # TCP_USER_TIMEOUT
    (23, _INT),             # TCP_FASTOPEN
    (25, _INT),             # TCP_NOTSENT_LOWAT
    (_TCP_ULP, _IFNAME),    # read to be refused (refusal): kTLS and the like keep keys in the kernel
)]
# Read on a connection as what the connection computed, not what the process set: carried
# only for sockets not connected (TCP_REPAIR restores a connection's own).
TCP_UNCONNECTED = [(_TCP, 2, _INT), (_TCP, 10, _INT)]  # TCP_MAXSEG, TCP_WINDOW_CLAMP
IP = [(_IP, 1, _INT), (_IP, 2, _INT)]  # IP_TOS, IP_TTL
IPV6 = [(_IP6, 67, _INT), (_IP6, 16, _INT)]  # IPV6_TCLASS, IPV6_UNICAST_HOPS
# a datagram socket's own: what it is told of each datagram, how it sends (a TCP connection's
# are the connection's, restored by TCP_REPAIR)
IP_DGRAM = [(_IP, o, _INT) for o in (
    8, 10, 11, 12, 13,      # IP_PKTINFO, IP_MTU_DISCOVER, IP_RECVERR, IP_RECVTTL, IP_RECVTOS
    15, 19, 20, 24,         # IP_FREEBIND, IP_TRANSPARENT, IP_RECVORIGDSTADDR, IP_BIND_ADDRESS_NO_PORT
    33, 34,                 # IP_MULTICAST_TTL, IP_MULTICAST_LOOP
)]
IPV6_DGRAM = [(_IP6, o, _INT) for o in (
    18, 19, 23, 25,         # IPV6_MULTICAST_HOPS, IPV6_MULTICAST_LOOP, IPV6_MTU_DISCOVER, IPV6_RECVERR
    49, 51, 66,             # IPV6_RECVPKTINFO, IPV6_RECVHOPLIMIT, IPV6_RECVTCLASS
    75, 78,                 # IPV6_TRANSPARENT, IPV6_FREEBIND
)]
UDP = [(_UDP, o, _INT) for o in (1, 103, 104)]  # UDP_CORK, UDP_SEGMENT, UDP_GRO


def table(family: int, type_: int, connected_tcp: bool = False) -> list[tuple[int, int, int]]:
    """The options worth reading on a socket of this family and type."""
    opts = list(SOCKET)
    if family in (socket.AF_INET, socket.AF_INET6):
        opts = [o for o in opts if o[1] != 2]  # SO_REUSEADDR: sk_inet.py's
        opts += IP if family == socket.AF_INET else IPV6
        if type_ == socket.SOCK_STREAM:
            opts += TCP + ([] if connected_tcp else TCP_UNCONNECTED)
        elif type_ == socket.SOCK_DGRAM:
            opts += UDP + (IP_DGRAM if family == socket.AF_INET else IPV6_DGRAM)
    return opts


def read(s: socket.socket, opts: list[tuple[int, int, int]]) -> dict[tuple[int, int], bytes]:
    """The raw value of each option ``s`` has."""
    out = {}
    for level, opt, length in opts:
        try:
            out[level, opt] = s.getsockopt(level, opt, length)
        except OSError:
            pass
    return out


def refusal(saved: dict[tuple[int, int], bytes]) -> str | None:
    """Why a child cannot have these options, if it cannot: a child's network namespace has
    only ``lo``, so a socket bound to another device has no device to be bound to there."""
    if saved.get((_SOL, _SO_GET_FILTER)):
        return "has a socket filter attached (SO_ATTACH_FILTER), whose program a fork does not carry"
    ulp = saved.get((_TCP, _TCP_ULP), b"").rstrip(b"\0")
    if ulp:
        return f"runs an upper-layer protocol ({ulp.decode(errors='replace')}, TCP_ULP) a fork cannot carry"
    dev = saved.get((_SOL, _SO_BINDTODEVICE), b"").rstrip(b"\0")
    if dev and dev != b"lo":
        return f"bound to device {dev.decode(errors='replace')} (SO_BINDTODEVICE), which a child's network has not"
    return None


def apply(s: socket.socket, saved: dict[tuple[int, int], bytes]) -> None:
    """Give ``s`` (a new socket of the same kind) every option whose value differs from its own.
    SO_PRIORITY goes last: setting IP_TOS sets the priority too, to the one its TOS implies."""
    for (level, opt), want in sorted(saved.items(), key=lambda item: item[0] == (_SOL, _SO_PRIORITY)):
        try:
            have = s.getsockopt(level, opt, len(want) or _IFNAME)
        except OSError:
            have = None
        if have == want:
            continue
        if level == _SOL and opt in (_SO_RCVBUF, _SO_SNDBUF):
            # the kernel doubles what it is given (and reports the double): give half; FORCE
            # goes past net.core.[rw]mem_max, as the process may have (CAP_NET_ADMIN)
            force = _SO_RCVBUFFORCE if opt == _SO_RCVBUF else _SO_SNDBUFFORCE
            s.setsockopt(level, force, int.from_bytes(want, "little", signed=True) // 2)
        elif level == _SOL and opt == _SO_BINDTODEVICE or level == _TCP and opt == 13:
            s.setsockopt(level, opt, want.rstrip(b"\0"))
        else:
            s.setsockopt(level, opt, want)
