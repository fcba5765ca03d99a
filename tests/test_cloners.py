"""Which Cloner a fork uses, chosen once per backend answer (bunshin/fork/cloners.py).

On a stock kernel the injection cloner is chosen and forks through it; kmod/tests/run.sh runs
this file again inside a guest with bunshin.ko loaded, where each module backend is chosen as
BUNSHIN_KMOD_FORK / BUNSHIN_KMOD_RUN allow, and forks through it.
"""

from __future__ import annotations

import os

import pytest

import bunshin
from bunshin._core import kmod
from bunshin.fork import cloners

HAVE_DEVICE = os.path.exists(kmod.DEVICE)
needs_module = pytest.mark.skipif(not HAVE_DEVICE, reason="bunshin.ko not loaded (run kmod/tests/run.sh)")
no_module = pytest.mark.skipif(HAVE_DEVICE, reason="checks the stock kernel's; /dev/bunshin is here")


@pytest.fixture
def env(monkeypatch):
    """Set BUNSHIN_KMOD* (None: unset) and have the backend chosen again, as benchmarks do."""

    def choose(**values: str | None):
        for name, value in values.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        kmod.reset()

    yield choose
    for name in (kmod.ENV, kmod.FORK_ENV, kmod.RUN_ENV):
        monkeypatch.delenv(name, raising=False)
    kmod.reset()


def _forks_a_shell_with_a_job() -> None:
    """A fork of a shell with a background job has both, running, with the shell's state."""
    ws = bunshin.Workspace.create()
    try:
        sh = ws.shell()
        sh.run("export V=kept; cd /tmp; sleep 1000 &")
        (kid,) = ws.fork(1)
        try:
            assert len(kid.processes()) == len(ws.processes())
            r = kid.shells[0].run("echo $V $PWD $(jobs -p | wc -l)")
            assert r.stdout == b"kept /tmp 1\n"
        finally:
            kid.close()
    finally:
        ws.close()


def test_chosen_once_per_backend_answer(env):
    env(BUNSHIN_KMOD=None)
    first = cloners.cloner()
    assert cloners.cloner() is first
    env(BUNSHIN_KMOD="0")
    again = cloners.cloner()
    assert again is not first and isinstance(again, cloners.Injection)


@no_module
def test_the_stock_kernel_clones_by_injection(env, no_leaks, monkeypatch):
    env(BUNSHIN_KMOD=None)
    cl = cloners.cloner()
    assert type(cl) is cloners.Injection
    assert cl.through_intermediates and not cl.in_child and not cl.fixups_in_kernel
    used = []
    real, real_through = cloners.Injection._clone, cloners.Injection.through
    monkeypatch.setattr(cloners.Injection, "_clone",
                        lambda self, *a: used.append(self) or real(self, *a))
    # an exact tree's clones that are not made by their parents' (fork/tree.py)
    monkeypatch.setattr(cloners.Injection, "through",
                        staticmethod(lambda *a: used.append(cloners.cloner()) or real_through(*a)))
    _forks_a_shell_with_a_job()
    assert used and all(c is cl for c in used)


@needs_module
@pytest.mark.parametrize(("fork_verb", "run_verb", "kind"), [
    ("1", "1", cloners.KernelForkRun), ("1", "0", cloners.KernelFork), ("0", "1", cloners.Reparent)])
def test_the_module_clones_as_its_verbs_allow(env, no_leaks, monkeypatch, fork_verb, run_verb, kind):
    env(BUNSHIN_KMOD="1", BUNSHIN_KMOD_FORK=fork_verb, BUNSHIN_KMOD_RUN=run_verb)
    cl = cloners.cloner()
    assert type(cl) is kind and not cl.through_intermediates
    assert cl.fixups_in_kernel == (kind is cloners.KernelForkRun)
    assert cl.in_child == (kind is not cloners.Reparent and kmod.backend().fork_in_parent is not None)
    used = []
    real = kind._clone
    monkeypatch.setattr(kind, "_clone", lambda self, *a: used.append(self) or real(self, *a))
    _forks_a_shell_with_a_job()
    assert used and all(c is cl for c in used)
    env(BUNSHIN_KMOD="0")
    assert type(cloners.cloner()) is cloners.Injection
