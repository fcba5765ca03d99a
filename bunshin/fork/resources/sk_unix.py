"""Unix sockets (stream, datagram, seqpacket) inside the workspace.

Plan: the workspace's net namespace is asked for every unix socket (sock_diag: type, state,
peer, bound name and its file, queue lengths, shutdown) and each descriptor gets one of five
fates:

- ``pair``: connected to a socket another workspace descriptor holds (a socketpair, or both
  ends of an accepted connection), or to a peer already closed. The first clone that meets
  either end makes a new socketpair, keeps the other end aside for whichever clone holds it
  (sharing.py). The queues are read once per template, in the trainer, from a pidfd_getfd
  copy of the template's socket with MSG_PEEK and SO_PEEK_OFF (each peek continues where the
  last stopped, one datagram, or one sender's run of bytes, at a time), which consumes
  nothing; the socket's peek offset is put back. They are refilled once every unix socket of
  the child exists, from the peer's copy, each message with the credentials
  (SCM_CREDENTIALS) of the child's copy of its sender where the reader has SO_PASSCRED (a
  sender cloned later could not be named earlier). A closed peer is closed after that: the
  reader gets the bytes, then EOF.
- ``listen``: bound to a name and listening: bound again in the child (its own root, its own
  net namespace: the name is free there) with the same backlog.
- ``bound``: bound to a name, neither listening nor connected.
- ``client``: a datagram socket connected to a bound socket another workspace descriptor
  holds (a server): connected, from the trainer, to the child's copy of the server once both
  exist (whichever clone comes first).

Datagrams queued at a ``bound`` or ``client`` socket are sent to its copy again, in the same
order, each from the child's copy of the socket bound to the name it came from (with its
credentials, as above).
- ``fresh``: never bound nor connected.

A name is a path, an abstract name, or a path relative to the directory the binder was in:
that directory is found again as the one, among the workspace processes' working directories,
from which the name leads to the socket's file (sock_diag gives its inode); the child's copy is
bound from there, so it reports the same relative name. Every fate keeps the socket's options
(sockopts.py), O_NONBLOCK and its shutdown() state (set once the queues are refilled). A
message queued at a socket without SO_PASSCRED keeps no credentials: none can read them.

Refused at plan time, naming process, fd and why: connections not yet accepted (the bytes a
connection sent before it is accepted, and the credentials its acceptor will read, cannot be
read without accepting it), peers outside the workspace's processes, datagrams queued from
an unnamed socket or a name no single workspace socket holds (their sender cannot be told),
or at a socket connected to another than their sender, sockets with descriptors
queued (SCM_RIGHTS, SO_PASSPIDFD's pidfds), credentials naming a process the child will not
have (exited, outside, or cloned after the last unix socket), a relative name whose socket file
is gone, a device binding a child lacks. Names of connected sockets (getsockname/getpeername
of an accepted connection) are not kept: a socketpair has none.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import stat
import struct
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from collections.abc import Iterator
from typing import NoReturn

from ...errors import ForkError
from . import sharing, sockopts

_STREAM, _DGRAM, _SEQPACKET, _LISTEN = 1, 2, 5, 10  # SOCK_*; TCP_LISTEN as unix sockets report it
_SO_PEEK_OFF = 42
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLMSG_DONE, _NLMSG_ERROR = 4, 20, 3, 2
_SHOW = 0x1 | 0x2 | 0x4 | 0x8 | 0x10  # UDIAG_SHOW_NAME, _VFS, _PEER, _ICONS, _RQLEN
_NAME, _VFS, _PEER, _ICONS, _RQLEN, _SHUTDOWN = 0, 1, 2, 3, 4, 6  # UNIX_DIAG_* attributes
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
    shutdown: int = 0  # RCV_SHUTDOWN 1 | SEND_SHUTDOWN 2
    vfs_ino: int = 0  # the socket file of a name that is a path
    bind_dir: str | None = None  # where a relative name was bound from
    file_gone: bool | None = None  # a path whose socket file was removed since (check_tree)
    opts: dict | None = None  # sockopts.read
    queue: list = field(default_factory=list)  # pair: the messages queued at it, with credentials
    creds_from: set = field(default_factory=set)  # the vpids its queue's credentials name


def claims(proc, f) -> bool:
    if not f.target.startswith("socket:"):
        return False
    try:
        return os.getxattr(f"/proc/{proc.hostpid}/fd/{f.fd}", "system.sockprotoname").startswith(b"UNIX")
    except OSError:
        return False


def diag_socket(ns_pid: int) -> socket.socket:
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
    t.join()  # setns and socket: nothing to wait for
    if isinstance(out[0], OSError):
        raise ForkError(f"cannot list the workspace's sockets: {out[0]}", step="plan")
    return out[0]


def diag_dump(nl: socket.socket, req: bytes, what: str) -> Iterator[bytes]:
    """Each reply of a sock_diag dump of ``req`` on ``nl``, without its netlink header."""
    nl.send(struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, 0x301, 1, 0) + req)  # REQUEST|DUMP
    while True:
        # cannot block: the kernel queues each part of a dump before the recv of the last one
        # returns, and an error of its own ends the recv (netlink_recvmsg)
        buf = nl.recv(1 << 16)
        while buf:
            ln, typ = struct.unpack_from("=IH", buf)
            if typ == _NLMSG_DONE:
                return
            if typ == _NLMSG_ERROR:
                raise ForkError(f"sock_diag refused to list {what} sockets", step="plan")
            yield buf[16:ln]
            buf = buf[(ln + 3) & ~3:]


def unix_sockets(ns_pid: int) -> dict[int, UnixSk]:
    """Every unix socket of ``ns_pid``'s net namespace, by inode."""
    req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, _SHOW, 0xFFFFFFFF, 0xFFFFFFFF)
    table: dict[int, UnixSk] = {}
    with diag_socket(ns_pid) as nl:
        for msg in diag_dump(nl, req, "unix"):
            _parse(msg, table)
    return table


def _parse(msg: bytes, table: dict[int, UnixSk]) -> None:
    _fam, typ, state, _pad, ino = struct.unpack_from("=BBBBI", msg)
    sk = UnixSk(ino=ino, type=typ, state=state)
    off = 16
    while off + 4 <= len(msg):
        alen, atype = struct.unpack_from("=HH", msg, off)
        val = msg[off + 4 : off + alen]
        if atype == _NAME:
            sk.name = val
        elif atype == _VFS:
            sk.vfs_ino = struct.unpack_from("I", val)[0]
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


def _relative(sk: UnixSk) -> bool:
    return bool(sk.name) and sk.name[0] != 0 and sk.name[0] != ord("/")


def _bind_dirs(procs, sk: UnixSk) -> set[str]:
    """The directories a relative name may have been bound from: those from which the name
    leads to the socket's own file (sock_diag gives its inode). Tried first: the processes'
    working directories; then every directory of the workspace's own layers (what it wrote,
    where its socket files are) holding a socket file of that name."""
    rel = sk.name.rstrip(b"\0").decode(errors="surrogateescape")
    root = f"/proc/{procs[0].hostpid}/root"

    def leads(d: str) -> bool:
        try:
            st = os.stat(f"{root}{os.path.join(d, rel)}")
        except OSError:
            return False
        # overlayfs reports a device of its own per layer to stat: the inode alone is compared
        return stat.S_ISSOCK(st.st_mode) and st.st_ino == sk.vfs_ino

    for p in procs:
        if leads(p.cwd):
            return {p.cwd}
    return {os.path.normpath(d) for d in _socket_dirs(procs[0].hostpid, rel) if leads(d)}


def _file_gone(hostpid: int, p, f, sk: UnixSk) -> bool:
    """Whether the socket file of ``sk``, bound to an absolute path, was removed since (its copy
    is bound, then its file removed too); refused when another file is there now, which
    binding the copy would replace."""
    path = _path(sk)
    try:
        held = sharing.open_in_root(hostpid, path, os.O_PATH | os.O_NOFOLLOW)
    except FileNotFoundError:
        try:
            os.close(sharing.open_in_root(hostpid, os.path.dirname(path), os.O_PATH | os.O_DIRECTORY))
        except OSError:
            _refuse(p, f, f"bound to {path}, whose directory is gone: its copy could not be bound there")
        return True
    try:
        st = os.fstat(held)
    finally:
        os.close(held)
    # overlayfs reports a device of its own per layer to stat: the inode alone is compared
    if not stat.S_ISSOCK(st.st_mode) or st.st_ino != sk.vfs_ino:
        _refuse(p, f, f"bound to {path}, where another file is now (its socket file removed and the name "
                "taken again): binding its copy there would replace that file")
    return False


def _socket_dirs(hostpid: int, rel: str):
    """Directories, as the workspace sees them, where one of its own layers (the overlay's upper
    and lower layers but the host's root) or its /dev holds a socket file ``rel``."""
    layers = []
    with open(f"/proc/{hostpid}/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            if fields[4] == "/" and fields[fields.index("-") + 1] == "overlay":
                for opt in fields[-1].split(","):
                    key, _, val = opt.partition("=")
                    if key in ("upperdir", "lowerdir"):
                        layers += [(d, "") for d in val.split(":") if d != "/"]
    layers.append((f"/proc/{hostpid}/root/dev", "/dev"))
    for top, seen_as in layers:
        for d, _dirs, files in os.walk(top):
            for name in files:
                path = os.path.join(d, name)
                if path.endswith("/" + rel) and stat.S_ISSOCK(os.lstat(path).st_mode):
                    yield seen_as + path[len(top) : len(path) - len(rel)] or "/"


def _sender(p, f, sk: UnixSk, frm, names: dict[bytes, list[int]]) -> int:
    """The socket (inode) a datagram queued at ``sk`` came from: the one workspace socket bound
    to the name it came from. It sends it again in the child, to ``sk``'s copy."""
    name = frm if isinstance(frm, bytes) else os.fsencode(frm or "") + b"\0" if frm else b""
    senders = names.get(name, []) if name else []
    if len(senders) != 1:
        _refuse(p, f, "with a datagram queued from " + (f"{name!r}, a name {len(senders)} workspace sockets are bound "
                "to" if name else "an unnamed socket") + ": its sender cannot be told")
    if sk.peer and senders[0] != sk.peer:
        _refuse(p, f, "with a datagram queued from a socket other than the one it is connected to: none other "
                "can send to it again")
    return senders[0]


def _read(p, f, sk: UnixSk, fate: str, vpids: dict[int, int], names: dict[bytes, list[int]]) -> None:
    """Options and queued messages of a template socket, read once per template: it is frozen,
    and a unix socket's queues move only when a process sends or reads."""
    s = socket.socket(fileno=sharing.getfd_here(p.hostpid, f.fd))
    try:
        sk.opts = sockopts.read(s, sockopts.table(socket.AF_UNIX, sk.type))
        why = sockopts.refusal(sk.opts)
        if why:
            _refuse(p, f, why)
        if fate == "pair" or sk.type == _DGRAM:
            sk.queue = _peek_all(s, sk, lambda why: _refuse(p, f, why))
    finally:
        s.close()
    if fate != "pair":
        sk.queue = [(data, cred, _sender(p, f, sk, frm, names)) for data, cred, frm in sk.queue]
    for _data, cred, *_ in sk.queue:
        if cred is not None and cred[0] not in vpids:
            _refuse(p, f, f"with a message queued whose credentials (SCM_CREDENTIALS) name process {cred[0]} "
                    "(host pid), which is not in the workspace (exited, or outside): the child has no such process")
        if cred is not None:
            sk.creds_from.add(vpids[cred[0]])


def check_tree(procs) -> None:
    """Decide each unix socket's fate (module docstring), refusing before anything is touched."""
    mine = [(p, f) for p in procs for f in p.fds if f.handler is OPS]
    if not mine:
        return
    table = unix_sockets(procs[0].hostpid)
    vpids = {p.hostpid: p.vpid for p in procs}
    order = {p.vpid: i for i, p in enumerate(procs)}
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
                _refuse(p, f, f"with {max(sk.icons, sk.rq)} connection(s) not yet accepted (what they sent "
                        "and the credentials their acceptor reads cannot be read without accepting them)")
            if not sk.name:
                _refuse(p, f, "listening without a name")
            f.sk_fate = "listen"
        elif sk.peer:
            peer = table.get(sk.peer)
            if peer is not None and sk.peer not in held:
                _refuse(p, f, "connected to a socket no workspace process holds (outside, or not yet accepted)")
            if peer is not None and peer.peer != sk.ino:
                if sk.type != _DGRAM or not peer.name:
                    _refuse(p, f, "connected to a socket that is connected elsewhere")
                f.sk_fate = "client"
            else:
                f.sk_peer_holder = held.get(sk.peer)  # None: the peer is closed
                f.sk_fate = "pair"
        elif sk.name:
            f.sk_fate = "bound"
        else:
            f.sk_fate = "fresh"
    names: dict[bytes, list[int]] = {}  # the names of the sockets workspace processes hold
    for ino in held:
        if table[ino].name:
            names.setdefault(table[ino].name, []).append(ino)
    for p, f in mine:
        sk = f.sk
        # the sockets bound again in the child (an accepted connection shares its listener's
        # name, but no file)
        if f.sk_fate != "pair" and _relative(sk) and sk.bind_dir is None:
            dirs = _bind_dirs(procs, sk)
            rel = sk.name.rstrip(bytes(1))
            if not dirs:
                _refuse(p, f, f"bound to the relative name {rel!r}, whose socket file is not found in the workspace "
                        "(moved or removed)")
            if len(dirs) > 1:  # hard links: the child's copy would answer at one path only
                _refuse(p, f, f"bound to the relative name {rel!r}, whose socket file is in each of {sorted(dirs)}: "
                        "which one it was bound from cannot be told")
            sk.bind_dir = dirs.pop()
        if f.sk_fate != "pair" and sk.name[:1] == b"/" and sk.file_gone is None:
            sk.file_gone = _file_gone(procs[0].hostpid, p, f, sk)
        if sk.opts is None:
            _read(p, f, sk, f.sk_fate, vpids, names)
    # The queues are refilled once every unix socket of the child exists (fixup); a message's
    # sender must be cloned by then to be named in its credentials.
    last = max(i for i, p in enumerate(procs) if any(f.handler is OPS for f in p.fds))
    for p, f in mine:
        late = [v for v in f.sk.creds_from if order[v] > last]
        if late:
            _refuse(p, f, f"with a message queued whose credentials name process {late[0]}, cloned after every "
                    "unix socket is made")


def _peek_all(s: socket.socket, sk: UnixSk, refuse) -> list[tuple]:
    """The messages (stream: runs of one sender's bytes) queued at a template socket ``s``, left
    where they are, each with its credentials (host pid, uid, gid) if ``s`` has SO_PASSCRED,
    and the name it came from."""
    out: list[tuple] = []
    saved = s.getsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF)
    s.setsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF, 0)
    # room for credentials alone: descriptors in flight then do not fit, and so are not
    # installed in the trainer by the peek, but show as MSG_CTRUNC
    room = socket.CMSG_SPACE(12) if s.getsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED) else 0
    try:
        while True:
            try:
                data, anc, flags, frm = s.recvmsg(1 << 20, room, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            if flags & socket.MSG_CTRUNC:
                refuse("with descriptors queued (SCM_RIGHTS, or a pidfd for SO_PASSPIDFD), whose child copies "
                       "cannot be told")
            cred = next((struct.unpack("iII", d) for lv, ty, d in anc
                         if (lv, ty) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS)), None)
            if not data:
                if sk.type == _SEQPACKET and not sk.shutdown & 1:  # neither the end nor shut down
                    refuse("with an empty record queued, which a fork cannot read again")
                if sk.type != _DGRAM:
                    break  # the end: the peer gone, or this end shut down for reading
                # a datagram socket's end is EAGAIN, even shut down; an empty datagram is
                # peeked once, then skipped by every later peek: it cannot be read again
                refuse("with an empty datagram queued, which a fork cannot read again")
            out.append((data, cred, frm))
    finally:
        s.setsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF, saved)
    got = sum(len(m[0]) for m in out)
    if sk.type != _DGRAM and got != sk.rq:  # stream and seqpacket report the bytes
        refuse(f"whose {sk.rq} queued bytes could not all be read ({got})")
    return out


def _fill(r, clone_pid: int, fd: int, msgs: list[tuple], vpids: dict[int, int], what: str,
          to: UnixSk | None = None) -> None:
    """Send ``msgs`` from descriptor ``fd`` of clone ``clone_pid``: they land in its peer's
    queue (or ``to``'s), with the credentials of the child's copy of their sender (found
    through a pidfd ``r``'s clone opens: the child's pid namespace names it as the template's
    did)."""
    if not msgs:
        return
    hostpids: dict[int, int] = {}
    s = socket.socket(fileno=sharing.getfd_here(clone_pid, fd))
    at = -1
    dest: tuple = ()
    if to is not None:
        if to.name[0] == 0:
            dest = (to.name,)
        else:
            at = os.open(f"/proc/{r.t.pid}/root{_path(to)}", os.O_PATH)
            dest = (f"/proc/self/fd/{at}",)
    try:
        for data, cred, *_ in msgs:
            anc = []
            if cred is not None:
                vpid = vpids[cred[0]]
                if vpid not in hostpids:
                    hostpids[vpid] = _hostpid(r, vpid)
                anc = [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("iII", hostpids[vpid], *cred[1:]))]
            try:
                if s.sendmsg([data], anc, socket.MSG_DONTWAIT, *dest) != len(data):
                    raise OSError(errno.EAGAIN, "short send")
            except OSError as e:
                raise ForkError(f"{what}: cannot copy {len(data)} queued bytes: {e}", step="unix") from None
    finally:
        s.close()
        if at >= 0:
            os.close(at)


def _hostpid(r, vpid: int) -> int:
    """The trainer's pid of the child's process ``vpid``."""
    pidfd = r.call("pidfd_open", vpid, 0)
    try:
        here = sharing.getfd_here(r.t.pid, pidfd)
    finally:
        r.call("close", pidfd)
    try:
        return int(sharing.fdinfo(os.getpid(), here)["Pid"])
    finally:
        os.close(here)


def _pair(ctx, proc, r, f) -> int:
    """A new socketpair for ``f`` and its peer; the queues are refilled once every unix socket
    of the child exists (:func:`_refill`): a message's sender may be cloned later."""
    sk = f.sk
    addr = r.put(bytes(8))
    r.call("socketpair", socket.AF_UNIX, sk.type | socket.SOCK_CLOEXEC, 0, addr)
    mine, theirs = struct.unpack("ii", r.t.read(addr, 8))
    fills = ctx.shared.setdefault("unix-fills", [])
    # bytes queued at this end were sent by the peer: sent again from the peer's copy
    fills.append((r.t.pid, theirs, sk.queue, f"process {proc.vpid} ({proc.name}) fd {f.fd}"))
    if f.sk_peer_holder is not None:
        fills.append((r.t.pid, f.fd, ctx.shared["unix-table"][sk.peer].queue,  # mine, once installed
                      f"the peer of process {proc.vpid} ({proc.name}) fd {f.fd}"))
        ctx.shared.setdefault("unix", {})[sk.peer] = (proc.vpid, theirs)
        ctx.shared.setdefault("unix-unfinished", set()).add(sk.peer)
    # shmem.finish closes it, after the refill: a peer closed in the template then gives EOF
    # after the bytes
    ctx.shared.setdefault("close_later", []).append((r.t, theirs))
    return mine


def _bind(proc, r, f) -> int:
    sk = f.sk
    fd = r.call("socket", socket.AF_UNIX, sk.type | socket.SOCK_CLOEXEC, 0)
    if sk.bind_dir is not None:  # bound from that directory, by a relative name
        r.call("chdir", r.path(sk.bind_dir))
    if sk.name[0] != 0:  # a path: the child's root has the template's socket file; replace it
        r.call("unlinkat", -100 & 0xFFFFFFFFFFFFFFFF, r.put(sk.name), 0, ok_errnos=(2,))
    addr = r.put(struct.pack("H", socket.AF_UNIX) + sk.name, 256)
    r.call("bind", fd, addr, 2 + len(sk.name))
    if sk.bind_dir is not None:
        r.call("chdir", r.path(proc.cwd), ok_errnos=(2,))
    if sk.file_gone:  # removed in the template since it was bound
        r.call("unlinkat", -100 & 0xFFFFFFFFFFFFFFFF, r.put(sk.name), 0)
    elif sk.name[0] != 0:
        path = _path(sk)
        try:
            st = os.stat(f"/proc/{proc.hostpid}/root{path}")
        except OSError:
            st = None  # the template's file is gone: keep the owner and mode bind gave
        if st is not None:
            os.chown(f"/proc/{r.t.pid}/root{path}", st.st_uid, st.st_gid, follow_symlinks=False)
            os.chmod(f"/proc/{r.t.pid}/root{path}", st.st_mode & 0o7777)
    if f.sk_fate == "listen":
        r.call("listen", fd, sk.wq)
    return fd


def _path(sk: UnixSk) -> str:
    """The absolute path of a socket bound to a path."""
    return os.path.join(sk.bind_dir or "/", sk.name.rstrip(b"\0").decode(errors="surrogateescape"))


def _connect(root_pid: int, pid: int, fd: int, server: UnixSk, what: str) -> None:
    """Connect descriptor ``fd`` of clone ``pid`` to the child's copy of ``server`` (which now
    exists), from the trainer: an abstract name is looked up in the socket's own network
    namespace, a path through ``root_pid``'s root (the child's), by an O_PATH descriptor, so
    the path may be longer than sun_path holds."""
    s = socket.socket(fileno=sharing.getfd_here(pid, fd))
    try:
        # Never wait on a full backlog: the descriptor's own flags are set once it is connected.
        s.setblocking(False)
        if server.name[0] == 0:
            s.connect(server.name)
        else:
            at = os.open(f"/proc/{root_pid}/root{_path(server)}", os.O_PATH)
            try:
                s.connect(f"/proc/self/fd/{at}")
            finally:
                os.close(at)
    except OSError as e:
        raise ForkError(f"{what}: connecting to the child's copy of its server: {e}", step="unix") from None
    finally:
        s.close()


def _finish_socket(pid: int, fd: int, proc, f) -> None:
    """What every fate ends with, once the queues are refilled: options, O_NONBLOCK, shutdown(),
    set from the trainer on a copy of descriptor ``fd`` of clone ``pid`` (they act on the
    socket and its open file, which the copy shares)."""
    s = socket.socket(fileno=sharing.getfd_here(pid, fd))
    try:
        sockopts.apply(s, f.sk.opts)
        s.setblocking(not f.flags & os.O_NONBLOCK)
        if f.sk.shutdown:  # RCV_SHUTDOWN 1, SEND_SHUTDOWN 2 -> SHUT_RD 0, SHUT_WR 1, SHUT_RDWR 2
            s.shutdown(f.sk.shutdown - 1)
    except OSError as e:
        raise ForkError(f"process {proc.vpid} ({proc.name}) fd {f.fd}: setting the unix socket's state: {e}",
                        pid=proc.hostpid, step="unix") from None
    finally:
        s.close()


def _refill(ctx, r) -> None:
    """Every unix socket of the child exists: refill the queues, then give each socket its
    options and shutdown() state (a socket shut down takes no more bytes)."""
    r.flush()
    vpids = {p.hostpid: p.vpid for p in ctx.plans.values()}
    for pid, fd, msgs, what in ctx.shared.pop("unix-fills", []):
        _fill(r, pid, fd, msgs, vpids, what)
    made, hostpids = ctx.shared["unix"], {}
    for sk, what in ctx.shared.pop("unix-datagrams", []):  # each from the child's copy of its sender
        for msg in sk.queue:
            vpid, fd = made[msg[2]]
            if vpid not in hostpids:
                hostpids[vpid] = _hostpid(r, vpid)
            _fill(r, hostpids[vpid], fd, [msg], vpids, what, to=sk)
    for pid, fd, proc, f in ctx.shared.pop("unix-finish", []):
        _finish_socket(pid, fd, proc, f)


def fixup(ctx, proc, r, f) -> None:
    if "unix-left" not in ctx.shared:  # descriptors to make before _refill can run
        ctx.shared["unix-left"] = sum(1 for p in ctx.plans.values() if not p.is_init for g in p.fds
                                      if g.handler is OPS and g.dup_of is None)
    made = ctx.shared.setdefault("unix", {})
    waiting = ctx.shared.setdefault("unix-clients", {})  # server ino -> [(clone pid, fd, what)]
    if "unix-table" not in ctx.shared:
        ctx.shared["unix-table"] = {g.ino: g.sk for p in ctx.plans.values() for g in p.fds
                                    if getattr(g, "sk", None) is not None}
    what = f"process {proc.vpid} ({proc.name}) fd {f.fd}"
    unfinished = ctx.shared.setdefault("unix-unfinished", set())  # ends of pairs kept aside
    finish = f.ino not in made or f.ino in unfinished
    unfinished.discard(f.ino)
    if f.ino in made:  # an earlier clone made it (or kept this end of a pair aside)
        newfd = sharing.grab(r, made[f.ino])
    elif f.sk_fate == "pair":
        newfd = _pair(ctx, proc, r, f)
    elif f.sk_fate in ("listen", "bound") or f.sk_fate == "client" and f.sk.name:
        newfd = _bind(proc, r, f)
    else:
        newfd = r.call("socket", socket.AF_UNIX, f.sk.type | socket.SOCK_CLOEXEC, 0)
    r.install(newfd, f)
    if finish:
        ctx.shared.setdefault("unix-finish", []).append((r.t.pid, f.fd, proc, f))
        if f.sk_fate != "pair" and f.sk.queue:
            ctx.shared.setdefault("unix-datagrams", []).append((f.sk, what))
    if f.ino not in made:
        made[f.ino] = (proc.vpid, f.fd)
        if f.sk_fate == "client":
            waiting.setdefault(f.sk.peer, []).append((r.t.pid, f.fd, what))
    # a client and its server are connected once both exist, whichever clone made either first
    server = f.sk.peer if f.sk_fate == "client" else f.ino
    if server in made:
        for pid, fd, who in waiting.pop(server, []):
            _connect(r.t.pid, pid, fd, ctx.shared["unix-table"][server], who)
    ctx.shared["unix-left"] -= 1
    if ctx.shared["unix-left"] == 0:
        _refill(ctx, r)


OPS = SimpleNamespace(kind="unix-socket", claims=claims, check_tree=check_tree, fixup=fixup)
