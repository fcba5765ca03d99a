"""Every ``BUNSHIN_*`` environment knob, in one table, and the only code that reads them.

Each accessor reads the environment when it is called, so a value set at run time (tests and
benchmarks do) takes effect at the next read. Two readers keep what they read: the kernel-module
backend (``BUNSHIN_KMOD*``) until ``bunshin._core.kmod.reset()``, and the namespace pool
(``BUNSHIN_NS_POOL``) for the life of the process.
An empty value means the default. A switch takes ``0`` (off) or ``1`` (on); a value that
cannot be parsed raises :class:`ConfigError` naming the variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

__all__ = [
    "KNOBS",
    "ConfigError",
    "Knob",
    "cache_dir",
    "cgroup_prefix",
    "cgroup_version",
    "criu_path",
    "disk_limit",
    "early_init",
    "favor_dynmods",
    "fork_slots",
    "fork_tree",
    "freezer_on",
    "isolation",
    "kmod_fork",
    "kmod_mode",
    "kmod_run",
    "layer_store",
    "ns_pool_size",
    "pagemap_scan",
    "rebase",
    "state_dir",
    "state_size",
]


@dataclass(frozen=True)
class Knob:
    name: str
    default: str
    """The value an unset (or empty) variable stands for; ``""`` where the default is computed."""
    kind: str
    """``path``, ``text``, ``int``, ``switch`` (0/1) or ``choice`` (one of ``choices``)."""
    meaning: str
    choices: tuple[str, ...] = ()


KNOBS: tuple[Knob, ...] = (
    Knob("BUNSHIN_STATE_DIR", "/var/lib/bunshin", "path",
         "live workspaces' upper layers and metadata; must be a file system of its own "
         "(else a loop-mounted ext4 image is put there)"),
    Knob("BUNSHIN_STATE_SIZE", "256G", "text",
         "size of that sparse btrfs image (`truncate -s` syntax); its file system is sized down "
         "at mount to leave the host's disk a reserve"),
    Knob("BUNSHIN_DISK_LIMIT", "4G", "text",
         "what a workspace created without `disk_limit` may write (btrfs quota; each fork the "
         "same, counted from the fork on); `0`: no limit"),
    Knob("BUNSHIN_CACHE_DIR", "", "path",
         "rootfs layers, Debian roots, kernel probe results, a private CRIU "
         "(default `$XDG_CACHE_HOME/bunshin` or `~/.cache/bunshin`)"),
    Knob("BUNSHIN_LAYER_STORE", "", "path",
         "shared directories (`:`-separated) `Template.load` fetches missing rootfs layers from "
         "(`<digest>/` each) and `tpl.save` puts its layers in"),
    Knob("BUNSHIN_CGROUP_PREFIX", "bunshin", "text",
         "the cgroup directory (in every hierarchy) that holds all workspaces"),
    Knob("BUNSHIN_CGROUP", "", "choice",
         "force cgroup `v1` or `v2` (default: v2 when it has the needed controllers)",
         ("v1", "v2")),
    Knob("BUNSHIN_CRIU", "", "path",
         "the CRIU >= 4 binary to use (default: the private install, then `PATH`)"),
    Knob("BUNSHIN_KMOD", "auto", "choice",
         "`auto`: use /dev/bunshin when loaded; `0`: never; `1`: require it",
         ("auto", "0", "1")),
    Knob("BUNSHIN_TREE", "exact", "choice",
         "without the kernel module: `flat` makes every clone a child of the child's init (no "
         "parent copied into its clone; `getppid()` is 1, jobs leave their shell's session)",
         ("exact", "flat")),
    Knob("BUNSHIN_KMOD_FORK", "1", "switch",
         "0: keep the module but clone (and fix clones up) by injection (A/B runs)"),
    Knob("BUNSHIN_KMOD_RUN", "1", "switch",
         "0: clone with the module's FORK but fix clones up by injection (A/B runs)"),
    Knob("BUNSHIN_NS_POOL", "4", "int",
         "net/ipc/uts namespace sets a background thread makes ahead of forks; 0: none"),
    Knob("BUNSHIN_FORK_SLOTS", "1", "switch",
         "0: make no slots (a template's next children) and no spares (a workspace's next fork)"),
    Knob("BUNSHIN_EARLY_INIT", "1", "switch",
         "0: every fork clones its children's inits itself instead of ahead of time"),
    Knob("BUNSHIN_REBASE", "1", "switch",
         "0: a workspace 32 pid namespaces deep is not moved back to the top (its next "
         "snapshot fails)"),
    Knob("BUNSHIN_FREEZER_ON", "1", "switch",
         "0: no frozen empty group keeping the cgroup v1 freezer's static key on"),
    Knob("BUNSHIN_OWNER_WATCH", "1", "switch",
         "0: no watcher process removing a trainer's workspaces when it dies without closing them"),
    Knob("BUNSHIN_FAVOR_DYNMODS", "1", "switch",
         "0: leave the kernel's cgroup `favordynmods` option alone"),
    Knob("BUNSHIN_ISOLATION", "sandbox", "choice",
         "what `Workspace.create` makes unless told: `sandbox` (a user namespace of its own, "
         "root inside has no power over the host) or `trusted` (its root is the host's)",
         ("trusted", "sandbox")),
    Knob("BUNSHIN_PAGEMAP_SCAN", "auto", "choice",
         "memory accounting: `auto` scans long ranges with PAGEMAP_SCAN, `0` never, `all` always",
         ("auto", "0", "all")),
)

_BY_NAME = {k.name: k for k in KNOBS}


def _raw(name: str) -> str:
    """The variable's value, stripped, or the knob's default when unset or empty."""
    return os.environ.get(name, "").strip() or _BY_NAME[name].default


def _switch(name: str) -> bool:
    v = _raw(name)
    if v not in ("0", "1"):
        raise ConfigError(f"{name}={os.environ[name]!r}: expected 0 (off) or 1 (on)")
    return v == "1"


def _int(name: str) -> int:
    v = _raw(name)
    try:
        n = int(v)
    except ValueError:
        n = -1
    if n < 0:
        raise ConfigError(f"{name}={os.environ[name]!r}: expected a whole number >= 0")
    return n


def _choice(name: str) -> str:
    v = _raw(name).lower()
    choices = _BY_NAME[name].choices
    if v and v not in choices:
        raise ConfigError(f"{name}={os.environ[name]!r}: expected one of {', '.join(choices)}")
    return v


def state_dir() -> Path:
    """Directory holding live workspaces (``<state>/ws/<id>``)."""
    return Path(_raw("BUNSHIN_STATE_DIR"))


def state_size() -> str:
    """Size of the state directory's ext4 image, as ``truncate -s`` takes it."""
    return _raw("BUNSHIN_STATE_SIZE")


def disk_limit() -> str:
    """The ``disk_limit`` of a workspace created without one, as given (``"0"``: none);
    :func:`bunshin.runtime.quota.parse_disk` judges it."""
    return _raw("BUNSHIN_DISK_LIMIT")


def cache_dir() -> Path:
    """Directory for caches that survive restarts (layers, Debian roots, probes)."""
    env = _raw("BUNSHIN_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "bunshin"


def layer_store() -> str:
    """The shared layer store directories, ``:``-separated, or ``""``."""
    return _raw("BUNSHIN_LAYER_STORE")


def cgroup_prefix() -> str:
    """Name of the cgroup directory (in every hierarchy) that holds all workspaces."""
    return _raw("BUNSHIN_CGROUP_PREFIX")


def cgroup_version() -> str:
    """The forced cgroup version (lowercase), or ``""`` to choose; the cgroup package judges it
    (a :class:`~bunshin.errors.CgroupError` names a bad value)."""
    return _raw("BUNSHIN_CGROUP").lower()


def criu_path() -> str:
    """The CRIU binary named by the environment, or ``""``."""
    return _raw("BUNSHIN_CRIU")


def kmod_mode() -> str:
    """``auto``, ``0`` or ``1`` as given (lowercase); ``bunshin._core.kmod`` judges it (a
    ``KmodUnavailable`` names a bad value)."""
    return _raw("BUNSHIN_KMOD").lower()


def fork_tree() -> str:
    """``exact`` (the default) or ``flat``: how a fork without the kernel module makes the
    child's process tree: ``exact`` each clone made by its parent's clone (fork/tree.py: a
    parent's memory is copied, but for the pages it shares with the child its clone was made
    from), ``flat`` every clone a child of the child's init (a parent's memory shared
    copy-on-write too)."""
    return _choice("BUNSHIN_TREE")


def kmod_fork() -> bool:
    """Clone with the module's FORK when it has it."""
    return _switch("BUNSHIN_KMOD_FORK")


def kmod_run() -> bool:
    """Fix clones up with the module's RUN when it has it."""
    return _switch("BUNSHIN_KMOD_RUN")


def ns_pool_size() -> int:
    """Namespace sets kept ready for forks (0: the pool is off)."""
    return _int("BUNSHIN_NS_POOL")


def fork_slots() -> bool:
    """Prepare slots and spares ahead of forks."""
    return _switch("BUNSHIN_FORK_SLOTS")


def early_init() -> bool:
    """Clone a slot's init ahead of the fork that takes the slot."""
    return _switch("BUNSHIN_EARLY_INIT")


def rebase() -> bool:
    """Move a workspace at the pid-namespace nesting limit back to the top through CRIU."""
    return _switch("BUNSHIN_REBASE")


def freezer_on() -> bool:
    """Keep the cgroup v1 freezer's static key on with a frozen empty group."""
    return _switch("BUNSHIN_FREEZER_ON")


def owner_watch() -> bool:
    """Start a watcher that removes this trainer's workspaces when it ends without closing them."""
    return _switch("BUNSHIN_OWNER_WATCH")


def favor_dynmods() -> bool:
    """Turn the kernel's cgroup ``favordynmods`` option on once per boot."""
    return _switch("BUNSHIN_FAVOR_DYNMODS")


def isolation() -> str:
    """``trusted`` or ``sandbox``: the isolation of a workspace created without one."""
    return _choice("BUNSHIN_ISOLATION")


def pagemap_scan() -> str:
    """``auto``, ``0`` (never use PAGEMAP_SCAN) or ``all`` (use it for every range)."""
    return _choice("BUNSHIN_PAGEMAP_SCAN")
