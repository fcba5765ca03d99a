"""Bunshin on a Ray cluster: one workspace host per node, group rollouts placed where the
state lives, nothing lost when a node dies.

>>> import ray, bunshin.cluster as bc                                      # doctest: +SKIP
>>> ray.init(address="auto")                                               # doctest: +SKIP
>>> hosts = bc.start_hosts()           # {node id: WorkspaceHost actor}    # doctest: +SKIP
>>> res = bc.ClusterEngine(policy, tasks, group_size=8, groups=2).run()   # doctest: +SKIP
>>> res.groups[("task-1", 0)].trajectories, res.metrics["hits"]           # doctest: +SKIP
>>> for t in bc.ClusterEngine(policy, tasks, 8).stream(): ...              # doctest: +SKIP
>>> with bc.RemoteWorkspace.create(node=node_id) as ws:                    # doctest: +SKIP
...     ws.run("make"); kids = ws.fork(4)

API (names are stable):

* ``start_hosts(*, resource="bunshin", detached=False, env=None, **host_kw) -> {node_id: ActorHandle}``:
  a :class:`WorkspaceHost` actor on every alive node offering the custom resource (``ray start
  --resources '{"bunshin": 1}'``; ``resource=None``: every node), named ``host_name(node_id)``
  in Ray namespace ``"bunshin"``, pinned with ``NodeAffinitySchedulingStrategy(soft=False)``,
  ``num_cpus=0``, 0.001 of the resource, an asyncio actor (``max_concurrency=1000``).
  ``env``: the hosts' environment variables ({name: value}, or a callable node id -> {name:
  value}; e.g. a ``BUNSHIN_STATE_DIR``/``BUNSHIN_CACHE_DIR`` per node). ``host_kw``:
  ``lease_s=30``, ``cache_budget=4 GiB``, ``snapshot_after=0.05``, ``threads=64``.
* ``WorkspaceHost`` methods (all ``.remote``): ``create(owner, rootfs=None, **kw) -> id``,
  ``run(id, cmd, **kw) -> Result``, ``exec(id, argv, **kw)``, ``read_file(id, path)``,
  ``write_file(id, path, data)``, ``shell(id, env=, cwd=) -> shell id``, ``shell_run(shell id,
  cmd)``, ``shell_close(shell id)``, ``fork(id, n, owner) -> [id]`` (of a workspace or a
  template), ``snapshot(id, owner) -> template id``, ``close(id)``, ``renew(owner) -> lease_s``,
  ``release(owner)``, ``info() -> dict`` (``node_id``, ``pid``, ``free_memory``, ``running``,
  ``workspaces`` and ``templates`` held for users, ``tasks``: {task id:
  {"setup_s", "rollout_s", "pulled_from"}} whose set-up template it holds,
  ``prefix_depth``: {task id: depth of the deepest live cached state}, ``cache``, counters
  ``groups``/``rollouts``/``setups``/``setup_failures``/``reclaimed``/``template_hits``/
  ``imports``/``collected``), ``run_group(task, policy, group_size, *,
  indices=None, mode="bunshin", group=0, engine=None)`` (a Ray streaming generator of
  :class:`GroupTrajectory`; fork/bunshin modes fork the host's template of the task, kept across
  groups; bunshin mode shares the node's ``PrefixCache``), ``export_task(task_id)`` (a streaming
  generator of the task template's saved image, a ``bunshin.criu.pack`` stream without its
  rootfs layers, chunks of ≤ 1 MiB), ``export_layer(digest)`` (a streaming generator of a rootfs
  layer of the node's store, ``bunshin.criu.layer_chunks``), ``import_task(task, source_host)
  -> {seconds, image_bytes, image_s, layers: {digest: bytes}, layer_bytes, layer_s, load_s}``
  (load another host's template of the task instead of a setup: the image, then the layers
  this node lacks, digest-checked), ``shutdown()``.
* ``RemoteWorkspace.create(rootfs=None, *, host=None, node=None, **kw)``; ``.run``, ``.exec``,
  ``.shell() -> RemoteShell`` (``.run``, ``.close``), ``.read_file``, ``.write_file``,
  ``.fork(n) -> [RemoteWorkspace]``, ``.snapshot() -> RemoteTemplate`` (``.fork(n)``,
  ``.close()``), ``.close()``, context manager. Picklable; the creating process owns what it
  makes and renews a lease (:mod:`.lease`); the host closes an owner's objects ``lease_s`` after
  its last renewal. ``find_host(node_id=None)``.
* ``ClusterEngine(policy | {task id: policy}, tasks, group_size, *, groups=1, mode="bunshin",
  hosts=None, per_node=16, travel=True, engine=None)``: ``.run() -> ClusterResult`` (``groups``: {(task id,
  group): ClusterGroup(trajectories by index, error, nodes)}, ``metrics``, ``trajectories``,
  ``errors``), ``.arun()``, ``.stream()`` / ``.astream()`` yielding each
  :class:`GroupTrajectory` (a ``Trajectory`` plus ``node`` and ``key``) as it ends.
  ``.metrics``: ``placements`` [{task, group, node, why, indices}], ``hits`` {template, prefix,
  load, pulled, setup}, ``decisions`` {waited, pulled, setup} (a busy holder: wait, set the task
  up elsewhere, or pull its template, whichever costs least), ``pulls`` [{task, group, from, to,
  seconds, image_bytes, image_s, layers, layer_bytes, layer_s, load_s}], ``transfers`` (pulls
  made), ``transfer_s``, ``transfer_bytes``, ``pull_failures``, ``hosts_lost``, ``reruns``,
  ``duplicates``, ``completed``, ``lost``, ``failed_groups``, ``group_errors`` [{task, group,
  node, error}] (what failed each of them), ``per_node`` {node: rollouts}, ``seconds``.
* Errors: ``ClusterError`` ⊃ ``TaskSetupError`` (also a ``RolloutError``), ``HostLost``,
  ``UnknownWorkspace``.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import ClusterError, HostLost, TaskSetupError, UnknownWorkspace
from .types import ClusterGroup, ClusterResult, GroupTrajectory

_LAZY = {
    "ClusterEngine": "bunshin.cluster.engine",
    "WorkspaceHost": "bunshin.cluster.host",
    "start_hosts": "bunshin.cluster.host",
    "host_name": "bunshin.cluster.host",
    "RemoteWorkspace": "bunshin.cluster.proxy",
    "RemoteTemplate": "bunshin.cluster.proxy",
    "RemoteShell": "bunshin.cluster.proxy",
    "find_host": "bunshin.cluster.proxy",
}

__all__ = ["ClusterEngine", "ClusterError", "ClusterGroup", "ClusterResult", "GroupTrajectory", "HostLost",
           "RemoteShell", "RemoteTemplate", "RemoteWorkspace", "TaskSetupError", "UnknownWorkspace",
           "WorkspaceHost", "find_host", "host_name", "start_hosts"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'bunshin.cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
