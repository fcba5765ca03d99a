"""Terminals. A shell session's pty has its slave (/dev/pts/N) in the workspace and its master
in the trainer: the child gets pty N in its own devpts, with the template's termios and window
size, and the trainer keeps the new master for the child's Shell object. A pty whose master is
inside the workspace (script, tmux, expect, a REPL driver) is recreated the same way, its
master opened inside the child by whichever clone needs the pty first and fetched by the
others (pidfd_getfd), with the template's packet mode and lock. The slave keeps its owner and
mode. A session leader that had the terminal as its controlling tty gets it again (setsid +
TIOCSCTTY), the terminal's foreground group then being the leader's, as in the template;
another foreground group is given the terminal once all clones exist in an exact tree
(tree.py, give_foreground), and refused in a flat one. A process made by its parent's clone (tree.py) is in
its session and has its terminal, as in the template: a /dev/tty it holds is opened again there
(one whose clone is not so made is refused, check_tree). Any other process's clone keeps its
template's session (outside the child, in a flat tree), whose terminal is the template's: it is
dropped, so no child reaches the template's pty, nor another child's, through /dev/tty (the
module's JOIN_SESSION gives the clone its leader's clone's terminal after). Bytes buffered in a pty whose
master is inside the workspace are carried, both ways, unless in packet mode (whose reads would
take status bytes too): those for the master written again with the output processing off, those
for the slave's reader stuffed into its input with the input processing and echo off, in
canonical mode line by line and then the line being typed (_put_input). Those of a shell
session's pty are not."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import struct
import termios
import time
from dataclasses import dataclass
from types import SimpleNamespace

from ...errors import ForkError
from ..plan import _pty_index
from ..remote import ANY_ERROR, AT_FDCWD
from . import sharing

_TIOCGPTN = 0x80045430
_TIOCSPTLCK = 0x40045431
_TIOCSCTTY = 0x540E
_TIOCNOTTY = 0x5422
_TIOCPKT = 0x5420
_TIOCGPKT = 0x80045438
_TIOCGPTLCK = 0x80045439
_TIOCGDEV = 0x80045432


_MASTERS = ("/dev/ptmx", "/dev/pts/ptmx")


_CURRENT = "/dev/tty"  # the opener's controlling terminal, whichever it was


def claims(proc, f) -> bool:
    return f.target in _MASTERS or _is_slave(f) or (f.target == _CURRENT and stat.S_ISCHR(f.mode))


def _terminal_of(hostpid: int, fd: int) -> int | None:
    """The /dev/pts index of the terminal descriptor ``fd`` of ``hostpid`` is open on."""
    copy = sharing.getfd_here(hostpid, fd)
    try:
        return _pty_index(struct.unpack("I", fcntl.ioctl(copy, _TIOCGDEV, b"\0" * 4))[0])
    finally:
        os.close(copy)


def _is_slave(f) -> bool:
    return f.target.startswith("/dev/pts/") and f.target[9:].isdigit()


def _master_holders(plans) -> dict[int, tuple[int, int]]:
    """(host pid, fd) of a template process holding the master, by pty index."""
    return {int(sharing.fdinfo(p.hostpid, f.fd)["tty-index"]): (p.hostpid, f.fd)
            for p in plans if not p.is_init for f in p.fds if f.target in _MASTERS}


def _held_masters(plans) -> set[int]:
    """Indexes of the ptys whose master a template process holds."""
    return set(_master_holders(plans))


def _master_state(master: int) -> tuple[bool, bool]:
    """(packet mode, locked) of a pty, asked of its ``master``."""
    packet, locked = (struct.unpack("i", fcntl.ioctl(master, op, b"\0" * 4))[0] for op in (_TIOCGPKT, _TIOCGPTLCK))
    return bool(packet), bool(locked)


def _locked(holder: tuple[int, int]) -> bool:
    """Whether the pty of template master ``holder`` (host pid, fd) is locked."""
    fd = sharing.getfd_here(*holder)
    try:
        return _master_state(fd)[1]
    finally:
        os.close(fd)


def _stat(hostpid: int) -> list[str]:
    """/proc/PID/stat's fields after the comm (state ppid pgrp session tty_nr tpgid ...), as
    the host sees them."""
    with open(f"/proc/{hostpid}/stat", "rb") as fh:
        raw = fh.read()
    return raw[raw.rindex(b")") + 2 :].decode().split()


def check_tree(procs) -> None:
    """Refuse what a child's pty would not have as the template's: a slave open on a locked
    pty, a leader's controlling terminal no process of the workspace has open (its master
    could not be made again), another foreground group than the leader's."""
    plans = [p for p in procs if not p.is_init]
    holders = _master_holders(plans)
    opened = {int(f.target[9:]) for p in plans for f in p.fds if _is_slave(f)}
    inherits: set[int] | None = None  # asked once, of the first non-leader holding /dev/tty
    for index, holder in holders.items():
        if index in opened and _locked(holder):
            p, f = next((p, f) for p in plans for f in p.fds if _is_slave(f) and int(f.target[9:]) == index)
            raise ForkError(f"process {p.vpid} ({p.name}) fd {f.fd}: pty /dev/pts/{index} was locked again "
                            "(TIOCSPTLCK) while its slave is open; a fork cannot open the slave of a locked "
                            "pty", pid=p.hostpid, step="plan")
    for p in plans:
        for f in p.fds:
            if f.target != _CURRENT or not stat.S_ISCHR(f.mode):
                continue
            what = f"process {p.vpid} ({p.name}) fd {f.fd}: /dev/tty"
            if p.sid != p.vpid and p.vpid not in (inherits := _inherits_terminal(procs, inherits)):
                raise ForkError(f"{what} of a process that is not its session leader: its clone is not made "
                                "in its session, with the child's terminal, by its parent's clone (an exact "
                                "tree, tree.py), and cannot be given it", pid=p.hostpid, step="plan")
            on = _terminal_of(p.hostpid, f.fd)
            if on is None or on != p.ctty:
                raise ForkError(f"{what} is open on another terminal than its controlling one, which a fork "
                                "cannot open again as /dev/tty", pid=p.hostpid, step="plan")
    group_of = {int(_stat(p.hostpid)[2]): p.pgid for p in plans}
    for p in plans:
        if p.ctty is None or p.sid != p.vpid:
            continue
        what = f"process {p.vpid} ({p.name}): its controlling terminal /dev/pts/{p.ctty}"
        if p.ctty not in opened | set(holders):
            raise ForkError(f"{what} is open in no process of the workspace; a fork cannot make it again",
                            pid=p.hostpid, step="plan")
        st = _stat(p.hostpid)
        if st[5] != st[2]:
            fg = group_of.get(int(st[5]))
            if fg is not None and _exact_tree():  # its clone's children are in its session:
                p.foreground = fg  # give_foreground, once they are all there
                continue
            raise ForkError(f"{what} has {'no' if fg is None else f'group {fg}'} as its foreground process "
                            f"group, not the session leader's: a fork gives the terminal back to the leader "
                            "alone", pid=p.hostpid, step="plan")


def _inherits_terminal(procs, known: set[int] | None) -> set[int]:
    """The vpids whose clone an exact tree (tree.py) makes in its session with the terminal
    the template's has: made by its parent's clone, which has them (its session leader's
    takes the terminal before making its children); ``known`` once asked."""
    if known is not None:
        return known
    if not _exact_tree():
        return set()
    from ..cloners import cloner
    from ..tree import shape

    made_by_parent = shape(procs, cloner().transplants).parent_made
    by = {p.vpid: p for p in procs}
    out: set[int] = set()
    for p in procs[1:]:  # in pid order, a parent mostly before its children
        chain, q = [], p
        while q.vpid != q.sid and q.vpid in made_by_parent and q.ppid in by:
            chain.append(q)
            q = by[q.ppid]
        if q.vpid == q.sid and q.ctty is not None and all(c.ctty == q.ctty for c in chain):
            out.update(c.vpid for c in chain)
    return out


def _opened(ctx) -> set[int]:
    """Indexes of the ptys whose slave a template process holds."""
    if "opened-ptys" not in ctx.shared:
        ctx.shared["opened-ptys"] = {int(f.target[9:]) for p in ctx.plans.values() for f in p.fds if _is_slave(f)}
    return ctx.shared["opened-ptys"]


def _inner_indexes(ctx) -> set[int]:
    if "inner-ptys" not in ctx.shared:
        ctx.shared["inner-ptys"] = _held_masters(ctx.plans.values())
    return ctx.shared["inner-ptys"]


def _open_index(index: int, open_master, index_of, close) -> int:
    """A master for pty ``index`` in a devpts instance: open ptmx until the kernel hands out
    that number (it takes the lowest free one), closing the others."""
    spare = []
    try:
        while True:
            m = open_master()
            got = index_of(m)
            if got == index:
                return m
            spare.append(m)
            if got > index + 64:
                raise ForkError(f"cannot get pty {index} in the child's /dev/pts (got {got})")
    finally:
        for fd in spare:
            close(fd)


def _copy_tty(src_slave: str, dst_slave: str, src: int, dst: int) -> None:
    """Owner and mode of slave ``src_slave`` onto slave ``dst_slave``; termios and window size
    from ``src`` to ``dst`` (a slave, or its master: a master's termios calls act on its slave,
    and no slave need be opened, whose last close would end the master's packet mode and make
    its reads fail)."""
    st = os.stat(src_slave)
    os.chown(dst_slave, st.st_uid, st.st_gid)
    os.chmod(dst_slave, stat.S_IMODE(st.st_mode))
    termios.tcsetattr(dst, termios.TCSANOW, termios.tcgetattr(src))
    fcntl.ioctl(dst, termios.TIOCSWINSZ, fcntl.ioctl(src, termios.TIOCGWINSZ, b"\0" * 8))


def _take(end: int) -> bytes:
    """What is waiting to be read at ``end`` (a template's, frozen), taken out of it. The
    kernel moves bytes into the ldisc's buffer from the pty's own in a worker, frozen
    processes or not, and holds them back while that buffer is full: once some are read, it
    is read again until a pause brings no more."""
    out, quiet, deadline = b"", 0, time.monotonic() + 2.0
    while time.monotonic() < deadline:
        n = struct.unpack("i", fcntl.ioctl(end, termios.FIONREAD, b"\0" * 4))[0]
        if n:
            out += os.read(end, n)  # available: it cannot block
            quiet = 0
        elif not out or quiet == 3:  # nothing at all, or three pauses in a row brought no more
            break
        else:
            quiet += 1
        time.sleep(0.002)
    return out


@dataclass
class Input:
    """What the master wrote and the slave's reader has not read. In canonical mode each read
    returns one line (up to its end of line; one ended by the EOF character without it, an
    empty one as 0 bytes), and the line being typed cannot be read at all; otherwise
    ``lines`` is empty and ``typing`` holds every byte."""

    lines: list[bytes]
    typing: bytes
    escaping: bool = False  # an LNEXT (^V) was typed last: the next byte typed is taken as is

    def __bool__(self) -> bool:
        return bool(self.lines or self.typing or self.escaping)


def _canonical(attrs: list) -> bool:
    """Whether reads of a tty with termios ``attrs`` return lines (EXTPROC: the ldisc leaves
    the line editing to another side, and reads return bytes)."""
    return bool(attrs[3] & termios.ICANON and not attrs[3] & _EXTPROC)


def _take_lines(fd: int) -> list[bytes]:
    """Every complete line waiting at canonical slave ``fd``, taken out of it. A read that
    finds none waits for the bytes the kernel is still moving into the ldisc (n_tty_read)."""
    lines = []
    for _ in range(_N_TTY_BUF_SIZE):  # each line takes at least one byte of the ldisc's buffer
        try:
            lines.append(os.read(fd, _N_TTY_BUF_SIZE))
        except BlockingIOError:
            return lines
    raise ForkError(f"{os.readlink(f'/proc/self/fd/{fd}')}: its reader's lines never end")


@contextlib.contextmanager
def _stuffing(fd: int, was: list):
    """Tty ``fd`` (termios ``was``) set to take bytes stuffed into its input as they are: they
    went through the input processing and echo once already. Every special character is off
    but, in canonical mode, the newline, LNEXT (_LNEXT) and EOF (_EOF)."""
    # IXON stays: turning it off would restart output stopped by ^S; with START and STOP off no
    # byte stuffed acts on the flow (nor IXANY's any byte)
    iflag = was[0] & (termios.IXON | termios.IXOFF)
    lflag = was[3] & ~(termios.ECHO | termios.ECHONL | termios.ISIG | termios.IEXTEN)
    cc = [b"\0"] * len(was[6])  # _POSIX_VDISABLE: byte 0 is never special (n_tty's char_map)
    cc[termios.VMIN], cc[termios.VTIME] = was[6][termios.VMIN], was[6][termios.VTIME]
    if _canonical(was):
        lflag |= termios.IEXTEN
        cc[termios.VEOF], cc[termios.VLNEXT] = _EOF, _LNEXT
    termios.tcsetattr(fd, termios.TCSANOW, [iflag, was[1], was[2], lflag, *was[4:6], cc])
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, was)  # ICANON as it was: the ldisc keeps its lines


def _take_input(slave: str) -> Input:
    """The input waiting for the reader of ``slave`` (a template's), taken out of it. In
    canonical mode the line being typed is ended with a newline stuffed in, and read: a
    newline that only makes a second one needed was escaped by an LNEXT typed last."""
    fd = os.open(slave, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        was = termios.tcgetattr(fd)
        if not _canonical(was):
            return Input([], _take(fd))
        lines = _take_lines(fd)
        with _stuffing(fd, was):
            _stuff(fd, b"\n")
            try:
                return Input(lines, os.read(fd, _N_TTY_BUF_SIZE)[:-1])
            except BlockingIOError:
                _stuff(fd, b"\n")
                return Input(lines, os.read(fd, _N_TTY_BUF_SIZE)[:-2], escaping=True)
    finally:
        os.close(fd)


def _stuff(fd: int, data: bytes) -> None:
    """``data`` into tty ``fd``'s input, one TIOCSTI a byte: the ldisc takes each at once, in
    the caller's thread, so the termios in force is the one set for it (a write on the master
    is taken later, by a kernel worker)."""
    for byte in data:
        fcntl.ioctl(fd, termios.TIOCSTI, bytes((byte,)))


def _put_input(slave: str, waiting: Input) -> None:
    """``waiting`` into the input of pty ``slave``, as its reader had it (_stuffing). In
    canonical mode each byte that would end a line or escape the next is escaped with LNEXT,
    and each complete line is ended with a newline (when it was read with one) or EOF (when
    not): its reads return the same bytes."""
    fd = os.open(slave, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        was = termios.tcgetattr(fd)
        with _stuffing(fd, was):
            if not _canonical(was):
                _stuff(fd, waiting.typing)
                return
            for line in waiting.lines:
                body, end = (line[:-1], b"\n") if line.endswith(b"\n") else (line, _EOF)
                _stuff(fd, _escaped(body) + end)
            _stuff(fd, _escaped(waiting.typing) + (_LNEXT if waiting.escaping else b""))
    finally:
        os.close(fd)


_N_TTY_BUF_SIZE = 4096
_EXTPROC = 0o200000  # asm-generic/termbits.h (Python's termios lacks it)
_EOF, _LNEXT = b"\x04", b"\x16"  # ^D and ^V, while input is stuffed (_stuffing)


def _escaped(data: bytes) -> bytes:
    """``data`` with LNEXT before each byte that would end a line or escape the next."""
    out = bytearray()
    for byte in data:
        if bytes((byte,)) in (b"\n", _EOF, _LNEXT):
            out += _LNEXT
        out.append(byte)
    return bytes(out)


def _put_output(slave: str, data: bytes) -> None:
    """``data`` into the master's side of pty ``slave``, as the slave had written it: written
    with OPOST off, since it went through the output processing once already."""
    fd = os.open(slave, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        was = termios.tcgetattr(fd)
        termios.tcsetattr(fd, termios.TCSANOW, [was[0], was[1] & ~termios.OPOST, *was[2:]])
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
        except BlockingIOError:
            # Its output is stopped (^S): they fitted before. Let it flow for them, then stop it
            # again, so that the template loses none of the bytes taken out of it.
            termios.tcflow(fd, termios.TCOON)
            try:
                while view:
                    view = view[os.write(fd, view):]
            except BlockingIOError:
                raise ForkError(f"{slave}: {len(view)} of the {len(data)} bytes the pty's master had not "
                                "read could not be written back") from None
            finally:
                termios.tcflow(fd, termios.TCOOFF)
        finally:
            termios.tcsetattr(fd, termios.TCSANOW, was)
    finally:
        os.close(fd)


def _inner_master(ctx, proc, r, index: int) -> tuple[int, int]:
    """(vpid, fd) of the child's master of inner pty ``index``, made in this clone if new."""
    made = ctx.shared.setdefault("inner-masters", {})
    if index in made:
        return made[index]

    def open_master() -> int:
        return r.openat("/dev/pts/ptmx", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)

    def index_of(fd: int) -> int:
        addr = r.put(bytes(4))
        r.call("ioctl", fd, _TIOCGPTN, addr)
        return struct.unpack("I", r.t.read(addr, 4))[0]

    fd = _open_index(index, open_master, index_of, lambda fd: r.call("close", fd))
    r.call("ioctl", fd, _TIOCSPTLCK, r.put(struct.pack("i", 0)))
    src, dst = sharing.getfd_here(*_master_holders(ctx.plans.values())[index]), sharing.getfd_here(r.t.pid, fd)
    try:
        slave = f"/proc/{ctx.init_hostpid}/root/dev/pts/{index}"
        _copy_tty(_template_slave(ctx, index), slave, src, dst)
        packet, locked = _master_state(src)
        if not packet and index in _opened(ctx):
            pending = _take(src)
            if pending:
                _put_output(_template_slave(ctx, index), pending)  # the template's again
                _put_output(slave, pending)
            waiting = _take_input(_template_slave(ctx, index))
            if waiting:
                _put_input(_template_slave(ctx, index), waiting)  # the template's again
                _put_input(slave, waiting)
    finally:
        os.close(src)
        os.close(dst)
    for op, on in ((_TIOCPKT, packet), (_TIOCSPTLCK, locked)):
        if on:
            r.call("ioctl", fd, op, r.put(struct.pack("i", 1)))
    made[index] = (proc.vpid, fd)
    ctx.shared.setdefault("close_later", []).append((r.t, fd))  # a spare until its holder takes it
    return made[index]


def open_master(child_init: int, index: int, template_slave: str) -> int:
    """A master, in the trainer, for pty ``index`` of the devpts of the child whose init is
    ``child_init``, with the termios and window size of ``template_slave``."""
    m = _open_index(index,
                    lambda: os.open(f"/proc/{child_init}/root/dev/pts/ptmx",
                                    os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC | os.O_NONBLOCK),
                    lambda fd: struct.unpack("I", fcntl.ioctl(fd, _TIOCGPTN, b"\0" * 4))[0],
                    os.close)
    try:
        fcntl.ioctl(m, _TIOCSPTLCK, struct.pack("i", 0))
        src = os.open(template_slave, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
        try:
            _copy_tty(template_slave, f"/proc/{child_init}/root/dev/pts/{index}", src, m)
        finally:
            os.close(src)
    except BaseException:
        os.close(m)
        raise
    return m


def trainer_indexes(plans) -> set[int]:
    """The ptys whose slave a template process holds and whose master is the trainer's (a
    shell session's): the ones whose child masters :func:`open_master` can make ahead."""
    slaves = {int(f.target[9:]) for p in plans if not p.is_init for f in p.fds if _is_slave(f)}
    return slaves - _held_masters(plans)


def _master(ctx, index: int, template_slave: str) -> int:
    """The child's master for pty ``index`` (opened in the child's devpts, or made ahead with
    the child's init: earlyinit.py)."""
    masters = ctx.shared.setdefault("pty_masters", {})
    if index not in masters:
        masters[index] = open_master(ctx.init_hostpid, index, template_slave)
    return masters[index]


def _template_slave(ctx, index: int) -> str:
    tpl_init = next(p.hostpid for p in ctx.plans.values() if p.is_init)
    return f"/proc/{tpl_init}/root/dev/pts/{index}"


def _ensure_master(ctx, proc, r, index: int) -> None:
    """The child's pty ``index`` exists (a slave opens only once its master does)."""
    if index in _inner_indexes(ctx):
        _inner_master(ctx, proc, r, index)
    else:
        _master(ctx, index, _template_slave(ctx, index))


def _reopen_flags(f) -> int:
    return f.flags & ~(os.O_CREAT | os.O_TRUNC | os.O_EXCL) | os.O_NOCTTY


def fixup(ctx, proc, r, f) -> None:
    if f.target in _MASTERS:
        index = int(sharing.fdinfo(proc.hostpid, f.fd)["tty-index"])
        r.install(sharing.grab(r, _inner_master(ctx, proc, r, index)), f)
    elif f.target == _CURRENT:  # its controlling terminal (check_tree), then /dev/tty is it
        from ..tree import INHERITED

        if proc.sid == proc.vpid:
            take_terminal(ctx, proc, r)
        elif proc.vpid not in ctx.shared.get(INHERITED, ()):  # a tree other than check_tree's
            raise ForkError(f"process {proc.vpid} ({proc.name}) fd {f.fd}: /dev/tty of a process that is "
                            "not its session leader, whose clone was not made by its parent's clone "
                            "(BUNSHIN_TREE changed since the snapshot?)", pid=proc.hostpid, step="tty")
        r.install(r.queue_openat(f.target, _reopen_flags(f)), f)
    else:
        _ensure_master(ctx, proc, r, int(f.target[9:]))
        r.install(r.queue_openat(f.target, _reopen_flags(f)), f)


def take_terminal(ctx, proc, r) -> None:
    """Session leader ``proc``'s clone (setsid left it no terminal) takes its pty again."""
    _ensure_master(ctx, proc, r, proc.ctty)
    fd = r.queue_openat(f"/dev/pts/{proc.ctty}", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    r.queue("ioctl", fd, _TIOCSCTTY, 0)  # 0 also when it is already its own
    r.queue("close", fd)


def _exact_tree() -> bool:
    from ..cloners import cloner

    return cloner().exact_tree()


def give_foreground(ctx, proc, clone) -> None:
    """Session leader ``proc``'s terminal to the foreground group its template's has (tree.py,
    once every clone is made and fixed: the group is then in the clone's session)."""
    r = ctx.cloner.remote(clone, f"process {proc.vpid} ({proc.name})")
    try:
        fd = r.queue_openat(f"/dev/pts/{proc.ctty}", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
        r.queue("ioctl", fd, termios.TIOCSPGRP, r.queue_put(struct.pack("i", proc.foreground)))
        r.queue("close", fd)
        r.flush()
    finally:
        r.release()


def fixup_proc(ctx, proc, r) -> None:
    """The clone's controlling terminal: its pty again for a session leader; none for another
    process, whose terminal is still the template's (see the module's docstring), but for one
    its parent's clone made in its session (tree.py), which has that session's."""
    from ..tree import INHERITED

    if proc.ctty is not None and proc.sid == proc.vpid:
        take_terminal(ctx, proc, r)
    elif proc.vpid in ctx.shared.get(INHERITED, ()):
        if proc.ctty is None:  # it had left the terminal its session has
            _drop_terminal(r)
    elif proc.ctty is not None:
        _drop_terminal(r)


def _drop_terminal(r) -> None:
    # no /dev/tty in the child's root, or a terminal hung up: nothing reachable to drop
    fd = r.queue("openat", AT_FDCWD & 0xFFFFFFFFFFFFFFFF, r.queue_path("/dev/tty"),
                 os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC, 0, ok_errnos=ANY_ERROR)
    r.queue("ioctl", fd, _TIOCNOTTY, 0, ok_errnos=ANY_ERROR)
    r.queue("close", fd, ok_errnos=ANY_ERROR)


OPS = SimpleNamespace(kind="pty", claims=claims, check_tree=check_tree, fixup=fixup)
CTTY = SimpleNamespace(kind="controlling terminal", plan_proc=lambda proc: None, fixup_proc=fixup_proc)
