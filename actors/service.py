"""The service on Ray: the actors of every node, the directory shards, and the controller.

Per node: a tier control plane for each registered node tier (``cmx.tiers.node_tiers``:
``cmx:hbm:<node>``, ``cmx:dram:<node>``, ``cmx:nvme:<node>``, pinned to the node; the books of
its kind, ``actors.tiers.books``) and ``cmx:agent:<node>`` (the data plane: on the node, or on
its DPU when a node labelled ``dpu_label`` with the same ``host_label`` value exists).
Cluster-wide: ``cmx:dir:<i>`` directory shards and ``cmx:controller``, which starts the actors
of nodes that join and drops the copies of nodes that leave. All live in the Ray namespace
``cmx``, are detached (they outlive the client that started them) and are restarted by Ray when
they die; a directory shard pinned to a labelled node (``directory_label``) that died is started
again by the controller instead (``directory.placement``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cmx.actors.agent.core import HostParts, OffloadAgent
from cmx.actors.directory.placement import (
    ShardWatch,
    ping_shards,
    shard_node,
    start_shards,
    stop_shard,
)
from cmx.actors.directory.shard import Source
from cmx.actors.dpu.agent import dpu_actor_parts
from cmx.actors.pool.node import PoolNodeService
from cmx.actors.stop import stop_service, until_gone
from cmx.actors.tiers.arena import ArenaTierService
from cmx.actors.tiers.books import tier_folder
from cmx.actors.tiers.nvme import NvmeTierService
from cmx.config import ServiceConfig
from cmx.doors import DropSource
from cmx.errors import UnavailableError
from cmx.links import RAY_NAMESPACE, RayLink, actor_name
from cmx.operate.degraded import Fallback, describe
from cmx.operate.store_dirs import NodeDisk, Orphan
from cmx.stats import AgentStats, TierStats
from cmx.tiers import Tier, node_tiers, tier_spec, tier_specs

__all__ = ["alive_nodes", "ensure_service", "node_actors", "restart_agent", "service_ready",
           "stop_service", "wait_for_service"]

log = logging.getLogger(__name__)

_RESTART = {"max_restarts": -1, "max_task_retries": 0, "lifetime": "detached"}
_SERVICE_WIDE = {"namespace": RAY_NAMESPACE, "get_if_exists": True, "num_cpus": 0, **_RESTART}
ORPHAN_SCAN_S = 60.0  # how often a tier lists (and ages out) unclaimed store directories


def _heartbeat(service: Any, every_s: float) -> None:
    _every(every_s, service.heartbeat)


def _every(every_s: float, call: Any) -> None:
    def loop() -> None:
        while True:
            time.sleep(every_s)
            try:
                call()
            except Exception:  # noqa: BLE001 - the next round tries again
                log.debug("%s failed", getattr(call, "__name__", call), exc_info=True)

    threading.Thread(target=loop, name=f"cmx-{getattr(call, '__name__', 'loop')}",
                     daemon=True).start()


class ArenaTierActor(ArenaTierService):
    """A memory tier of one node (``Holds.MEMORY``: HBM, DRAM, ...)."""

    def __init__(self, tier: Tier, node: str, config: ServiceConfig) -> None:
        spec = tier_spec(tier)
        super().__init__(
            tier, node, spec.capacity(config), config.block_bytes,
            RayLink(config.call_timeout_s), config.directory_shards, config.eviction,
            emulated=spec.emulated, lease_s=config.lease_s,
        )
        _heartbeat(self, config.heartbeat_s)


class NvmeTierActor(NvmeTierService):
    """An extents tier of one node (``Holds.EXTENTS``: NVMe, ...), on a store directory that
    outlives the Ray node id (the node's claim under the tier's folder, ``nvme_dir`` for NVMe,
    held while this actor runs: cmx.operate.store_dirs)."""

    def __init__(self, node: str, config: ServiceConfig, store_id: str | None = None,
                 tier: Tier = Tier.NVME) -> None:
        spec = tier_spec(tier)
        self.disk = NodeDisk(tier_folder(spec, config), node, store_id,
                             config.orphan_max_age_s)
        super().__init__(
            node, self.disk.root, spec.capacity(config),
            config.block_bytes, RayLink(config.call_timeout_s), config.directory_shards,
            config.eviction, segment_bytes=config.nvme_segment_bytes, lease_s=config.lease_s,
            tier=tier,
        )
        _heartbeat(self, config.heartbeat_s)
        _every(ORPHAN_SCAN_S, self.disk.scan)

    def orphans(self) -> list[Orphan]:
        return self.disk.orphans()

    def collect_orphans(self, older_than_s: float = 0.0) -> list[Orphan]:
        return self.disk.collect(older_than_s)

    def stats(self) -> TierStats:
        return replace(super().stats(), disk=self.disk.stats(), degraded=self.disk.degraded)

    def close(self) -> None:
        super().close()
        self.disk.release()


class AgentActor(OffloadAgent):
    """The node's agent as an actor: on its host, or on its DPU given the DPU's host parts
    (``parts``, made in the actor's process: ``dpu.agent.dpu_actor_parts``)."""

    def __init__(self, node: str, config: ServiceConfig,
                 parts: Callable[[str, ServiceConfig], HostParts] | None = None) -> None:
        super().__init__(node, config, RayLink(config.call_timeout_s),
                         None if parts is None else parts(node, config))
        self._note_placement()

    def _note_placement(self) -> None:
        """Where this actor runs, and whether it moves bytes between nodes at a fallback."""
        self.placed_on = ray.get_runtime_context().get_node_id()
        reason = getattr(self.transport, "fallback_reason", None)
        self.degraded = None if reason is None else \
            describe(Fallback.OBJECT_STORE_TRANSPORT, reason)
        if self.degraded:
            log.warning("agent of node %s moves bytes between nodes through Ray's object store: "
                        "%s", self.node, reason)

    def stats(self) -> AgentStats:
        return replace(super().stats(), placed_on=self.placed_on, degraded=self.degraded)

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
        self.agent_on: dict[str, str] = {}  # node -> the node its agent runs on (it, or its DPU)
        self.pool_generation = 0  # of the pool's membership view: grows, across restarts too
        self.unforgotten: dict[str, set[tuple[int, Tier]]] = {}  # node left -> shards to tell
        self.shard_watch = ShardWatch()  # shards silent where they were placed
        self._lock = threading.Lock()
        threading.Thread(target=self._loop, name="cmx-controller", daemon=True).start()

    def reconcile(self) -> dict[str, list[str]]:
        with self._lock:
            alive = {n["NodeID"]: n for n in alive_nodes()}
            try:  # first: a node whose actors cannot start must not keep a shard down
                shards = self._keep_shards(alive)
            except Exception as exc:  # noqa: BLE001 - tried again next round
                log.warning("directory shards not started: %s", exc)
                shards = []
            started = []
            for node_id, node in alive.items():
                if node_id not in self.known and not _is_dpu(node, self.config):
                    start_node_actors(node_id, self.config, alive)
                    started.append(node_id)
            gone = sorted((self.known | self.pool) - alive.keys())
            for node_id in gone:
                self._forget(node_id)
            self._drop_forgotten()
            self.known = {n for n in alive if not _is_dpu(alive[n], self.config)}
            moved = self._place_agents(alive)
            pool = self._reconcile_pool(alive)
            return {"started": started, "gone": gone, "nodes": sorted(self.known),
                    "pool": pool, "agents_moved": moved,
                    "shards_started": [actor_name("dir", i) for i in shards]}

    def _keep_shards(self, alive: dict[str, dict[str, Any]]) -> list[int]:
        """Start each shard not running (one lost with its node) away from the nodes a shard
        was silent on, and stop those silent too long where they run: the next round starts
        them elsewhere (``directory.placement``). Returns the shards started."""
        avoid = self.shard_watch.avoid()
        shards = start_shards(self.config, alive, _SERVICE_WIDE, avoid)
        self.shard_watch.started({i: shard_node(i, self.config, alive, avoid) for i in shards})
        for shard in self.shard_watch.heard(ping_shards(self.config)):
            stop_shard(shard)
        return shards

    def _place_agents(self, alive: dict[str, dict[str, Any]]) -> list[str]:
        """Move each agent whose node's DPU joined or left since it was placed (a DPU that
        boots after its host takes the host's agent over); returns the nodes moved."""
        moved = []
        for node_id in sorted(self.known):
            want = _dpu_of(node_id, self.config, alive) or node_id
            have = self.agent_on.get(node_id) or _placed_on(node_id, self.config)
            if have is not None and have != want:
                log.warning("moving the agent of node %s from %s to %s", node_id, have, want)
                restart_agent(node_id, self.config, alive)
                moved.append(node_id)
            self.agent_on[node_id] = want
        for node_id in set(self.agent_on) - self.known:
            del self.agent_on[node_id]
        return moved

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
            # Wall-clock nanoseconds: a restarted controller's views are newer than its
            # predecessor's, which the pool nodes may have seen (``pool.rebalance``).
            self.pool_generation = max(self.pool_generation + 1, time.time_ns())
            for node_id in members:  # re-replicate in the background; nobody waits on it
                ray.get_actor(actor_name("pool", node_id), namespace=RAY_NAMESPACE) \
                    .rebalance.remote(members, self.config.pool_replication,
                                      self.pool_generation)
        return sorted(self.pool)

    def nodes(self) -> list[str]:
        return sorted(self.known)

    def pool_members(self) -> list[str]:
        return sorted(self.pool)

    def _forget(self, node_id: str) -> None:
        # Actors pinned to a node that left would wait forever for it to restart them.
        for kind in (*(t.value for t in node_tiers()), "agent", "pool"):
            try:
                ray.kill(ray.get_actor(actor_name(kind, node_id), namespace=RAY_NAMESPACE),
                         no_restart=True)
            except ValueError:
                pass
        self.unforgotten[node_id] = {(shard, spec.tier) for spec in tier_specs()
                                     for shard in range(self.config.directory_shards)}

    def _drop_forgotten(self) -> None:
        """Tell each shard to drop the copies of the nodes that left, every round until it
        has: a shard that did not answer would list them for as long as it runs."""
        link = RayLink(self.config.call_timeout_s)
        for node_id, shards in list(self.unforgotten.items()):
            for shard, tier in sorted(shards):
                try:
                    link.call(actor_name("dir", shard), DropSource(source=Source(node_id, tier)))
                except UnavailableError as exc:
                    log.warning("shard %d still lists %s's copies: %s", shard, node_id[:8], exc)
                    continue
                shards.discard((shard, tier))
            if not shards:
                del self.unforgotten[node_id]

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


def _dpu_of(node_id: str, config: ServiceConfig, alive: dict[str, dict[str, Any]]
            ) -> str | None:
    """The alive DPU node of ``node_id``'s host (same ``host_label`` value), if any."""
    host = (alive.get(node_id, {}).get("Labels") or {}).get(config.host_label)
    if host is None:
        return None
    for dpu_id, node in sorted(alive.items()):
        labels = node.get("Labels") or {}
        if config.dpu_label in labels and labels.get(config.host_label) == host:
            return dpu_id
    return None


def _agent_placement(
    node_id: str, config: ServiceConfig, alive: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Options placing a node's agent: on the node's DPU if one has joined, else on the node."""
    dpu = _dpu_of(node_id, config, alive)
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(dpu or node_id, soft=False)}


def _placed_on(node_id: str, config: ServiceConfig) -> str | None:
    """Where the running agent of ``node_id`` is (None: it does not answer)."""
    try:
        agent: Any = ray.get_actor(actor_name("agent", node_id), namespace=RAY_NAMESPACE)
        return str(ray.get(agent.placement.remote(), timeout=config.call_timeout_s)["placed_on"])
    except Exception:  # noqa: BLE001 - not running, or not answering: nothing to move
        return None


def _start_agent(node_id: str, config: ServiceConfig, alive: dict[str, dict[str, Any]]
                 ) -> Any:
    on_dpu = config.dpu_access == "nixl" and _dpu_of(node_id, config, alive)
    parts = dpu_actor_parts if on_dpu else None
    handle: Any = ray.remote(AgentActor).options(
        name=actor_name("agent", node_id), namespace=RAY_NAMESPACE, get_if_exists=True,
        num_cpus=0, max_concurrency=32, **_agent_placement(node_id, config, alive), **_RESTART,
    ).remote(node_id, config, parts)
    ray.get(handle.peer_info.remote(), timeout=60)
    return handle


def restart_agent(node_id: str, config: ServiceConfig, alive: dict[str, dict[str, Any]]
                  ) -> Any:
    """Close and kill the agent of ``node_id``, then start it where it belongs now."""
    name = actor_name("agent", node_id)
    try:
        old = ray.get_actor(name, namespace=RAY_NAMESPACE)
        ray.wait([old.close.remote()], timeout=config.call_timeout_s)
        ray.kill(old, no_restart=True)
    except ValueError:
        pass
    until_gone(name, 60.0)
    return _start_agent(node_id, config, alive)


def start_node_actors(
    node_id: str, config: ServiceConfig, alive: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Start (or find) the tier actors and the agent of one node; returns their handles.
    Each registered node tier is the actor of its kind (``cmx.tiers.Holds``)."""
    on_node = NodeAffinitySchedulingStrategy(node_id, soft=False)
    common = {"namespace": RAY_NAMESPACE, "get_if_exists": True, "num_cpus": 0, **_RESTART}
    labels = (alive or {}).get(node_id, {}).get("Labels") or {}
    handles: dict[str, Any] = {}
    for tier in node_tiers():
        options = ray.remote(ArenaTierActor if tier.spec.in_memory else NvmeTierActor).options(
            name=actor_name(tier.value, node_id), scheduling_strategy=on_node,
            max_concurrency=16, **common,
        )
        handles[tier.value] = (
            options.remote(tier, node_id, config) if tier.spec.in_memory
            else options.remote(node_id, config, labels.get(config.node_id_label), tier))
    # The agent maps the tiers' arenas when it starts: wait until they exist.
    ray.get([h.info.remote() for h in handles.values()], timeout=60)
    handles["agent"] = _start_agent(node_id, config, alive or {})
    return handles


def start_pool_actor(node_id: str, pool_id: str, config: ServiceConfig) -> Any:
    handle: Any = ray.remote(PoolNodeActor).options(
        name=actor_name("pool", node_id), namespace=RAY_NAMESPACE, get_if_exists=True,
        num_cpus=0, max_concurrency=16,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **_RESTART,
    ).remote(node_id, pool_id, config)
    ray.get(handle.peer_info.remote(), timeout=60)
    return handle


def ensure_service(config: ServiceConfig) -> Any:
    """Start the directory and the controller if they are not running; returns the controller."""
    start_shards(config, {n["NodeID"]: n for n in alive_nodes()}, _SERVICE_WIDE)
    controller: Any = ray.remote(Controller).options(
        name="cmx:controller", max_concurrency=4, **_SERVICE_WIDE
    ).remote(config)
    ray.get(controller.reconcile.remote(), timeout=180)
    return controller


def service_ready(node_id: str, timeout_s: float = 10.0) -> bool:
    """Whether the controller lists ``node_id`` and the node's agent answers."""
    try:
        controller = ray.get_actor("cmx:controller", namespace=RAY_NAMESPACE)
        if node_id not in ray.get(controller.nodes.remote(), timeout=timeout_s):
            return False
        agent = ray.get_actor(actor_name("agent", node_id), namespace=RAY_NAMESPACE)
        ray.get(agent.placement.remote(), timeout=timeout_s)
        return True
    except Exception:  # noqa: BLE001 - not started, restarting or not answering: not ready
        return False


def wait_for_service(node_id: str, timeout_s: float) -> None:
    """Return once the service serves ``node_id`` (someone else starts it); UnavailableError
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not service_ready(node_id, max(0.5, min(10.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            raise UnavailableError(
                f"the context memory service did not come up for node {node_id[:12]} within "
                f"{timeout_s:g} s (start it with `cmx up`, or connect with start_service=True)")
        time.sleep(0.5)


def node_actors(node_id: str) -> dict[str, Any]:
    out = {}
    for kind in (*(t.value for t in node_tiers()), "agent"):
        try:
            out[kind] = ray.get_actor(actor_name(kind, node_id), namespace=RAY_NAMESPACE)
        except ValueError:
            pass
    return out
