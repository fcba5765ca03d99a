"""Bunshin on a real 3-node Ray cluster on this machine (ray.cluster_utils.Cluster, one raylet
per node, each offering the ``bunshin`` resource, each host with a state and cache directory of
its own, so nodes share no rootfs layer): groups land where their task's template is, every
rollout comes back once, results stream, templates travel with the layers the other node lacks,
a host killed mid-group loses and duplicates nothing, proxies work from other processes, a dead
owner's workspaces are reclaimed, a failing setup fails only its group, and nothing is left
behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from conftest import wait_no_leaks  # noqa: E402

from bunshin.cluster import (  # noqa: E402
    ClusterEngine,
    HostLost,
    RemoteWorkspace,
    TaskSetupError,
    UnknownWorkspace,
    start_hosts,
)
from bunshin.cluster.host import collect_dead_owners  # noqa: E402
from bunshin.rl import ReplayPolicy, RolloutError, Task  # noqa: E402

pytestmark = pytest.mark.slow

LEASE_S = 1.5
NODES = 3
NODE_ROOT = Path(tempfile.gettempdir()) / "nodes"
"""Each node's state and cache directories (under /tmp, which a host-rootfs workspace's view
hides, so host-rootfs templates load on every node)."""


def node_env(node: str) -> dict[str, str]:
    """The node's own Bunshin directories: no layer store or layer cache shared with another node."""
    from bunshin.criu_locate import find_criu

    d = NODE_ROOT / node[:12]
    env = {"BUNSHIN_STATE_DIR": str(d / "state"), "BUNSHIN_CACHE_DIR": str(d / "cache")}
    criu = find_criu(check=False)  # the private CRIU lives in the default cache directory
    if criu is not None:
        env["BUNSHIN_CRIU"] = criu.path
    return env


@contextlib.contextmanager
def node_dirs(d: Path) -> Iterator[None]:
    """This process works in node directory ``d``'s state and cache directories meanwhile."""
    saved = {k: os.environ.get(k) for k in ("BUNSHIN_STATE_DIR", "BUNSHIN_CACHE_DIR")}
    os.environ.update(BUNSHIN_STATE_DIR=str(d / "state"), BUNSHIN_CACHE_DIR=str(d / "cache"))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start(**kw):
    return start_hosts(lease_s=LEASE_S, env=node_env, **kw)


def store_of(node: str) -> Path:
    """The node's layer store."""
    return Path(node_env(node)["BUNSHIN_STATE_DIR"]) / "layers"


def task(name: str, **kw) -> Task:
    return Task(name, "leave your number in /repo/mine", workdir="/repo",
                setup=(f"echo {name} > /repo/base", "export STAGE=set-up"), **kw)


def numbered(n: int) -> ReplayPolicy:
    """Rollout i checks the set-up state and its own isolation, and leaves its number."""
    return ReplayPolicy([[f"cat base; echo $STAGE; test ! -e mine && echo {i} > mine; cat mine"]
                         for i in range(n)])


def check(t, name: str) -> None:
    """The rollout saw its task's set-up state (file and shell) and only its own writes."""
    assert t.error is None, t.error
    assert [turn.observation for turn in t.turns] == [f"{name}\nset-up\n{t.index}\n"], t


def answering(hosts: dict) -> dict:
    """``{host: its info()}`` of the hosts that answer (a removed node's may still be listed)."""
    out = {}
    for h in hosts.values():
        try:
            out[h] = ray.get(h.info.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
    return out


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"bunshin": 1},
                                                      "include_dashboard": False,
                                                      # not Ray's default port: another local cluster may hold it
                                                      "dashboard_agent_listen_port": None})
    for _ in range(NODES - 1):
        c.add_node(num_cpus=1, resources={"bunshin": 1})
    ray.init(address=c.address, logging_level="warning")
    # the Ray tasks and actors below are defined here, in a module Ray's workers cannot import
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        c.wait_for_nodes()
        yield c
        for h in answering(start()):
            ray.get(h.shutdown.remote())
            ray.kill(h)
    finally:
        ray.shutdown()
        c.shutdown()
    from bunshin.runtime import statefs

    # a host whose node was removed may outlive the other hosts' last pass over what dead
    # trainers left (its worker ends when it sees its raylet gone): the pass a new host of
    # that node would make, in each node's directories
    nodes = sorted(NODE_ROOT.iterdir()) if NODE_ROOT.exists() else []
    for d in nodes:  # every node's first: the cgroup prefix, which the check reads, is the machine's
        with node_dirs(d):
            collect_dead_owners(passes=5)
    for d in nodes:
        with node_dirs(d):
            found = wait_no_leaks(30)
            assert not found, f"the cluster left on node {d.name}: {found}"
            statefs.release()
            assert not os.path.ismount(d / "state"), f"node {d.name}'s state file system is still mounted"
    collect_dead_owners(passes=5)
    found = wait_no_leaks(30)
    assert not found, f"the cluster left: {found}"
    # killed hosts' private directories too (a killed host cannot remove its own)
    dirs = [d.name for d in Path(tempfile.gettempdir()).glob("bunshin-host-*")]
    assert not dirs, f"hosts left their directories: {dirs}"


@pytest.fixture(scope="module")
def hosts(cluster):
    hs = start()
    assert len(hs) == NODES
    return hs


@pytest.fixture
def idle(hosts):
    """The hosts (one made again where an earlier test killed one); after the test, no host
    holds a workspace or template of a user, or runs a rollout."""
    yield start()
    live = start()
    deadline = time.monotonic() + 15
    while True:
        infos = list(answering(live).values())
        busy = [(i["node_id"], i["workspaces"], i["templates"], i["running"]) for i in infos
                if i["workspaces"] or i["templates"] or i["running"]]
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not busy, f"hosts still hold (node, workspaces, templates, running): {busy}"


def test_groups_land_where_their_template_is_and_every_rollout_completes_once(idle):
    tasks = [task("place-a"), task("place-b")]
    eng = ClusterEngine(numbered(4), tasks, 4, groups=2, per_node=4, hosts=idle)
    res = eng.run()
    assert not res.errors
    assert sorted(t.key for t in res.trajectories) == sorted(
        (t.id, g, i) for t in tasks for g in range(2) for i in range(4))
    for t in res.trajectories:
        check(t, t.task_id)
    first = {}
    for p in res.metrics["placements"]:
        if p["group"] == 0:
            first[p["task"]] = p["node"]
            assert p["why"] == "load"
        else:  # the holder was busy with group 0: group 1 waited for it rather than set up again
            assert (p["node"], p["why"]) == (first[p["task"]], "template"), res.metrics["placements"]
    assert first["place-a"] != first["place-b"]  # the least loaded node took the second task
    assert res.metrics["lost"] == 0 and res.metrics["duplicates"] == 0 and res.metrics["completed"] == 16
    for node in {t.node for t in res.trajectories}:  # never more than per_node at once on a node
        spans = [(t.start_s, t.end_s) for t in res.trajectories if t.node == node]
        assert max(sum(a <= s < b for a, b in spans) for s, _ in spans) <= 4

    # a later call finds the template where the first left it, set up once there
    again = ClusterEngine(numbered(2), [tasks[0]], 2, hosts=idle).run()
    assert [p["node"] for p in again.metrics["placements"]] == [first["place-a"]]
    assert again.metrics["hits"]["template"] == 1
    for t in again.trajectories:
        check(t, "place-a")
    info = ray.get(idle[first["place-a"]].info.remote())
    assert info["setups"] >= 1 and "place-a" in info["tasks"]


def test_results_stream_as_rollouts_end(idle):
    t = task("stream")
    # rollout i takes about i seconds: the first comes back long before the group ends
    pol = ReplayPolicy([[f"sleep {i}; echo {i}"] for i in range(3)])
    arrived = []
    for traj in ClusterEngine(pol, [t], 3, hosts=idle).stream():
        arrived.append((traj.index, time.monotonic()))
    assert [i for i, _ in arrived] == [0, 1, 2]
    assert arrived[-1][1] - arrived[0][1] > 1.5
    node = traj.node  # the calls that took a second or more left cached states one call deep
    assert ray.get(idle[node].info.remote())["prefix_depth"]["stream"] == 1

    async def collect():
        return [traj.key async for traj in ClusterEngine(numbered(2), [t], 2, hosts=idle).astream()]

    assert sorted(asyncio.run(collect())) == [("stream", 0, 0), ("stream", 0, 1)]


def test_leaving_the_stream_early_stops_the_rollouts(idle):
    pol = ReplayPolicy([["echo quick"]] + [["sleep 60"]] * 3)
    stream = ClusterEngine(pol, [task("leave")], 4, hosts=idle).stream()
    first = next(stream)
    assert first.index == 0
    stream.close()  # the idle fixture checks that no host still runs a rollout


def test_a_task_with_a_python_verifier_sets_up_once_on_its_host(idle):
    from bunshin.rl import Verifier

    # Ray pickles the lambda by value for each call: every group brings a new, unequal verifier
    t = task("lambda-verifier", verifier=Verifier(lambda ws, traj: True))
    res = ClusterEngine(numbered(2), [t], 2, groups=2, hosts=idle).run()
    assert not res.errors, res.errors
    assert len({p["node"] for p in res.metrics["placements"]}) == 1, res.metrics["placements"]
    for traj in res.trajectories:
        check(traj, "lambda-verifier")
        assert traj.reward == 1.0, traj.verdict
    assert ray.get(idle[res.trajectories[0].node].info.remote())["setups"] >= 1


def test_a_failing_setup_fails_its_group_only(idle):
    bad = Task("bad-setup", "never runs", setup=("echo half-way", "(exit 3)"))
    res = ClusterEngine(numbered(2), [bad, task("good")], 2, hosts=idle).run()
    assert list(res.errors) == [("bad-setup", 0)]
    assert res.errors[("bad-setup", 0)].startswith("TaskSetupError: ") and "exit code 3" in res.errors[("bad-setup", 0)]
    assert not res.groups[("bad-setup", 0)].trajectories
    assert res.groups[("good", 0)].complete
    assert issubclass(TaskSetupError, RolloutError)
    assert res.metrics["failed_groups"] == 1
    [err] = res.metrics["group_errors"]  # what a stream's consumer, who gets no result, reads
    assert (err["task"], err["group"], err["error"]) == ("bad-setup", 0, res.errors[("bad-setup", 0)])


def need_criu() -> None:
    from bunshin.criu_locate import find_criu

    if not (find_criu() and find_criu().usable):
        pytest.skip("no CRIU ≥ 4 on this machine: `bunshin criu provision`")


def busybox_tar(path: Path) -> Path:
    """A small rootfs archive (a layer of the cache once a host unpacks it) with a mark of its
    own: busybox's, and the host's bash with its libraries (a rollout's shell is bash)."""
    import re
    import shutil
    import subprocess

    from test_rootfs import busybox_root

    tb = busybox_root()
    for applet in ("mkdir", "sleep"):
        tb.symlink(f"bin/{applet}", "busybox")
    bash = shutil.which("bash")
    assert bash is not None
    libs = re.findall(r"(/\S+) \(0x", subprocess.run(["ldd", bash], capture_output=True, text=True).stdout)
    for f in ["/bin/bash", *libs]:
        tb.file(f, Path(os.path.realpath(f if f != "/bin/bash" else bash)).read_bytes(), mode=0o755)
    tb.file("etc/layer-mark", b"from the layer\n")
    return tb.write(path / "root.tar.gz", "gz")


def test_a_busy_holder_sends_its_template_and_the_layers_the_other_node_lacks(idle, tmp_path):
    need_criu()
    slow = Task("travel", "leave your number in /repo/mine", workdir="/repo", rootfs=str(busybox_tar(tmp_path)),
                setup=("echo travel > /repo/base", "export STAGE=set-up", "sleep 2"))
    pol = ReplayPolicy([[f"sleep 2; cat base; echo $STAGE; cat /etc/layer-mark; echo {i} > mine; cat mine"]
                        for i in range(2)])
    first = ClusterEngine(pol, [slow], 2, per_node=2, hosts=idle).run()
    assert not first.errors, first.errors
    holder = first.trajectories[0].node
    others = [n for n in idle if n != holder]
    for n in others:  # the rootfs layer is on the holder's node only
        assert not store_of(n).exists() or not any(store_of(n).iterdir()), n
    # the holder is full with group 0; group 1 would wait a rollout (~2 s) for it, or set the
    # task up again (~2 s): a pull (~1.5 s) is cheaper
    eng = ClusterEngine(pol, [slow], 2, groups=2, per_node=2, hosts=idle)
    res = eng.run()
    assert not res.errors, res.errors
    m = eng.metrics
    assert [(p["group"], p["why"]) for p in m["placements"]] == [(0, "template"), (1, "pulled")]
    (pull,) = m["pulls"]
    assert pull["from"] == holder and pull["to"] in others and m["transfers"] == 1
    # the image, then the one layer the other node lacked, fetched from the holder and checked
    [(digest, size)] = pull["layers"].items()
    assert size > 100_000 and pull["image_bytes"] > 0  # the layer holds busybox's binary
    assert m["transfer_bytes"] == pull["image_bytes"] + size
    assert 0 < pull["image_s"] + pull["layer_s"] + pull["load_s"] <= pull["seconds"]
    got = store_of(pull["to"]) / digest
    assert got.is_dir() and not got.is_symlink()  # received, not the holder's cache
    assert res.groups[("travel", 1)].nodes == [pull["to"]]
    for t in res.trajectories:
        assert t.turns[0].observation == f"travel\nset-up\nfrom the layer\n{t.index}\n"
    info = ray.get(idle[pull["to"]].info.remote())
    assert info["tasks"]["travel"]["pulled_from"] == holder and info["imports"] == 1


def test_a_host_rootfs_template_travels(idle):
    need_criu()
    t = task("travel-host")
    a, b = list(idle)[:2]
    ClusterEngine(numbered(1), [t], 1, hosts={a: idle[a]}).run()
    moved = ray.get(idle[b].import_task.remote(t, idle[a]))
    assert moved["layers"] == {} and moved["image_bytes"] > 0  # the host's system is not copied
    res = ClusterEngine(numbered(2), [t], 2, hosts={b: idle[b]}).run()
    assert res.metrics["hits"]["template"] == 1
    for traj in res.trajectories:
        assert traj.node == b
        check(traj, "travel-host")
    assert ray.get(idle[b].import_task.remote(t, idle[a]))["seconds"] == 0.0  # held already


class ByGroup(ReplayPolicy):
    """Answers with the group its history says (a policy seeded by group)."""

    async def act(self, history):
        return await ReplayPolicy([[f"echo group {history.group}"]]).act(history)


def test_the_policy_sees_the_group(idle):
    res = ClusterEngine(ByGroup([["true"]]), [task("groups")], 2, groups=2, hosts=idle).run()
    assert not res.errors
    for t in res.trajectories:
        assert t.group == t.key[1] and t.turns[0].observation == f"group {t.group}\n"


@ray.remote(num_cpus=0)
def use_elsewhere(ws: RemoteWorkspace) -> tuple[str, list[RemoteWorkspace]]:
    """In a Ray worker: read what the driver wrote, fork it there (the forks belong to this
    worker process) and write to the fork."""
    seen = ws.read_file("/note").decode()
    kid = ws.fork(1)[0]
    kid.write_file("/note", "from the kid\n")
    sh = kid.shell(cwd="/")
    assert sh.run("cd /tmp; export X=1").exit_code == 0
    assert sh.run("echo $PWD $X").output == "/tmp 1\n"
    sh.close()
    return seen, [kid]


def test_proxies_work_from_other_processes(idle):
    node = next(iter(idle))
    with RemoteWorkspace.create(node=node) as ws:
        ws.write_file("/note", "from the driver\n")
        seen, (kid,) = ray.get(use_elsewhere.remote(ws))
        assert seen == "from the driver\n"
        assert kid.read_file("/note") == b"from the kid\n"
        assert ws.read_file("/note") == b"from the driver\n"
        tpl = ws.snapshot()
        ws.run("echo later > /note")
        a, b = tpl.fork(2)
        assert a.read_file("/note") == b.read_file("/note") == b"from the driver\n"
        for w in (a, b, tpl, kid):
            w.close()
    with pytest.raises(UnknownWorkspace):
        ws.run("true")


@ray.remote(num_cpus=0)
class Owner:
    """A trainer process that makes workspaces on a host and then dies without closing them."""

    def make(self, host) -> list[RemoteWorkspace]:
        ws = RemoteWorkspace.create(host=host)
        ws.run("sleep 1000 &")
        return [ws, *ws.fork(1)]

    def template(self, ws: RemoteWorkspace):
        return ws.snapshot()

    def renew_also_on(self, hosts: list) -> None:
        from bunshin.cluster.lease import hold

        for h in hosts:
            hold(h, LEASE_S)


@ray.remote(num_cpus=0)
class Silent:
    """A host that never answers a lease renewal (its node hangs)."""

    async def renew(self, owner: str) -> float:
        await asyncio.sleep(3600)
        return LEASE_S


def test_a_dead_owners_workspaces_are_reclaimed(idle):
    host = next(iter(idle.values()))
    before = ray.get(host.info.remote())["reclaimed"]
    owner = Owner.remote()
    made = ray.get(owner.make.remote(host))
    tpl = ray.get(owner.template.remote(made[0]))
    time.sleep(2 * LEASE_S)  # the owner renews: nothing is reclaimed while it lives
    assert made[1].run("echo alive").output == "alive\n"
    ray.kill(owner)
    deadline = time.monotonic() + LEASE_S + 10
    while ray.get(host.info.remote())["workspaces"] and time.monotonic() < deadline:
        time.sleep(0.1)
    info = ray.get(host.info.remote())
    assert (info["workspaces"], info["templates"]) == (0, 0)
    assert info["reclaimed"] - before == 3
    with pytest.raises(UnknownWorkspace):
        tpl.fork(1)


def test_a_released_owners_shells_go_with_its_workspaces(idle):
    host = next(iter(idle.values()))
    ws = ray.get(host.create.remote("released-owner"))
    sid = ray.get(host.shell.remote(ws))
    assert ray.get(host.shell_run.remote(sid, "echo open")).output == "open\n"
    assert ray.get(host.release.remote("released-owner")) == 1
    with pytest.raises(UnknownWorkspace):
        ray.get(host.shell_run.remote(sid, "echo still-here"))


def test_hosts_that_do_not_answer_do_not_let_the_others_leases_lapse(idle):
    host = next(iter(idle.values()))
    before = ray.get(host.info.remote())["reclaimed"]
    owner = Owner.remote()
    silent = [Silent.remote() for _ in range(4)]
    try:
        made = ray.get(owner.make.remote(host))
        ray.get(owner.renew_also_on.remote(silent))
        time.sleep(4 * LEASE_S)
        assert ray.get(host.info.remote())["reclaimed"] == before
        assert made[0].run("echo alive").output == "alive\n"
    finally:
        ray.kill(owner)  # the idle fixture sees its workspaces reclaimed
        for s in silent:
            ray.kill(s)


def test_a_host_killed_mid_group_loses_and_duplicates_nothing(idle):
    t = task("kill")
    n = 6
    # rollouts 0 and 1 end at once, the others sleep: the host dies with them running
    pol = ReplayPolicy([[f"cat base; echo $STAGE; {'sleep 4; ' if i > 1 else ''}echo {i} > mine; cat mine"]
                        for i in range(n)])
    eng = ClusterEngine(pol, [t], n, per_node=n, hosts=idle)
    got, killed = [], None
    for traj in eng.stream():
        got.append(traj)
        if killed is None:
            killed = traj.node
            ray.kill(idle[killed], no_restart=True)  # SIGKILL: its workspaces go with it
    assert sorted(tr.index for tr in got) == list(range(n))
    assert all(tr.error is None for tr in got)
    for tr in got:
        assert tr.turns[0].observation == f"kill\nset-up\n{tr.index}\n"
    m = eng.metrics
    assert m["hosts_lost"] == [killed] and m["lost"] == 0 and m["duplicates"] == 0
    assert m["reruns"] >= n - 2
    assert {tr.node for tr in got if tr.index > 1} and killed not in {tr.node for tr in got if tr.index > 1}
    with pytest.raises(HostLost):
        RemoteWorkspace.create(host=idle[killed])
    # what the killed host held is removed by the next host of the machine (the module's
    # teardown checks that nothing is left)


def test_a_node_removed_mid_group_loses_and_duplicates_nothing(cluster, idle):
    t = task("remove")
    head = ray.get_runtime_context().get_node_id()
    victim = next(n for n in idle if n != head)
    # the task's template is set up on the victim first, so the group goes there
    ClusterEngine(numbered(1), [t], 1, hosts={victim: idle[victim]}).run()
    n = 4
    pol = ReplayPolicy([[f"cat base; echo $STAGE; {'sleep 4; ' if i else ''}echo {i} > mine; cat mine"]
                        for i in range(n)])
    eng = ClusterEngine(pol, [t], n, groups=1, per_node=n, hosts=idle)
    got = []
    for traj in eng.stream():
        got.append(traj)
        if len(got) == 1:
            assert traj.node == victim
            node = next(x for x in cluster.list_all_nodes() if x.node_id == victim)
            cluster.remove_node(node, allow_graceful=False)  # its raylet and workers die
    assert sorted(tr.index for tr in got) == list(range(n))
    for tr in got:
        assert tr.error is None and tr.turns[0].observation == f"remove\nset-up\n{tr.index}\n"
    assert victim not in {tr.node for tr in got if tr.index}
    m = eng.metrics
    assert m["hosts_lost"] == [victim] and m["lost"] == 0 and m["duplicates"] == 0
    assert m["placements"][0]["why"] == "template"


def test_no_template_is_pulled_from_a_holder_still_setting_it_up():
    """Placement alone (no cluster): while every holder of a task is still setting it up there
    is nothing to pull, so a group whose holders are full waits, however cheap pulls have been."""
    from bunshin.cluster.engine import _Group, _Node
    from bunshin.cluster.types import ClusterGroup

    task = Task("setting-up", "p")
    eng = ClusterEngine(ReplayPolicy([["true"]]), [task], 1, hosts={}, per_node=1)
    eng._latency = {task.id: (60.0, 1)}  # a rollout takes a minute: a pull would beat waiting
    eng.metrics = {"decisions": {"waited": 0}}
    g = _Group(task, eng.policies[task.id], 0, ClusterGroup(task.id, 0, 1), [0])
    nodes = {"a": _Node(None, running=1, tasks={task.id: -1}), "b": _Node(None)}
    assert eng._place(g, nodes) is None
    nodes["a"].tasks[task.id] = 2.0  # set up in 2 s: now a pull (1.5 s prior) is the cheapest
    assert eng._place(g, nodes) == ("b", "pulled")
