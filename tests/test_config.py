"""bunshin.config: the one place BUNSHIN_* environment knobs are read, and their documentation."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import bunshin
from bunshin import config

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "bunshin"


def _env_key(node: ast.AST) -> ast.AST | None:
    """The key of ``os.environ.get(k)``, ``os.environ[k]``, ``os.getenv(k)`` or
    ``os.environ.setdefault(k)``; None for anything else."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
            and node.value.attr == "environ":
        return node.slice
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        f = node.func
        if f.attr == "getenv" or (f.attr in ("get", "setdefault", "pop")
                                  and isinstance(f.value, ast.Attribute) and f.value.attr == "environ"):
            return node.args[0]
    return None


def test_only_config_reads_bunshin_variables():
    """Every environment read outside config.py names a literal variable that is not BUNSHIN_*
    (a name held in a constant could be one, so it counts as a knob read too)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            key = _env_key(node)
            if key is None:
                continue
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)
                    and not key.value.startswith("BUNSHIN_")):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    for path in sorted(PACKAGE.rglob("*.pyx")):
        if re.search(r"environ|getenv", path.read_text()):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_every_knob_is_documented_once():
    """Users' knobs in the README's table, the engine's measuring knobs in docs/design.md's."""
    documented = [name for doc in ("README.md", "docs/design.md")
                  for name in re.findall(r"^\| `(BUNSHIN_[A-Z_]+)` \|", (ROOT / doc).read_text(), re.MULTILINE)]
    assert sorted(documented) == sorted(k.name for k in config.KNOBS)


def test_knobs_are_named_once_and_accessed():
    names = [k.name for k in config.KNOBS]
    assert len(names) == len(set(names))
    source = (PACKAGE / "config.py").read_text()
    for name in names:  # the table entry and at least one accessor
        assert source.count(f'"{name}"') >= 2, name


def test_defaults(monkeypatch):
    for k in config.KNOBS:
        monkeypatch.delenv(k.name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert config.state_dir() == Path("/var/lib/bunshin")
    assert config.cache_dir() == Path("/xdg/bunshin")
    assert config.cgroup_prefix() == "bunshin"
    assert config.state_size() == "256G"
    assert config.cgroup_version() == "" and config.criu_path() == ""
    assert config.kmod_mode() == "auto" and config.pagemap_scan() == "auto"
    assert config.ns_pool_size() == 4
    assert all((config.kmod_fork(), config.kmod_run(), config.fork_slots(), config.early_init(),
                config.rebase(), config.freezer_on(), config.favor_dynmods()))


def test_values_are_read_when_asked(monkeypatch):
    monkeypatch.setenv("BUNSHIN_FORK_SLOTS", "0")
    assert config.fork_slots() is False
    monkeypatch.setenv("BUNSHIN_FORK_SLOTS", " 1 ")
    assert config.fork_slots() is True
    monkeypatch.setenv("BUNSHIN_FORK_SLOTS", "")  # empty: the default
    assert config.fork_slots() is True
    monkeypatch.setenv("BUNSHIN_NS_POOL", "0")
    assert config.ns_pool_size() == 0
    monkeypatch.setenv("BUNSHIN_PAGEMAP_SCAN", "ALL")
    assert config.pagemap_scan() == "all"


_BY_KNOB = {"BUNSHIN_NS_POOL": config.ns_pool_size, "BUNSHIN_KMOD_FORK": config.kmod_fork,
            "BUNSHIN_KMOD_RUN": config.kmod_run, "BUNSHIN_FORK_SLOTS": config.fork_slots,
            "BUNSHIN_EARLY_INIT": config.early_init, "BUNSHIN_REBASE": config.rebase,
            "BUNSHIN_FREEZER_ON": config.freezer_on, "BUNSHIN_FAVOR_DYNMODS": config.favor_dynmods,
            "BUNSHIN_OWNER_WATCH": config.owner_watch,
            "BUNSHIN_PAGEMAP_SCAN": config.pagemap_scan}


@pytest.mark.parametrize("name", sorted(k.name for k in config.KNOBS if k.kind in ("int", "switch")))
@pytest.mark.parametrize("bad", ["yes", "-1", "2x"])
def test_bad_values_name_the_variable(monkeypatch, name, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(config.ConfigError, match=f"^{name}='{re.escape(bad)}': expected"):
        _BY_KNOB[name]()
    assert issubclass(config.ConfigError, bunshin.BunshinError)


def test_bad_choice_names_the_variable(monkeypatch):
    monkeypatch.setenv("BUNSHIN_PAGEMAP_SCAN", "some")
    with pytest.raises(config.ConfigError, match="BUNSHIN_PAGEMAP_SCAN='some': expected one of"):
        config.pagemap_scan()


def test_every_parsed_knob_has_an_accessor_here():
    parsed = {k.name for k in config.KNOBS if k.kind in ("int", "switch")} | {"BUNSHIN_PAGEMAP_SCAN"}
    assert parsed == set(_BY_KNOB)
