"""``WorkspaceHost``: the Ray actor, one per node, that owns that node's workspaces.

Everything Bunshin holds lives in one process per machine: workspaces, templates, the fork
thread that keeps templates seized, the prefix cache's live states. On Ray that process is this
actor. It is pinned to its node (``NodeAffinitySchedulingStrategy(soft=False)``), asks no CPU
and a sliver of a custom resource (an actor holding a node's whole custom resource starves the
tasks that ask a fraction of it), and is an asyncio actor, so the tool calls of many rollouts
and clients run at once: blocking work goes to a thread pool of its own.

Workspaces made through :class:`~bunshin.cluster.RemoteWorkspace` belong to an *owner* (a
process of the cluster, see :mod:`.lease`) that renews a lease; when its leases stop (the process
died) the host closes what it owned within ``lease_s`` (+ one reaper period). Workspaces of
:meth:`WorkspaceHost.run_group` belong to the host.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..rl.types import Policy, RolloutError, Task, Trajectory
from .errors import ClusterError, TaskSetupError, UnknownWorkspace
from .types import GroupTrajectory

if TYPE_CHECKING:
    from ..runtime.result import Result
    from ..runtime.shell import Shell
    from ..runtime.template import Template
    from ..runtime.workspace import Workspace

log = logging.getLogger("bunshin.cluster")

__all__ = ["DEFAULT_RESOURCE", "HOST_NAMESPACE", "WorkspaceHost", "host_name", "start_hosts"]

DEFAULT_RESOURCE = "bunshin"
"""The custom resource a node offers to get a host (``ray start --resources '{"bunshin": 1}'``)."""
HOST_NAMESPACE = "bunshin"
"""The Ray namespace of the hosts' actor names, so any job of the cluster finds them."""
STREAM_AHEAD = 8
"""Chunks (≤ 1 MiB each) a host sends of an image or a layer before the receiver has taken
them (Ray's generator backpressure): what a transfer holds in flight, whatever its size."""
COLLECT_EVERY_S = 5.0
"""Seconds between a host's passes over what dead trainers of its machine left."""
CHUNK_WAIT_S = 120.0
"""Seconds an import waits for the sender's next chunk before it gives up (the sender is then
told to stop, so it lets go of its export)."""
RESOURCE_SHARE = 0.001
"""What a host asks of its node's custom resource: a sliver, so tasks asking a part of it still fit."""

T = TypeVar("T")


def host_name(node_id: str) -> str:
    """The actor name of the host of node ``node_id``."""
    return f"bunshin-host-{node_id}"


def free_memory() -> int:
    """Bytes the node can still give (MemAvailable)."""
    with open("/proc/meminfo") as f:
        return next((int(ln.split()[1]) << 10 for ln in f if ln.startswith("MemAvailable:")), 0)


@dataclass
class _Held:
    """A workspace or template of the host, and whose it is (None: the host's own)."""

    obj: Any
    owner: str | None
    made: float


@dataclass
class _TaskState:
    """A task's set-up state on this host, kept as a template across groups."""

    task: Task
    template: Template
    setup_s: float
    pulled_from: str | None = None  # the node whose saved template this one was loaded from
    rollout_s: float = 0.0  # summed over the rollouts run from it
    rollouts: int = 0


class HeldTemplate:
    """A rollout engine's workspace provider (:mod:`bunshin.rl.workspaces`) over a template the
    host keeps: no setup per group, one fork per rollout."""

    def __init__(self, task: Task, template: Template) -> None:
        self.task, self.template = task, template
        self.setup_s = 0.0

    def prepare(self) -> None:
        pass

    def acquire(self, i: int) -> tuple[Workspace, Shell]:
        from ..rl.workspaces import with_rollout_shell

        return with_rollout_shell(self.template.fork(1)[0], self.task.workdir)

    def close(self) -> None:
        pass


class WorkspaceHost:
    """The workspaces, templates and prefix cache of one node (run as a Ray actor: see
    :func:`start_hosts`). Ids are strings; results are Bunshin's own objects (``Result``,
    ``GroupTrajectory``), pickled by Ray.

    ``lease_s``: seconds an owner's workspaces outlive its last lease renewal. ``cache_budget``:
    bytes of live states the node's :class:`~bunshin.PrefixCache` keeps. ``snapshot_after``: the
    cache keeps the state after calls that took at least this many seconds. ``threads``: the
    pool blocking workspace calls run on.
    """

    def __init__(self, *, lease_s: float = 30.0, cache_budget: int = 4 << 30, snapshot_after: float = 0.05,
                 threads: int = 64) -> None:
        import ray

        from ..cache.prefix import PrefixCache

        if not lease_s > 0:
            raise ClusterError(f"lease_s must be > 0 seconds, got {lease_s!r}")
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.lease_s = float(lease_s)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="bunshin-host")
        # named by this process, so that a host started after this one was killed removes it
        self._dir = Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-"))
        self.cache = PrefixCache(self._dir / "cache.lmdb", memory_budget=cache_budget, snapshot=snapshot_after)
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._shells: dict[str, Shell] = {}
        self._leases: dict[str, float] = {}
        self._tasks: dict[str, _TaskState] = {}
        self._task_locks: dict[str, asyncio.Lock] = {}
        self._running = 0
        self._counts = {"groups": 0, "rollouts": 0, "setups": 0, "setup_failures": 0, "reclaimed": 0,
                        "template_hits": 0, "collected": 0,
                        "imports": 0}
        self._closed = False
        collect_dead_owners()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="bunshin-lease-reaper", daemon=True)
        self._reaper.start()

    # -- plumbing -----------------------------------------------------------------------
    async def _call(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        if self._closed:
            raise ClusterError(f"the workspace host of node {self.node_id} is shut down")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kw))

    def _get(self, oid: str) -> Any:
        with self._lock:
            h = self._held.get(oid)
        if h is None:
            raise UnknownWorkspace(f"no workspace or template {oid!r} on the host of node {self.node_id}: "
                                   "closed, or reclaimed after its owner's lease ran out")
        return h.obj

    def _keep(self, obj: Any, owner: str | None) -> str:
        with self._lock:
            self._held[obj.id] = _Held(obj, owner, time.monotonic())
            if owner is not None:
                self._leases[owner] = time.monotonic() + self.lease_s
        return obj.id

    # -- leases -------------------------------------------------------------------------
    async def renew(self, owner: str) -> float:
        """Extend ``owner``'s lease; returns the lease length (seconds)."""
        with self._lock:
            self._leases[owner] = time.monotonic() + self.lease_s
        return self.lease_s

    async def release(self, owner: str) -> int:
        """Close everything ``owner`` holds here now; returns how many objects."""
        return await self._call(self._reclaim, owner)

    def _reclaim(self, owner: str, *, lapsed: bool = False) -> int:
        with self._lock:
            self._leases.pop(owner, None)
            mine = sorted(((k, h) for k, h in self._held.items() if h.owner == owner), key=lambda kh: -kh[1].made)
            for k, _h in mine:
                self._forget(k)
            if lapsed:  # counted as they leave the table, which info() reads
                self._counts["reclaimed"] += len(mine)
        for _k, h in mine:  # newest first: forks before their sources
            try:
                h.obj.close()
            except Exception as e:  # noqa: BLE001 - one bad close must not keep the others
                log.warning("closing %s of dead owner %s: %s", h.obj.id, owner, e)
        return len(mine)

    def _reap_loop(self) -> None:
        period = min(1.0, self.lease_s / 4)
        last_collect = time.monotonic()
        while not self._stop.wait(period):
            now = time.monotonic()
            if now - last_collect > COLLECT_EVERY_S:
                last_collect = now
                self._counts["collected"] += len(collect_dead_owners())
            with self._lock:
                dead = [o for o, until in self._leases.items() if until < now]
            for owner in dead:
                n = self._reclaim(owner, lapsed=True)
                if n:
                    log.warning("host %s: owner %s stopped renewing its lease; closed its %d workspaces/templates",
                                self.node_id, owner, n)

    # -- workspaces ---------------------------------------------------------------------
    async def create(self, owner: str, rootfs: Any = None, **kw: Any) -> str:
        """A new workspace (``Workspace.create(rootfs, **kw)``) held for ``owner``; its id."""
        from ..runtime.workspace import Workspace

        ws = await self._call(Workspace.create, rootfs, **kw)
        return self._keep(ws, owner)

    async def run(self, ws_id: str, cmd: str, **kw: Any) -> Result:
        return await self._call(self._get(ws_id).run, cmd, **kw)

    async def exec(self, ws_id: str, argv: list[str], **kw: Any) -> Result:
        return await self._call(self._get(ws_id).exec, argv, **kw)

    async def read_file(self, ws_id: str, path: str, **kw: Any) -> bytes:
        return await self._call(self._get(ws_id).read_file, path, **kw)

    async def write_file(self, ws_id: str, path: str, data: bytes | str, **kw: Any) -> None:
        await self._call(self._get(ws_id).write_file, path, data, **kw)

    async def shell(self, ws_id: str, **kw: Any) -> str:
        """A new shell session in the workspace (``Workspace.shell``); its id."""
        sh = await self._call(self._get(ws_id).shell, **kw)
        sid = f"{ws_id}/{sh.id}"
        with self._lock:
            self._shells[sid] = sh
        return sid

    async def shell_run(self, shell_id: str, cmd: str, **kw: Any) -> Result:
        with self._lock:
            sh = self._shells.get(shell_id)
        if sh is None:
            raise UnknownWorkspace(f"no shell {shell_id!r} on the host of node {self.node_id}")
        return await self._call(sh.run, cmd, **kw)

    async def shell_close(self, shell_id: str) -> None:
        with self._lock:
            sh = self._shells.pop(shell_id, None)
        if sh is not None:
            await self._call(sh.close)

    async def fork(self, oid: str, n: int, owner: str) -> list[str]:
        """``n`` forks of workspace or template ``oid``, held for ``owner``; their ids."""
        kids = await self._call(self._get(oid).fork, n)
        return [self._keep(k, owner) for k in kids]

    async def snapshot(self, ws_id: str, owner: str) -> str:
        """A template of workspace ``ws_id``'s current state, held for ``owner``; its id."""
        tpl = await self._call(self._get(ws_id).snapshot)
        return self._keep(tpl, owner)

    async def close(self, oid: str) -> None:
        """Close a workspace or template (nothing if it is already gone)."""
        with self._lock:
            h = self._forget(oid)
        if h is not None:
            await self._call(h.obj.close)

    def _forget(self, oid: str) -> _Held | None:
        """Drop object ``oid`` and its shells from the tables (the caller holds the lock)."""
        for sid in [s for s in self._shells if s.startswith(oid + "/")]:
            del self._shells[sid]
        return self._held.pop(oid, None)

    # -- what placement needs --------------------------------------------------------------
    async def info(self) -> dict[str, Any]:
        """This host's node id, free memory (bytes), rollouts running, the tasks whose set-up
        template it holds (with their setup seconds) and the deepest cached prefix per task."""
        with self._lock:
            held = list(self._held.values())
            tasks = {t: {"setup_s": s.setup_s, "pulled_from": s.pulled_from,
                         "rollout_s": s.rollout_s / s.rollouts if s.rollouts else None}
                     for t, s in self._tasks.items()}
        return {"node_id": self.node_id, "pid": os.getpid(), "free_memory": free_memory(),
                "running": self._running,
                "workspaces": sum(1 for h in held if not hasattr(h.obj, "core")),
                "templates": sum(1 for h in held if hasattr(h.obj, "core")),
                "tasks": tasks, "prefix_depth": await self._call(self._prefix_depths),
                "cache": dataclasses.asdict(self.cache.stats), **self._counts}

    def _prefix_depths(self) -> dict[str, int]:
        """Per task this host ran, the depth (tool calls) of its deepest live cached state."""
        from ..cache.toolcall import root_key

        with self._lock:
            roots = {root_key(t): t for t in self._tasks}
        out: dict[str, int] = {}
        for key in self.cache.live_states():
            depth, k = 0, key
            while depth < 10_000:
                rec = self.cache.store.get(k)
                if rec is None or not rec.get("parent"):
                    break
                k, depth = bytes.fromhex(rec["parent"]), depth + 1
            task = roots.get(k)
            if task is not None:
                out[task] = max(out.get(task, 0), depth)
        return out

    # -- group rollouts ---------------------------------------------------------------------
    async def _task_state(self, task: Task) -> _TaskState:
        """The task's set-up template on this host, built on first use (setup once per host)."""
        from ..rl.workspaces import set_up_template, setup_key

        lock = self._task_locks.setdefault(task.id, asyncio.Lock())
        async with lock:
            st = self._tasks.get(task.id)
            if st is not None:
                if setup_key(st.task) != setup_key(task):
                    raise ClusterError(f"task id {task.id!r} was set up on the host of node {self.node_id} "
                                       "from another definition; give each task definition its own id")
                self._counts["template_hits"] += 1
                return st

            def setup() -> _TaskState:
                t = time.monotonic()
                return _TaskState(task, set_up_template(task), time.monotonic() - t)

            try:
                st = await self._call(setup)
            except RolloutError as e:
                self._counts["setup_failures"] += 1
                raise TaskSetupError(f"node {self.node_id}: {e}") from None
            self._counts["setups"] += 1
            with self._lock:
                self._tasks[task.id] = st
            return st

    async def run_group(self, task: Task, policy: Policy, group_size: int, *, indices: list[int] | None = None,
                        mode: str = "bunshin", group: int = 0,
                        engine: Mapping[str, Any] | None = None) -> AsyncIterator[GroupTrajectory]:
        """Run rollouts ``indices`` (default: all) of group ``group`` of ``task`` with
        ``policy``, yielding each :class:`GroupTrajectory` as it ends (a Ray streaming
        generator). In ``fork``/``bunshin`` mode rollouts fork the host's template of the task
        (set up on first use, kept for later groups); in ``bunshin`` mode they share the
        node's prefix cache. ``engine``: more :class:`~bunshin.rl.RolloutEngine` options.
        A failing setup raises :class:`TaskSetupError`."""
        from ..rl.engine import RolloutEngine

        kw = dict(engine or {})
        kw.setdefault("sample_interval", None)
        st = None
        if mode in ("fork", "bunshin"):
            st = await self._task_state(task)
            kw["workspaces"] = HeldTemplate(task, st.template)
            if mode == "bunshin":
                kw.setdefault("cache", self.cache)
        done: asyncio.Queue[Trajectory] = asyncio.Queue()
        eng = RolloutEngine(policy, task, group_size, mode, indices=indices, on_rollout=done.put_nowait,
                            group=group, **kw)
        left = len(eng.indices)
        self._counts["groups"] += 1
        self._running += left
        run = asyncio.ensure_future(eng.arun())
        try:
            while left:
                if done.empty():
                    if run.done():
                        raise _setup_error(run.exception(), self.node_id)
                    get = asyncio.ensure_future(done.get())
                    await asyncio.wait({get, run}, return_when=asyncio.FIRST_COMPLETED)
                    if not get.done():
                        get.cancel()
                        continue  # the engine ended: what it finished is in the queue
                    t = get.result()
                else:
                    t = done.get_nowait()
                left -= 1
                self._running -= 1
                self._counts["rollouts"] += 1
                if st is not None:
                    st.rollout_s += t.latency_s
                    st.rollouts += 1
                yield GroupTrajectory(**{**{f.name: getattr(t, f.name) for f in dataclasses.fields(Trajectory)},
                                         "group": group, "node": self.node_id})
            await run
        finally:
            self._running -= left
            if not run.done():
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)

    # -- templates that travel -------------------------------------------------------------
    async def export_task(self, task_id: str) -> AsyncIterator[bytes]:
        """This host's template of task ``task_id`` as a :func:`bunshin.criu.pack` stream of its
        saved image, without its rootfs layers (a Ray streaming generator of chunks of at most
        1 MiB), for :meth:`import_task` on another node, which asks :meth:`export_layer` for the
        layers it lacks."""
        from ..criu.transfer import pack

        st = self._tasks.get(task_id)
        if st is None:
            raise ClusterError(f"the host of node {self.node_id} holds no template of task {task_id!r}")
        d = Path(tempfile.mkdtemp(prefix="export-", dir=self._dir))
        try:
            await self._call(st.template.save, d / "image")
            async for chunk in self._drain(pack(d / "image")):
                yield chunk
        finally:
            shutil.rmtree(d, ignore_errors=True)

    async def export_layer(self, digest: str) -> AsyncIterator[bytes]:
        """The rootfs layer ``digest`` of this node's store as a tar stream
        (:func:`bunshin.criu.layer_chunks`; a Ray streaming generator of chunks of at most 1 MiB)."""
        from ..criu.transfer import layer_chunks

        async for chunk in self._drain(await self._call(layer_chunks, digest)):
            yield chunk

    async def _drain(self, chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
        """``chunks``, each read on the pool (tar and CRIU block)."""
        end = object()
        try:
            while (b := await self._call(next, chunks, end)) is not end:
                yield b
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                await self._call(close)

    async def import_task(self, task: Task, source: Any) -> dict[str, Any]:
        """Make ``task``'s template here from the one ``source`` (another host's actor handle)
        holds, instead of running the setup: its image streamed over (:meth:`export_task`,
        unpacked with :func:`bunshin.criu.unpack`), the rootfs layers this node's store lacks
        fetched from ``source`` (:meth:`export_layer`, digest-checked by
        :func:`bunshin.criu.receive_layer`), then ``Template.load``. Returns what it moved:
        ``seconds`` (all of it), ``image_bytes``/``image_s``, ``layers`` {digest: bytes},
        ``layer_bytes``/``layer_s``, ``load_s`` (all 0 if this host holds the template already)."""
        from ..criu.transfer import missing_layers, receive_layer, unpack
        from ..runtime.template import Template

        lock = self._task_locks.setdefault(task.id, asyncio.Lock())
        async with lock:
            moved: dict[str, Any] = {"seconds": 0.0, "image_bytes": 0, "image_s": 0.0, "layers": {},
                                     "layer_bytes": 0, "layer_s": 0.0, "load_s": 0.0}
            if task.id in self._tasks:
                return moved
            t0 = time.monotonic()
            src = await source.info.remote()
            where = f"the host of node {src['node_id']}"
            loop = asyncio.get_running_loop()
            d = Path(tempfile.mkdtemp(prefix="import-", dir=self._dir))
            got: _Received | None = None
            try:
                t = time.monotonic()
                got = _Received(source.export_task.options(_generator_backpressure_num_objects=STREAM_AHEAD)
                                .remote(task.id), loop)
                await self._call(unpack, got, d / "image")
                moved["image_bytes"], moved["image_s"] = got.bytes, time.monotonic() - t
                t = time.monotonic()
                for digest in await self._call(missing_layers, d / "image"):
                    got = _Received(source.export_layer.options(_generator_backpressure_num_objects=STREAM_AHEAD)
                                    .remote(digest), loop)
                    await self._call(receive_layer, digest, got, where)
                    moved["layers"][digest] = got.bytes
                moved["layer_bytes"], moved["layer_s"] = sum(moved["layers"].values()), time.monotonic() - t
                t = time.monotonic()
                tpl = await self._call(Template.load, d / "image")
                moved["load_s"] = time.monotonic() - t
            except BaseException:
                if got is not None:  # else the sender stays suspended mid-stream, holding its export
                    got.cancel()
                raise
            finally:
                shutil.rmtree(d, ignore_errors=True)
            with self._lock:
                self._tasks[task.id] = _TaskState(task, tpl, src["tasks"][task.id]["setup_s"],
                                                  pulled_from=src["node_id"])
            self._counts["imports"] += 1
            moved["seconds"] = time.monotonic() - t0
            return moved

    # -- end ----------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Close every workspace, template and cached state of this host (the actor may then
        be killed)."""
        if self._closed:
            return
        self._stop.set()
        await self._call(self._close_all)
        self._closed = True
        self._pool.shutdown(wait=False)

    def _close_all(self) -> None:
        with self._lock:
            held = sorted(self._held.values(), key=lambda h: -h.made)
            self._held.clear()
            self._shells.clear()
            self._leases.clear()
            tasks = list(self._tasks.values())
            self._tasks.clear()
        for h in held:
            try:
                h.obj.close()
            except Exception as e:  # noqa: BLE001 - close the rest
                log.warning("closing %s: %s", h.obj.id, e)
        self.cache.close()
        for st in tasks:
            st.template.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        collect_dead_owners(passes=5)


class _Received:
    """A Ray streaming generator of byte chunks read from a pool thread (what ``unpack`` and
    ``receive_layer`` take), counting the bytes; the actor's event loop awaits each chunk."""

    def __init__(self, gen: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._gen, self._loop = gen, loop
        self.bytes = 0

    def __iter__(self) -> Iterator[bytes]:
        async def next_chunk() -> bytes | None:
            try:
                ref = await self._gen.__anext__()
            except StopAsyncIteration:
                return None
            return await ref

        while True:
            fut = asyncio.run_coroutine_threadsafe(next_chunk(), self._loop)
            try:
                b = fut.result(timeout=CHUNK_WAIT_S)
            except concurrent.futures.TimeoutError:
                fut.cancel()
                raise ClusterError(f"no chunk from the sender in {CHUNK_WAIT_S:g} s") from None
            if b is None:
                return
            self.bytes += len(b)
            yield b

    def cancel(self) -> None:
        """Stop the sender's generator (it may be past its last chunk already)."""
        import ray

        with contextlib.suppress(Exception):
            ray.cancel(self._gen)


_DIR_PREFIX = "bunshin-host-"


def _remove_dead_hosts_dirs() -> list[str]:
    """The private directories (prefix cache, transfers) of this machine's killed hosts."""
    removed = []
    for d in Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*-*"):
        pid = d.name[len(_DIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed


def collect_dead_owners(passes: int = 1) -> list[str]:
    """Remove what dead trainers of this machine left (``bunshin gc`` for each dead owner,
    never the state file system or the shared freezer group, which live hosts use). A host
    needs it: when a Ray worker dies, Ray kills its child processes, the owner watcher
    (runtime/owner_watch.py) among them, so a killed host's workspaces wait for the next host
    of the machine (at its start, every ``COLLECT_EVERY_S``, at shutdown)."""
    from ..runtime import gc, statedir

    removed = _remove_dead_hosts_dirs()
    for attempt in range(passes):  # a frozen process dies only once its cgroup thaws: look again
        owners = {(m.owner_pid, m.owner_start) for d in statedir.all_dirs()
                  if (m := d.read_meta()) is not None and not statedir.owner_alive(m)}
        if not owners:
            break
        if attempt:
            time.sleep(0.1 * attempt)
        for owner in sorted(owners):
            try:
                removed += gc.collect(owner=owner)
            except Exception as e:  # noqa: BLE001 - the next pass tries again
                log.warning("collecting what trainer %d left: %s", owner[0], e)
    if removed:
        log.warning("removed what dead trainers left: %s", ", ".join(removed))
    return removed


def _setup_error(e: BaseException | None, node: str) -> BaseException:
    """Why the engine ended before its last rollout; a setup failure as :class:`TaskSetupError`
    (fresh and criu modes set up inside the engine)."""
    if e is None:
        return ClusterError(f"node {node}: the rollout engine ended before every rollout did")
    if isinstance(e, RolloutError) and not isinstance(e, TaskSetupError) and "setup" in str(e):
        return TaskSetupError(f"node {node}: {e}")
    return e


def start_hosts(*, resource: str | None = DEFAULT_RESOURCE, detached: bool = False,
                env: Mapping[str, str] | Callable[[str], Mapping[str, str]] | None = None,
                **host_kw: Any) -> dict[str, Any]:
    """A :class:`WorkspaceHost` actor on every alive node that offers ``resource`` (None: every
    alive node), made once per node and found again by name after; ``{node id: actor handle}``.
    ``detached``: the hosts outlive the job that made them (else they end with it, and with them
    their workspaces). ``env``: environment variables of the hosts (Ray ``runtime_env``
    ``env_vars``), or a callable giving each node's from its node id, e.g. a
    ``BUNSHIN_STATE_DIR`` and ``BUNSHIN_CACHE_DIR`` per node, so that nodes sharing a machine
    share no rootfs layers. ``host_kw``: :class:`WorkspaceHost` options. Both are used when a
    host is made, not when an existing one is found: give the same every time."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        raise ClusterError("Ray is not initialized: call ray.init(address=...) first")
    actor = ray.remote(WorkspaceHost)
    out: dict[str, Any] = {}
    for n in ray.nodes():
        if not n.get("Alive") or (resource is not None and n.get("Resources", {}).get(resource, 0) <= 0):
            continue
        node = n["NodeID"]
        node_env = env(node) if callable(env) else env
        out[node] = actor.options(
            name=host_name(node), namespace=HOST_NAMESPACE, get_if_exists=True, num_cpus=0,
            resources={resource: RESOURCE_SHARE} if resource is not None else {},
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False), max_concurrency=1000,
            lifetime="detached" if detached else None,
            runtime_env={"env_vars": dict(node_env)} if node_env else None,
        ).remote(**host_kw)
    if not out:
        raise ClusterError(f"no alive Ray node offers the resource {resource!r}; start nodes with "
                           f"`ray start --resources '{{\"{resource}\": 1}}'` or pass resource=None")
    return out
