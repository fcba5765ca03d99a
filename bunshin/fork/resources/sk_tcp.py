"""TCP_REPAIR for sk_inet.py: a connection read from a template socket without consuming
anything, and rebuilt in a child's socket without a handshake (learned from CRIU's soccr).

Sequence numbers (linux/tcp.h, CRIU's notes)::

    send queue:  snd_una ... write_seq  = SIOCOUTQ bytes, the last SIOCOUTQNSD never sent
    recv queue:  copied_seq ... rcv_nxt = SIOCINQ bytes
    TCP_QUEUE_SEQ reads write_seq / rcv_nxt; set before connect, it is where each queue
    starts, and refilling the queue moves it on by the bytes refilled.
"""

from __future__ import annotations

import fcntl
import socket
import struct

_TCP = socket.IPPROTO_TCP
_TCP_MAXSEG, _TCP_REPAIR, _TCP_REPAIR_QUEUE, _TCP_QUEUE_SEQ = 2, 19, 20, 21
_TCP_REPAIR_OPTIONS, _TCP_TIMESTAMP, _TCP_REPAIR_WINDOW = 22, 24, 29
_REPAIR_ON, _REPAIR_OFF, _REPAIR_OFF_NO_WP = 1, 0, -1
_NO_QUEUE, _RECV_QUEUE, _SEND_QUEUE = 0, 1, 2
_OPT_TS, _OPT_SACK, _OPT_WSCALE = 1, 2, 4  # tcpi_options
_TCPOPT_MSS, _TCPOPT_WINDOW, _TCPOPT_SACK_PERM, _TCPOPT_TIMESTAMP = 2, 3, 4, 8
_SIOCINQ, _SIOCOUTQ, _SIOCOUTQNSD = 0x541B, 0x5411, 0x894B
_SO_PEEK_OFF = 42
_SO_SNDBUFFORCE, _SO_RCVBUFFORCE = 32, 33


def getint(s: socket.socket, level: int, opt: int) -> int:
    try:
        return s.getsockopt(level, opt)
    except OSError:
        return 0


def _peek_off(s: socket.socket) -> int:
    """The socket's SO_PEEK_OFF, -1 when none is set or TCP has none (Linux < 6.10 refuses the
    option for TCP: peeks there always start at the head of the queue)."""
    try:
        return s.getsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF)
    except OSError:
        return -1


def ioctl_int(s: socket.socket, req: int) -> int:
    return struct.unpack("i", fcntl.ioctl(s.fileno(), req, bytes(4)))[0]


class Moving(Exception):
    """A queue changed while it was read: the kernel still moves bytes between frozen ends."""


def queues(s: socket.socket) -> tuple[int, ...]:
    """Bytes in the receive queue, the send queue, and the part of it never sent (-1 where the
    socket has none: a listener, UDP's unsent part)."""
    out = []
    for req in (_SIOCINQ, _SIOCOUTQ, _SIOCOUTQNSD):
        try:
            out.append(ioctl_int(s, req))
        except OSError:
            out.append(-1)
    return tuple(out)


def save(s: socket.socket, sk, info: bytes) -> None:
    """Fill ``sk`` (an sk_inet.InetSk) from an established template socket, left as it was;
    :class:`Moving` when a queue changed meanwhile (read it again once traffic settles)."""
    inq, outq, sk.unsent = ioctl_int(s, _SIOCINQ), ioctl_int(s, _SIOCOUTQ), ioctl_int(s, _SIOCOUTQNSD)
    options, wscale = info[5], info[6]
    mss = s.getsockopt(_TCP, _TCP_MAXSEG)
    opts = [(_TCPOPT_MSS, mss)]
    if options & _OPT_SACK:
        opts.append((_TCPOPT_SACK_PERM, 0))
    if options & _OPT_WSCALE:  # snd_wscale in the low nibble, rcv_wscale in the high one
        opts.append((_TCPOPT_WINDOW, (wscale & 0xF) | (wscale >> 4) << 16))
    if options & _OPT_TS:
        opts.append((_TCPOPT_TIMESTAMP, 0))
    sk.tcp_opts = b"".join(struct.pack("II", *o) for o in opts)
    sk.bufs = {opt: getint(s, socket.SOL_SOCKET, opt) for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF)}
    peek_off = _peek_off(s)
    s.setsockopt(_TCP, _TCP_REPAIR, _REPAIR_ON)
    try:
        if peek_off >= 0:  # a peek would start there; read from the start
            s.setsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF, 0)
        if options & _OPT_TS:
            sk.timestamp = s.getsockopt(_TCP, _TCP_TIMESTAMP)
        sk.window = s.getsockopt(_TCP, _TCP_REPAIR_WINDOW, 20)
        sk.inq_seq, sk.inq = _read_queue(s, _RECV_QUEUE, inq)
        sk.outq_seq, sk.outq = _read_queue(s, _SEND_QUEUE, outq)
    finally:
        s.setsockopt(_TCP, _TCP_REPAIR_QUEUE, _NO_QUEUE)
        s.setsockopt(_TCP, _TCP_REPAIR, _REPAIR_OFF_NO_WP)
        # leaving repair mode clears SO_REUSEADDR: put it back
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, sk.reuseaddr)
        if peek_off >= 0:
            s.setsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF, peek_off)
    if len(sk.inq) != inq or len(sk.outq) != outq:
        raise Moving(f"has queues of {inq}/{outq} bytes of which {len(sk.inq)}/{len(sk.outq)} could be read")


def _read_queue(s: socket.socket, queue: int, length: int) -> tuple[int, bytes]:
    s.setsockopt(_TCP, _TCP_REPAIR_QUEUE, queue)
    seq = struct.unpack("I", s.getsockopt(_TCP, _TCP_QUEUE_SEQ, 4))[0]
    data = b""
    if length:  # one byte more than expected: a longer queue is then noticed
        data = s.recv(length + 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    return seq, data


def restore(s: socket.socket, sk) -> None:
    """Make the child's new socket ``s`` the connection ``sk``, silently (no packet sent)."""
    # A fresh socket's buffers may be smaller than the queues the template's grew to hold: give
    # it the template's size or twice the bytes queued (refilled in other chunks, they take more
    # memory than they did), whichever is more; the kernel doubles what it is given. This turns
    # autotuning off for that connection, so it is done only when the queues need it.
    for opt, force, queued in ((socket.SO_RCVBUF, _SO_RCVBUFFORCE, len(sk.inq)),
                               (socket.SO_SNDBUF, _SO_SNDBUFFORCE, len(sk.outq))):
        want = max(sk.bufs[opt], 2 * queued)
        if queued and want > s.getsockopt(socket.SOL_SOCKET, opt):
            s.setsockopt(socket.SOL_SOCKET, force, want // 2)
    s.setsockopt(_TCP, _TCP_REPAIR, _REPAIR_ON)  # also lets it share its port (SK_FORCE_REUSE)
    s.bind(sk.local)
    # The queues' first sequence numbers; refilling them moves each to the template's value.
    for queue, seq, data in ((_RECV_QUEUE, sk.inq_seq, sk.inq), (_SEND_QUEUE, sk.outq_seq, sk.outq)):
        s.setsockopt(_TCP, _TCP_REPAIR_QUEUE, queue)
        s.setsockopt(_TCP, _TCP_QUEUE_SEQ, struct.pack("I", (seq - len(data)) & 0xFFFFFFFF))
    s.connect(sk.peer)  # in repair mode: ESTABLISHED at once, no packet
    s.setsockopt(_TCP, _TCP_REPAIR_OPTIONS, sk.tcp_opts)
    if sk.timestamp is not None:
        s.setsockopt(_TCP, _TCP_TIMESTAMP, sk.timestamp)
    sent = len(sk.outq) - sk.unsent  # sent but not acknowledged: goes back as "sent"
    for queue, data in ((_RECV_QUEUE, sk.inq), (_SEND_QUEUE, sk.outq[:sent])):
        s.setsockopt(_TCP, _TCP_REPAIR_QUEUE, queue)
        _send_all(s, data)
    s.setsockopt(_TCP, _TCP_REPAIR_QUEUE, _NO_QUEUE)
    s.setsockopt(_TCP, _TCP_REPAIR_WINDOW, sk.window)
    s.setsockopt(_TCP, _TCP_REPAIR, _REPAIR_OFF_NO_WP)  # silent: the peer may not exist yet
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # until _finish


def _send_all(s: socket.socket, data: bytes) -> None:
    """In repair mode the receive queue takes one linear buffer per send: keep them small."""
    view = memoryview(data)
    while view:
        n = s.send(view[: 1 << 16], socket.MSG_DONTWAIT)
        view = view[n:]


def resume(s: socket.socket, sk) -> None:
    """Once the peer exists too: a window probe (repair on, then off with a probe) wakes the
    connection, and the bytes the template never sent are sent."""
    s.setsockopt(_TCP, _TCP_REPAIR, _REPAIR_ON)
    s.setsockopt(_TCP, _TCP_REPAIR, _REPAIR_OFF)
    if sk.unsent:
        _send_all(s, sk.outq[len(sk.outq) - sk.unsent :])
