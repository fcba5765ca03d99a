"""The child's process tree made the template's without the kernel module (a stock kernel).

A clone can only be a child of the process that made it, and its memory can only come from
its maker. So every clone is made by its parent's clone, and a parent's clone holds, until its
children exist, the memory of the one child it hands on copy-on-write: the child whose lineage
(the child, its child...) has the most private memory, the heir. Once its children exist, that
parent's clone becomes the parent by a transplant (transplant.py: its memory copied: shells and
supervisors are small). Chain init -> bash -> python: bash' is a copy-on-write clone of python
(through an intermediate, as a flat fork makes every clone), made a member of bash's session
and group (with bash's terminal); bash' clones python' (one injected clone3: it is already in
the child's pid namespace); bash' then becomes bash.

How each clone is made (:class:`Shape`):

- ``OWN``: through an intermediate of its own template process, a child of the child's init (a
  child of the init; or one that cannot be made under its parent's clone, Shape.flat).
- ``LINEAGE``: a child of the init with an heir: through an intermediate of its lineage's
  leaf, then transplanted.
- ``HEIR``: injected clone3 in its parent's clone, which holds its lineage's memory;
  transplanted after its own children when that memory is another's.
- ``COPY``: a transplant made by its parent's clone (a blank of it with the pid, which becomes
  the process, its memory copied): a process under another uid, and a parent's other children.

Deviations, each a process made ``OWN`` (or, under another uid, ``COPY`` by the child's init),
so a child of the child's init (Shape.flat, logged): one whose parent has seccomp filters beyond
the init's, which every process inherits (its blank would keep them beside its own), one with
another exit signal than SIGCHLD, one in neither its parent's session nor one of its own (its
parent left that session), and a process under the init's uid a transplant cannot make
(transplant.refusal).

Sessions: a parent's clone joins its session and group (setsid with the terminal of a
session leader, ptys.take_terminal; setpgid) before it makes its children, who so inherit
them as in the template; ptys.fixup_proc leaves such a child its terminal. The fixups
(engine.fix_process) run once every clone exists, in plan order, as in a flat tree.
"""

from __future__ import annotations

import logging
import signal
import weakref
from dataclasses import dataclass, field

from ..compel import Tracee
from ..errors import BunshinError, ForkError
from . import earlyinit, engine, transplant
from .plan import ProcPlan, proc_status, read_text
from .remote import ANY_ERROR, enter_namespaces

log = logging.getLogger("bunshin.fork")

OWN, LINEAGE, HEIR, COPY = "own", "lineage", "heir", "copy"
LED = "tree-led"  # ctx.shared: vpids whose clone joined its session before its children
INHERITED = "tree-inherited"  # ctx.shared: vpids whose clone has its session from its parent's


@dataclass
class Shape:
    """How each clone of one template is made, in the order they are made."""

    how: dict[int, str] = field(default_factory=dict)
    image: dict[int, ProcPlan] = field(default_factory=dict)  # whose memory its clone is made with
    parent_made: set[int] = field(default_factory=set)  # vpids made by their parent's clone
    flat: dict[int, str] = field(default_factory=dict)  # vpid -> why it is the init's child
    kids: dict[int, list[ProcPlan]] = field(default_factory=dict)  # by the vpid that makes them


def _private(proc: ProcPlan) -> int:
    """Bytes a copy of the process's memory would write: its anonymous pages, present (shared
    copy-on-write or not: a template's are the source's) or swapped."""
    total = 0
    for line in read_text(f"/proc/{proc.hostpid}/smaps_rollup").splitlines():
        if line.startswith(("Anonymous:", "Swap:")):
            total += int(line.split()[1]) << 10
    return total


def _status(proc: ProcPlan, key: str) -> str:
    return proc_status(proc.hostpid).get(key, "").strip()


def shape(plans: list[ProcPlan], transplants, filters=lambda p: None) -> Shape:
    """The way each of ``plans[1:]`` is made (``transplants(proc)``: it cannot clone itself
    into the child, Cloner.transplants; ``filters(proc)``: why its seccomp filters cannot be
    had again, None: they can)."""
    init = plans[0]
    by = {p.vpid: p for p in plans}
    s = Shape()
    kids: dict[int, list[ProcPlan]] = {p.vpid: [] for p in plans}
    for p in plans[1:]:  # under its parent, or (None) the init
        parent = by.get(p.ppid) if p.ppid != init.vpid else None
        why = None if parent is None else (
            "its parent has seccomp filters of its own (a blank of it would keep them)"
            if parent.seccomp_filters > init.seccomp_filters else
            f"its exit signal is {p.exit_signal}, not SIGCHLD" if p.exit_signal != signal.SIGCHLD
            else "its parent has left its session" if p.sid not in (parent.sid, p.vpid) else None)
        if why is not None:
            s.flat[p.vpid], parent = why, None
        kids[parent.vpid if parent is not None else init.vpid].append(p)
    s.kids = kids
    refusals: dict[int, str | None] = {}

    def becomes(p: ProcPlan) -> bool:  # a transplant can make it
        if p.vpid not in refusals:
            refusals[p.vpid] = transplant.refusal(p) or (filters(p) if p.seccomp_filters else None)
        return refusals[p.vpid] is None

    def lineage(p: ProcPlan) -> tuple[int, ProcPlan, ProcPlan | None]:
        """(private bytes, leaf, heir) of the best lineage from ``p``: ``p`` itself unless a
        child's lineage has more memory; only through processes that clone themselves, whose
        parent's clone can become it, and which have nothing their parent lacks and keeps
        (seccomp filters, no_new_privs, a smaller capability bounding set)."""
        candidates = [c for c in kids[p.vpid] if not transplants(c)
                      and c.seccomp_filters == p.seccomp_filters
                      and all(_status(c, k) == _status(p, k) for k in ("NoNewPrivs", "CapBnd"))]
        if not candidates or not becomes(p):
            return _private(p), p, None
        best: tuple[int, ProcPlan, ProcPlan | None] = (_private(p), p, None)
        for c in candidates:
            size, leaf, _ = lineage(c)
            if size > best[0]:
                best = (size, leaf, c)
        return best

    def place(p: ProcPlan, parent: ProcPlan | None, image: ProcPlan | None) -> None:
        """``image``: the leaf whose memory ``parent``'s clone holds when ``p`` is its heir."""
        if transplants(p):
            s.how[p.vpid], s.image[p.vpid] = COPY, p
        elif image is not None:
            s.how[p.vpid], s.image[p.vpid] = HEIR, image
        elif parent is not None and becomes(p):
            s.how[p.vpid], s.image[p.vpid] = COPY, p
        else:
            if parent is not None:
                s.flat[p.vpid] = f"a transplant cannot make it: it {refusals[p.vpid]}"
                parent = None
            s.how[p.vpid], s.image[p.vpid] = OWN, p
        if parent is not None:
            s.parent_made.add(p.vpid)
        heir = None
        if kids[p.vpid] and s.how[p.vpid] != COPY:
            if image is None:
                _, leaf, heir = lineage(p)
                if heir is not None:
                    s.image[p.vpid] = leaf
                    if s.how[p.vpid] == OWN:
                        s.how[p.vpid] = LINEAGE
            else:  # an heir's own heir is the next on the lineage towards the leaf
                heir = next((c for c in kids[p.vpid] if _holds(c, image)), None)
        for c in kids[p.vpid]:
            place(c, p, s.image[p.vpid] if c is heir else None)

    def _holds(c: ProcPlan, leaf: ProcPlan) -> bool:
        return c is leaf or any(_holds(g, leaf) for g in kids[c.vpid])

    for p in kids[init.vpid]:
        place(p, None, None)
    for p in plans[1:]:
        if p.vpid in s.flat:
            log.info("process %d (%s): a child of the child's init, not of its parent's clone: %s",
                     p.vpid, p.name, s.flat[p.vpid])
    return s


def _filters_refusal(tracees, p: ProcPlan) -> str | None:
    """Why a transplant could not have ``p``'s seccomp filters again (read by this thread, its
    tracer), None: it could."""
    if p.hostpid not in tracees:
        return "has seccomp filters, not read here"
    try:
        tracees[p.hostpid]  # a held template's is woken (stopped) by the lookup: read thawed
        transplant.read_filters(p.hostpid, p)
    except ForkError as e:
        return f"has seccomp filters a transplant cannot have: {e}"
    return None


_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # template -> (Shape, reads)


def maker(core, tracees, transplants) -> Maker:
    """The Maker of a fork of template ``core`` (template.TemplateCore): its shape and what its
    transplants read are kept for its next forks (a held template's processes do not run
    between them: ~2 ms a fork with a shell and its job)."""
    kept = _KEPT.get(core)
    if kept is None:
        kept = _KEPT[core] = (shape(core.plans, transplants, lambda p: _filters_refusal(tracees, p)), {})
    return Maker(core, tracees, *kept)


class Maker:
    """The clones of one fork's children made as :class:`Shape` says."""

    def __init__(self, core, tracees, shape: Shape, reads: dict[int, transplant.Source]) -> None:
        self.core, self.tracees, self.shape = core, tracees, shape
        self._reads = reads

    def _read(self, proc: ProcPlan) -> transplant.Source:
        """What a transplant of ``proc`` takes, read once per template."""
        if proc.hostpid not in self._reads:
            self._reads[proc.hostpid] = transplant.read_source(self.tracees[proc.hostpid], proc)
        return self._reads[proc.hostpid]

    def child(self, k) -> None:
        """Every clone of child ``k`` (template._Child), then each fixed up; its clones in plan
        order. The child's init moves into its root meanwhile: only what enters the child's
        namespaces waits for it (_make), so the first clones are made beside that move."""
        ctx = k.context()
        ctx.shared.setdefault(LED, set())
        ctx.shared.setdefault(INHERITED, set())
        made: dict[int, Tracee] = {}
        for p in self.shape.kids[self.core.plans[0].vpid]:
            self._make(k, ctx, p, None, made)
        earlyinit.drop_mids(k.mids, self.tracees)  # those of clones made by their parents'
        for pl in self.core.plans[1:]:  # the template's answers, while the init may still move
            k.ask(pl)
        k.ready()
        k.clones[:] = [made[pl.vpid] for pl in self.core.plans[1:]]
        # fixed once all exist, in plan order as a flat tree's: the resources that share a file
        # between processes count on its first holder's clone being fixed first
        for pl in self.core.plans[1:]:
            k.fix(pl, made[pl.vpid])
        from .resources import ptys

        for pl in self.core.plans[1:]:
            if getattr(pl, "foreground", None) is not None:  # ptys.check_tree
                ptys.give_foreground(ctx, pl, made[pl.vpid])

    def _make(self, k, ctx: engine.ForkCtx, p: ProcPlan, parent: Tracee | None,
              made: dict[int, Tracee]) -> None:
        s = self.shape
        how, image = s.how[p.vpid], s.image[p.vpid]
        kids = s.kids[p.vpid]
        if how == COPY or kids:  # a blank made in the child, or a clone that enters it (_lead)
            k.ready()
        by_parent = parent if p.vpid in s.parent_made else None
        c, born_in_cg = self._clone(k, p, how, image, by_parent)
        k.clones.append(c)  # abort() discards it from here on
        made[p.vpid] = c
        if not born_in_cg:
            k.cg.add(c.pid)  # before its children and threads, which are then born there
        k.born_in_cg.add(p.hostpid)
        if by_parent is not None:
            ctx.shared[INHERITED].add(p.vpid)
        if kids:
            self._lead(ctx, p, c)
            for kid in kids:
                self._make(k, ctx, kid, c, made)
        if how in (LINEAGE, HEIR) and image is not p:
            read = self._read(p)
            transplant.become(c, self.tracees[p.hostpid], read, p)
            c.transplanted = read  # type: ignore[attr-defined]  # credentials: finish_child
        if getattr(c, "transplanted", None) is not None:
            p.transplanted = True  # its fixups (its zombies' ids) run as root, as a blank's

    def _clone(self, k, p: ProcPlan, how: str, image: ProcPlan,
               parent: Tracee | None) -> tuple[Tracee, bool]:
        """The clone, and whether it was born in the child's cgroup: made there by its parent's
        clone or the child's init, or through an intermediate made ahead (into it)."""
        from .cloners import Injection, clone_failed

        if how == COPY:
            read = self._read(p)
            src = self.tracees[p.hostpid]
            blank = (transplant.make(parent, src, read, p) if parent is not None
                     else transplant.make_by_init(k.init_pid, src, read, p))
            blank.transplanted = read  # type: ignore[attr-defined]
            return blank, True
        if how == HEIR:
            assert parent is not None
            try:
                return parent.clone(set_tid=p.vpid, owe_robust=True), True
            except ForkError as e:
                raise clone_failed(p, "its clone", p.vpid, e) from None
        core, src = self.core, image  # OWN, LINEAGE: through an intermediate of ``image``
        mids: list[int] = []  # the dead intermediate, to reap in its template process
        c: Tracee | None = None
        ahead = k.take_mid(src.hostpid)
        try:
            c = Injection.through(lambda: self.tracees[src.hostpid], p, k.init_pid,
                                   core.tmp_pids[src.hostpid], mids, ahead,
                                   core.mids_reap_themselves(src))
            if mids:
                engine.reap_in(self.tracees[src.hostpid], mids)
        except BaseException:
            if c is not None:
                engine.discard_clone(c)
            elif mids:
                try:
                    engine.reap_in(self.tracees[src.hostpid], mids)
                except BunshinError:
                    pass  # the template process is what failed: the fork says so already
            raise
        return c, ahead is not None

    def _lead(self, ctx: engine.ForkCtx, p: ProcPlan, c: Tracee) -> None:
        """Before ``p``'s clone makes its children: in the child's namespaces, in ``p``'s
        session (with its terminal) and group, with the robust list its heir's clone copies."""
        from .resources import ptys

        r = ctx.cloner.remote(c, f"process {p.vpid} ({p.name})")
        try:
            owed = c.take_owed_robust()
            if owed is not None:
                r.queue("set_robust_list", *owed)
            enter_namespaces(r, p.cwd, setns=not ctx.cloner.in_child)
            if p.sid == p.vpid:
                r.queue("setsid")
                if p.ctty is not None:
                    ptys.take_terminal(ctx, p, r)
            elif p.pgid == p.vpid:
                r.queue("setpgid", 0, 0)
            elif p.pgid in ctx.plans:
                r.queue("setpgid", 0, p.pgid, ok_errnos=ANY_ERROR)
            r.flush()
        finally:
            r.release()
        ctx.shared[LED].add(p.vpid)
