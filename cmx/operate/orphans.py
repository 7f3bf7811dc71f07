"""Orphaned store directories across the cluster: list them, collect them (an admin action).

Each node's NVMe tier sees the ``nvme_dir`` of its machine (cmx.operate.store_dirs); nodes that
share a machine see the same orphans, so answers are merged by machine-local path.
"""

from __future__ import annotations

from typing import Any

from cmx.actors.links import RAY_NAMESPACE, actor_name
from cmx.operate.store_dirs import Orphan

__all__ = ["collect_orphans", "list_orphans"]


def _tiers(timeout_s: float) -> dict[str, Any]:
    import ray

    controller = ray.get_actor("cmx:controller", namespace=RAY_NAMESPACE)
    nodes: list[str] = ray.get(controller.nodes.remote(), timeout=timeout_s)
    out = {}
    for node in nodes:
        try:
            out[node] = ray.get_actor(actor_name("nvme", node), namespace=RAY_NAMESPACE)
        except ValueError:
            continue
    return out


def _ask(method: str, *args: Any, timeout_s: float) -> dict[str, list[Orphan]]:
    import ray

    refs = {node: getattr(tier, method).remote(*args) for node, tier in _tiers(timeout_s).items()}
    answers: dict[str, list[Orphan]] = {}
    for node, ref in refs.items():
        try:
            answers[node] = list(ray.get(ref, timeout=timeout_s))
        except Exception:  # noqa: BLE001 - a tier that does not answer lists nothing
            continue
    return answers


def list_orphans(timeout_s: float = 30.0) -> dict[str, list[Orphan]]:
    """Per node (by Ray node id): the orphaned store directories its NVMe tier sees.
    Needs a connected Ray driver (cmx.operate.ray_cluster.join)."""
    return _ask("orphans", timeout_s=timeout_s)


def collect_orphans(older_than_s: float = 0.0, timeout_s: float = 120.0
                    ) -> dict[str, list[Orphan]]:
    """Remove orphaned store directories at least ``older_than_s`` old; per node, those removed."""
    return _ask("collect_orphans", older_than_s, timeout_s=timeout_s)
