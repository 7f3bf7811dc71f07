"""Stopping the service: every named actor of it closed and killed, the controller first.

The controller starts again whatever it finds missing, so it goes first and is gone before
the rest are listed: an actor it started while the list was taken would outlive the stop.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from cmx.links import RAY_NAMESPACE
from cmx.tiers import tier_specs

__all__ = ["stop_service", "until_gone"]

_CONTROLLER = "cmx:controller"


def _closable() -> set[str]:
    """The kinds of actor closed before they are killed: agents (they map arenas) and every
    registered tier, the pool's nodes too (a closed tier unlinks its arena)."""
    return {"agent", *(s.name for s in tier_specs())}


def until_gone(name: str, timeout_s: float) -> None:
    """Return once no actor holds ``name`` (a killed one lets it go as it dies), or after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=RAY_NAMESPACE)
        except ValueError:
            return
        time.sleep(0.2)


def _named() -> list[tuple[str, Any]]:
    """The service's named actors now: (name, handle)."""
    handles: list[tuple[str, Any]] = []
    for info in ray.util.list_named_actors(all_namespaces=True):
        if info.get("namespace") == RAY_NAMESPACE and info["name"].startswith("cmx:"):
            try:
                handles.append((info["name"], ray.get_actor(info["name"], namespace=RAY_NAMESPACE)))
            except ValueError:
                pass
    return handles


def stop_service(timeout_s: float = 10.0) -> int:
    """Close and kill every actor of the service; returns how many were killed.

    The controller goes first, and is gone before the rest are listed. Tiers and pool nodes
    are then closed, so their shared-memory arenas are unlinked and their NVMe indexes
    snapshotted; an actor that does not close in time is killed anyway.
    """
    killed = 0
    try:
        ray.kill(ray.get_actor(_CONTROLLER, namespace=RAY_NAMESPACE), no_restart=True)
        killed = 1
        until_gone(_CONTROLLER, timeout_s)
    except ValueError:  # not running
        pass
    handles = [(name, h) for name, h in _named() if name != _CONTROLLER]
    closable = _closable()
    closing = [h.close.remote() for name, h in handles if name.split(":")[1] in closable]
    if closing:
        ray.wait(closing, num_returns=len(closing), timeout=timeout_s)
    for _, handle in handles:
        ray.kill(handle, no_restart=True)
    return killed + len(handles)
