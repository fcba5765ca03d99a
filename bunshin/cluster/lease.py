"""Leases: how a host knows the owner of its workspaces is still alive.

The *owner* of a workspace or template on a host is the process that made it through a proxy
(``RemoteWorkspace.create``, ``fork``, ``snapshot``). Each such process runs one daemon thread
that renews its lease on every host it holds something on, every third of the lease; a process
that dies (SIGKILL, a Ray worker ended, its node gone) stops renewing, and the host closes what
it owned once the lease runs out. Leases need nothing from Ray's state API and work for drivers,
tasks and actors alike.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Any

log = logging.getLogger("bunshin.cluster")

__all__ = ["hold", "owner_id"]

_lock = threading.Lock()
_pid = -1
_owner = ""
_hosts: dict[str, tuple[Any, float]] = {}  # actor id -> (handle, lease seconds)
_wake = threading.Event()


def owner_id() -> str:
    """This process's owner id (new after a fork(2): the child owns nothing of its parent's)."""
    global _pid, _owner
    with _lock:
        if _pid != os.getpid():
            _pid, _owner = os.getpid(), f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
            _hosts.clear()
            threading.Thread(target=_renew_loop, args=(_owner,), name="bunshin-lease", daemon=True).start()
        return _owner


def hold(host: Any, lease_s: float) -> None:
    """Keep renewing this process's lease on ``host`` (an actor handle)."""
    owner_id()
    with _lock:
        new = host._actor_id.hex() not in _hosts
        _hosts[host._actor_id.hex()] = (host, lease_s)
    if new:
        _wake.set()


def _renew_loop(owner: str) -> None:
    import ray

    while True:
        with _lock:
            if owner != _owner:
                return
            hosts = dict(_hosts)
        period = min((s for _h, s in hosts.values()), default=30.0) / 3
        if hosts:
            refs = {k: h.renew.remote(owner) for k, (h, _s) in hosts.items()}
            # one wait for all: hosts that do not answer must not delay the others' renewals
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=period)
            answered = set(ready)
            for k, ref in refs.items():
                if ref not in answered:
                    continue
                try:
                    ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                    if isinstance(e, ray.exceptions.ActorDiedError):
                        with _lock:
                            _hosts.pop(k, None)
                except Exception as e:  # noqa: BLE001 - a renewal failing must not end the thread
                    log.debug("lease renewal on %s: %s", k, e)
        _wake.wait(period)
        _wake.clear()
