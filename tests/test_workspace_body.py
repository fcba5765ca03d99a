"""A workspace as a handle on its settings, body and shell sessions: what forks carry."""

from __future__ import annotations

import dataclasses

import pytest

import bunshin
from bunshin.runtime.cgroup.limits import Limits
from bunshin.runtime.workspace_config import WorkspaceConfig


def test_config_is_typed_and_frozen(family):
    ws = bunshin.Workspace.create(memory_limit="64M", pids_limit=50, env={"A": "1"}, workdir="/tmp")
    family.append(ws)
    cfg = ws.config
    assert isinstance(cfg, WorkspaceConfig)
    assert cfg.limits == Limits(memory=64 << 20, pids=50)
    assert cfg.env["A"] == "1" and cfg.workdir == "/tmp" and cfg.hostname.startswith("bunshin-")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.workdir = "/"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.env["B"] = "2"  # type: ignore[index]
    assert WorkspaceConfig.from_dict(cfg.to_dict()) == cfg


def test_limits_changed_on_a_live_workspace_go_to_its_forks(family):
    ws = bunshin.Workspace.create(memory_limit="64M", pids_limit=50)
    family.append(ws)
    ws.fork(1)[0].close()  # spares made with the first limits wait for the next fork
    ws.cgroup.set_limits(memory_limit="96M", pids_limit=None)
    assert ws.config.limits == Limits(memory=96 << 20, pids=None)
    kid = ws.fork(1)[0]
    family.append(kid)
    assert kid.config.limits == ws.config.limits
    assert kid.cgroup.limits == Limits(memory=96 << 20, pids=None)
    with ws.snapshot() as tpl:  # ws goes on as a fork of it: with the changed limits too
        [k2] = tpl.fork(1)
        family.append(k2)
        assert k2.cgroup.limits == ws.cgroup.limits == Limits(memory=96 << 20, pids=None)


def test_a_forks_shells_are_its_copies_of_the_sources_in_order(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    first, second = ws.shell(), ws.shell()
    first.run("X=one")
    second.run("X=two; cd /tmp")
    assert ws.shells == [first, second]
    kid = ws.fork(1)[0]
    family.append(kid)
    assert [s.id for s in kid.shells] == [first.id, second.id]
    assert first.id != second.id
    assert kid.shells[0].run("echo $X").stdout == b"one\n"
    assert kid.shells[1].run("echo $X $PWD").stdout == b"two /tmp\n"
    kid.shells[0].close()
    assert [s.id for s in kid.shells] == [second.id]
    assert ws.shells == [first, second]  # the source's are its own
