"""The service on Ray: the actors of every node, the directory shards, and the controller.

Per node: ``cmx:hbm:<node>``, ``cmx:dram:<node>``, ``cmx:nvme:<node>`` (tier control planes,
pinned to the node) and ``cmx:agent:<node>`` (the data plane: on the node, or on its DPU when
a node labelled ``dpu_label`` with the same ``host_label`` value exists). Cluster-wide:
``cmx:dir:<i>`` directory shards and ``cmx:controller``, which starts the actors of nodes that
join and drops the copies of nodes that leave. All live in the Ray namespace ``cmx``, are
detached (they outlive the client that started them) and are restarted by Ray when they die.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cmx.actors.agent import OffloadAgent
from cmx.actors.arena_tier import ArenaTierService
from cmx.actors.directory import DirectoryShard, Source
from cmx.actors.links import RAY_NAMESPACE, RayLink, actor_name
from cmx.actors.nvme_tier import NvmeTierService
from cmx.actors.pool import PoolNodeService
from cmx.config import ServiceConfig
from cmx.errors import UnavailableError
from cmx.tiers import Tier

__all__ = ["alive_nodes", "ensure_service", "node_actors", "stop_service"]

log = logging.getLogger(__name__)

_RESTART = {"max_restarts": -1, "max_task_retries": 0, "lifetime": "detached"}


def _heartbeat(service: Any, every_s: float) -> None:
    def loop() -> None:
        while True:
            time.sleep(every_s)
            try:
                service.heartbeat()
            except Exception:  # noqa: BLE001 - the next beat tries again
                log.debug("heartbeat failed", exc_info=True)

    threading.Thread(target=loop, name="cmx-heartbeat", daemon=True).start()


class ArenaTierActor(ArenaTierService):
    def __init__(self, tier: Tier, node: str, config: ServiceConfig) -> None:
        capacity = config.hbm_bytes if tier is Tier.HBM else config.dram_bytes
        super().__init__(
            tier, node, capacity, config.block_bytes, RayLink(config.call_timeout_s),
            config.directory_shards, config.eviction, emulated=tier is Tier.HBM,
            lease_s=config.lease_s,
        )
        _heartbeat(self, config.heartbeat_s)


class NvmeTierActor(NvmeTierService):
    def __init__(self, node: str, config: ServiceConfig) -> None:
        super().__init__(
            node, os.path.join(config.nvme_dir, node[:16]), config.nvme_bytes,
            config.block_bytes, RayLink(config.call_timeout_s), config.directory_shards,
            config.eviction, segment_bytes=config.nvme_segment_bytes, lease_s=config.lease_s,
        )
        _heartbeat(self, config.heartbeat_s)


class AgentActor(OffloadAgent):
    def __init__(self, node: str, config: ServiceConfig) -> None:
        super().__init__(node, config, RayLink(config.call_timeout_s))
        self.placed_on = ray.get_runtime_context().get_node_id()

    def placement(self) -> dict[str, object]:
        return {"node": self.node, "placed_on": self.placed_on, "dpu": self.placed_on != self.node}


class PoolNodeActor(PoolNodeService):
    def __init__(self, node: str, pool_id: str, config: ServiceConfig) -> None:
        super().__init__(
            node, pool_id, os.path.join(config.nvme_dir, f"pool-{pool_id}"), config.pool_bytes,
            config.block_bytes, config.pool_staging_bytes, RayLink(config.call_timeout_s),
            config.directory_shards, config.transport, config.eviction,
            segment_bytes=config.nvme_segment_bytes, lease_s=config.lease_s,
        )
        _heartbeat(self, config.heartbeat_s)


class Controller:
    """Keeps one set of node actors per alive node and a pool actor per pool node; forgets
    the copies of nodes that left; re-replicates the pool when its membership changes."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.known: set[str] = set()
        self.pool: set[str] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._loop, name="cmx-controller", daemon=True).start()

    def reconcile(self) -> dict[str, list[str]]:
        with self._lock:
            alive = {n["NodeID"]: n for n in alive_nodes()}
            started = []
            for node_id, node in alive.items():
                if node_id not in self.known and not _is_dpu(node, self.config):
                    start_node_actors(node_id, self.config, alive)
                    started.append(node_id)
            gone = sorted((self.known | self.pool) - alive.keys())
            for node_id in gone:
                self._forget(node_id)
            self.known = {n for n in alive if not _is_dpu(alive[n], self.config)}
            pool = self._reconcile_pool(alive)
            return {"started": started, "gone": gone, "nodes": sorted(self.known),
                    "pool": pool}

    def _reconcile_pool(self, alive: dict[str, dict[str, Any]]) -> list[str]:
        pool = {}
        for node_id, node in alive.items():
            pool_id = (node.get("Labels") or {}).get(self.config.pool_label)
            if pool_id:
                pool[node_id] = pool_id
        for node_id in pool.keys() - self.pool:
            start_pool_actor(node_id, pool[node_id], self.config)
        if pool.keys() != self.pool:
            self.pool = set(pool)
            members = sorted(self.pool)
            for node_id in members:  # re-replicate in the background; nobody waits on it
                ray.get_actor(actor_name("pool", node_id), namespace=RAY_NAMESPACE) \
                    .rebalance.remote(members, self.config.pool_replication)
        return sorted(self.pool)

    def nodes(self) -> list[str]:
        return sorted(self.known)

    def pool_members(self) -> list[str]:
        return sorted(self.pool)

    def _forget(self, node_id: str) -> None:
        # Actors pinned to a node that left would wait forever for it to restart them.
        for kind in ("hbm", "dram", "nvme", "agent", "pool"):
            try:
                ray.kill(ray.get_actor(actor_name(kind, node_id), namespace=RAY_NAMESPACE),
                         no_restart=True)
            except ValueError:
                pass
        link = RayLink(self.config.call_timeout_s)
        for shard in range(self.config.directory_shards):
            for tier in Tier:
                try:
                    link.call(actor_name("dir", shard), "drop_source", Source(node_id, tier))
                except UnavailableError:
                    pass

    def _loop(self) -> None:
        while True:
            time.sleep(2.0)
            try:
                self.reconcile()
            except Exception:  # noqa: BLE001 - try again on the next round
                log.debug("reconcile failed", exc_info=True)


def alive_nodes() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


def _is_dpu(node: dict[str, Any], config: ServiceConfig) -> bool:
    return config.dpu_label in (node.get("Labels") or {})


def _agent_placement(
    node_id: str, config: ServiceConfig, alive: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Options placing a node's agent: on the node's DPU if one has joined, else on the node."""
    host = (alive.get(node_id, {}).get("Labels") or {}).get(config.host_label)
    if host is not None:
        for node in alive.values():
            labels = node.get("Labels") or {}
            if config.dpu_label in labels and labels.get(config.host_label) == host:
                return {"label_selector": {config.dpu_label: labels[config.dpu_label],
                                           config.host_label: host}}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def start_node_actors(
    node_id: str, config: ServiceConfig, alive: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Start (or find) the tier actors and the agent of one node; returns their handles."""
    on_node = NodeAffinitySchedulingStrategy(node_id, soft=False)
    common = {"namespace": RAY_NAMESPACE, "get_if_exists": True, "num_cpus": 0, **_RESTART}
    handles = {}
    for tier in (Tier.HBM, Tier.DRAM):
        handles[tier.value] = ray.remote(ArenaTierActor).options(
            name=actor_name(tier.value, node_id), scheduling_strategy=on_node,
            max_concurrency=16, **common,
        ).remote(tier, node_id, config)
    handles["nvme"] = ray.remote(NvmeTierActor).options(
        name=actor_name("nvme", node_id), scheduling_strategy=on_node, max_concurrency=16,
        **common,
    ).remote(node_id, config)
    # The agent maps the tiers' arenas when it starts: wait until they exist.
    ray.get([h.info.remote() for h in handles.values()], timeout=60)
    handles["agent"] = ray.remote(AgentActor).options(
        name=actor_name("agent", node_id),
        max_concurrency=32, **_agent_placement(node_id, config, alive or {}), **common,
    ).remote(node_id, config)
    ray.get(handles["agent"].peer_info.remote(), timeout=60)
    return handles


def start_pool_actor(node_id: str, pool_id: str, config: ServiceConfig) -> Any:
    handle = ray.remote(PoolNodeActor).options(
        name=actor_name("pool", node_id), namespace=RAY_NAMESPACE, get_if_exists=True,
        num_cpus=0, max_concurrency=16,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **_RESTART,
    ).remote(node_id, pool_id, config)
    ray.get(handle.peer_info.remote(), timeout=60)
    return handle


def ensure_service(config: ServiceConfig) -> Any:
    """Start the directory and the controller if they are not running; returns the controller."""
    common = {"namespace": RAY_NAMESPACE, "get_if_exists": True, "num_cpus": 0, **_RESTART}
    for shard in range(config.directory_shards):
        ray.remote(DirectoryShard).options(
            name=actor_name("dir", shard), max_concurrency=1, **common
        ).remote(shard)
    controller = ray.remote(Controller).options(
        name="cmx:controller", max_concurrency=4, **common
    ).remote(config)
    ray.get(controller.reconcile.remote(), timeout=180)
    return controller


def node_actors(node_id: str) -> dict[str, Any]:
    out = {}
    for kind in ("hbm", "dram", "nvme", "agent"):
        try:
            out[kind] = ray.get_actor(actor_name(kind, node_id), namespace=RAY_NAMESPACE)
        except ValueError:
            pass
    return out


def stop_service(timeout_s: float = 10.0) -> int:
    """Close and kill every actor of the service; returns how many were killed.

    Tiers and pool nodes are closed first, so their shared-memory arenas are unlinked and
    their NVMe indexes snapshotted; an actor that does not close in time is killed anyway.
    """
    handles = []
    for info in ray.util.list_named_actors(all_namespaces=True):
        if info.get("namespace") == RAY_NAMESPACE and info["name"].startswith("cmx:"):
            try:
                handles.append((info["name"], ray.get_actor(info["name"], namespace=RAY_NAMESPACE)))
            except ValueError:
                pass
    closing = [h.close.remote() for name, h in handles if name.split(":")[1] in _CLOSABLE]
    if closing:
        ray.wait(closing, num_returns=len(closing), timeout=timeout_s)
    for _, handle in handles:
        ray.kill(handle, no_restart=True)
    return len(handles)


_CLOSABLE = {"agent", "hbm", "dram", "nvme", "pool"}  # agents first in the list: they map arenas
