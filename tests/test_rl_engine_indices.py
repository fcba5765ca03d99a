"""RolloutEngine's hooks for running part of a group elsewhere: ``indices`` (a rerun keeps each
rollout's index, which a seeded policy answers by), ``on_rollout`` (each trajectory as it ends),
``workspaces`` (a provider of the caller's, here forks of a template it keeps) and ``group``
(which group of a batch the policy sees)."""

from __future__ import annotations

import pytest

from bunshin.rl import ReplayPolicy, RolloutError, Task
from bunshin.rl.engine import RolloutEngine
from bunshin.rl.workspaces import build

TASK = Task("indices", "leave your number", setup=("echo base > /tmp/base",), max_steps=4)


def policy(n: int) -> ReplayPolicy:
    return ReplayPolicy([[f"sleep 0.{n - i}; cat /tmp/base; echo {i} > /tmp/mine; cat /tmp/mine"] for i in range(n)])


def test_indices_run_those_rollouts_as_they_would_run_in_the_whole_group(no_leaks):
    ended = []
    with RolloutEngine(policy(4), TASK, 4, mode="fork", indices=[3, 1], on_rollout=ended.append) as eng:
        g = eng.run()
    assert [t.index for t in g.trajectories] == [3, 1]
    assert [t.index for t in ended] == [3, 1]  # 3 sleeps 0.1 s, 1 sleeps 0.3 s
    for t in g.trajectories:
        assert t.error is None and t.turns[0].observation == f"base\n{t.index}\n"


def test_a_kept_template_serves_groups_without_a_setup(no_leaks):
    from bunshin.cluster.host import HeldTemplate

    base, _sh = build(TASK, "base")
    try:
        tpl = base.snapshot()
    finally:
        base.close()
    try:
        for _ in range(2):
            with RolloutEngine(policy(2), TASK, 2, mode="fork", workspaces=HeldTemplate(TASK, tpl)) as eng:
                g = eng.run()
            assert g.setup_s == 0.0 and not g.errors
            assert [t.turns[0].observation for t in g.trajectories] == ["base\n0\n", "base\n1\n"]
    finally:
        tpl.close()


@pytest.mark.parametrize("bad", [[4], [0, 0], [-1], [True]])
def test_indices_outside_the_group_are_refused(bad):
    with pytest.raises(RolloutError, match="indices"):
        RolloutEngine(policy(4), TASK, 4, mode="fork", indices=bad)


class ByGroup(ReplayPolicy):
    """Answers with the group its history says (a policy seeded by group)."""

    async def act(self, history):
        return await ReplayPolicy([[f"echo group {history.group}"]]).act(history)


def test_the_policy_sees_the_group_it_runs_for(no_leaks):
    with RolloutEngine(ByGroup([["true"]]), TASK, 2, mode="fork", group=3, indices=[1]) as eng:
        g = eng.run()
    [t] = g.trajectories
    assert (t.index, t.group, t.turns[0].observation) == (1, 3, "group 3\n")


@pytest.mark.parametrize("bad", [-1, True, "0"])
def test_a_bad_group_is_refused(bad):
    with pytest.raises(RolloutError, match="group"):
        RolloutEngine(policy(4), TASK, 4, mode="fork", group=bad)
