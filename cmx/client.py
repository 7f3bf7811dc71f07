"""``ContextMemory``: what a serving replica uses to store and find KV blocks cluster-wide.

    cm = ContextMemory.connect()                 # a Ray cluster of its own (or address=...)
    ns = cm.namespace(model="llama-3-8b", layout=KVLayout(...), salt="tenant-a")
    ns.store(token_ids, kv).wait()               # kv: [layers, 2, kv_heads, tokens, head_dim]
    ns.lookup(token_ids).num_tokens              # longest committed prefix, and where it is
    ns.load(token_ids)                           # its KV, moved from the fastest copies
    cm.shutdown()

Every call is bounded: a part of the service that does not answer in time makes a miss (a
shorter prefix), never a hang and never wrong bytes.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cmx.checksum import checksum
from cmx.config import ServiceConfig
from cmx.errors import CmxError, LayoutMismatchError, UnavailableError
from cmx.keys import BlockHash, Namespace, chain_keys, namespace_id
from cmx.layout import KVLayout
from cmx.links import RayLink
from cmx.operate.ray_cluster import DEFAULT_JOIN_TIMEOUT_S, join_or_start
from cmx.protocol import Copy, Loaded, Priority, actor_name, best_copy, shard_of
from cmx.selection import IndexSpec, Selection
from cmx.storage.arena import SharedArena
from cmx.tiers import Tier

__all__ = [
    "BlockLocation", "ContextMemory", "Match", "NamespaceClient", "StoreHandle", "copy_verified",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockLocation:
    key: BlockHash
    tier: Tier  # the fastest tier holding a copy
    node: str  # where that copy is
    copies: tuple[Copy, ...]


@dataclass(frozen=True)
class Match:
    """The longest committed prefix of a token sequence."""

    num_tokens: int
    blocks: tuple[BlockLocation, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class StoreHandle:
    """An asynchronous store; ``wait()`` returns once the blocks are committed and visible."""

    def __init__(self, ref: Any, num_blocks: int, timeout_s: float) -> None:
        self._ref = ref
        self.num_blocks = num_blocks
        self._timeout_s = timeout_s

    def wait(self, timeout_s: float | None = None) -> int:
        """Blocks committed by this store (already-present blocks are not stored again)."""
        if self._ref is None:
            return 0
        import ray

        return int(ray.get(self._ref, timeout=timeout_s or self._timeout_s))

    def done(self) -> bool:
        import ray

        if self._ref is None:
            return True
        ready, _ = ray.wait([self._ref], timeout=0)
        return bool(ready)


class ContextMemory:
    def __init__(self, config: ServiceConfig, node_id: str, owns_ray: bool) -> None:
        self.config = config
        self.node_id = node_id
        self._owns_ray = owns_ray
        self.link = RayLink(config.call_timeout_s)
        self._hbm: tuple[str, SharedArena] | None = None

    @classmethod
    def connect(
        cls, address: str | None = None, config: ServiceConfig | None = None,
        start_service: bool | Literal["wait"] = True,
        join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S, **ray_init: Any,
    ) -> ContextMemory:
        """Join the service on a Ray cluster, or on an embedded cluster of this process's own.

        Which cluster: the one this process is already connected to (a Serve replica, a Ray
        task), else ``address`` (host:port, ray://host:port, or "auto": the cluster ``ray start``
        last started here), else ``RAY_ADDRESS``, else a new local cluster started now, never
        one that already runs on the machine. Joining waits at most ``join_timeout_s`` for the
        cluster to answer (ClusterUnreachableError), with Ray's token authentication as
        ``ray start`` uses it. ``shutdown()`` stops the service and Ray only if this call
        started Ray.

        ``start_service``: True starts the service if it is not running (any number of
        processes may, at once: the first one's ``config`` wins); "wait" waits up to
        ``join_timeout_s`` for someone else to start it (UnavailableError after); False uses
        whatever runs. A client connected while the service is down gets misses, never a hang,
        and finds the service again once it returns (``ready()`` tells when).
        """
        import ray

        from cmx.actors.service import ensure_service, wait_for_service

        config = config or ServiceConfig.from_env()
        owns = False
        if not ray.is_initialized():
            owns = join_or_start(address, join_timeout_s, **ray_init)
        node_id = ray.get_runtime_context().get_node_id()
        if start_service == "wait":
            wait_for_service(node_id, join_timeout_s)
        elif start_service:
            ensure_service(config)
        return cls(config, node_id, owns)

    def ready(self) -> bool:
        """Whether the service runs and serves this client's node (its agent answers)."""
        from cmx.actors.service import service_ready

        return service_ready(self.node_id, self.config.call_timeout_s)

    def namespace(
        self, model: str, layout: KVLayout, salt: str = "", weights: str = "",
        replication: int | None = None,
    ) -> NamespaceClient:
        """A namespace; ``replication`` is how many pool nodes keep each of its pooled blocks
        (default ``config.pool_replication``)."""
        if layout.block_bytes > self.config.block_bytes:
            raise LayoutMismatchError(
                f"a block of this layout is {layout.block_bytes} bytes; the service's slots hold "
                f"{self.config.block_bytes} (ServiceConfig.block_bytes)"
            )
        if replication is not None and replication < 1:
            raise ValueError(f"replication must be >= 1, got {replication}")
        return NamespaceClient(self, Namespace(model, layout, salt, weights), replication)

    # -- cluster view --------------------------------------------------------------------------

    def nodes(self) -> list[str]:
        return list(self.link.call("cmx:controller", "nodes"))

    def stats(self) -> dict[str, Any]:
        """Per node: each tier's figures and the agent's; the directory's shards."""
        nodes: dict[str, Any] = {}
        for node in self.nodes():
            entry: dict[str, Any] = {"tiers": {}}
            for tier in (Tier.HBM, Tier.DRAM, Tier.NVME):
                try:
                    name = actor_name(tier.value, node)
                    entry["tiers"][tier.value] = self.link.call(name, "stats")
                except UnavailableError as exc:
                    entry["tiers"][tier.value] = {"error": str(exc)}
            try:
                entry["agent"] = self.link.call(actor_name("agent", node), "stats")
                entry["agent"]["placement"] = self.link.call(actor_name("agent", node), "placement")
            except UnavailableError as exc:
                entry["agent"] = {"error": str(exc)}
            nodes[node] = entry
        shards = []
        for shard in range(self.config.directory_shards):
            try:
                shards.append(self.link.call(actor_name("dir", shard), "stats"))
            except UnavailableError as exc:
                shards.append({"shard": shard, "error": str(exc)})
        return {"nodes": nodes, "directory": shards, "pool": self.pool_stats()}

    def pool_stats(self) -> dict[str, Any]:
        """The pool (G4): its nodes, capacity, use, and blocks with too few replicas."""
        members = list(self.link.call("cmx:controller", "pool_members"))
        nodes = []
        for node in members:
            try:
                nodes.append(self.link.call(actor_name("pool", node), "stats"))
            except UnavailableError as exc:
                nodes.append({"node": node, "error": str(exc)})
        want = min(self.config.pool_replication, len(members)) if members else 0
        pooled = under = 0
        for shard in range(self.config.directory_shards):
            try:
                counts = self.link.call(actor_name("dir", shard), "pool_replicas", want)
            except UnavailableError:
                continue
            pooled += counts["blocks"]
            under += counts["under_replicated"]
        return {
            "nodes": nodes,
            "replication": self.config.pool_replication,
            "capacity_bytes": sum(int(n.get("capacity_bytes", 0)) for n in nodes),
            "used_bytes": sum(int(n.get("used_bytes", 0)) for n in nodes),
            "blocks": pooled,
            "under_replicated": under,
        }

    def drop_namespace(self, namespace: Namespace | str) -> int:
        """Evict every unpinned copy of every block of a namespace; returns copies evicted.

        Blocks are found by the namespace tag the directory keeps. A block that only an NVMe
        tier held across a restart of that tier and of its directory shard has lost its tag
        and stays until evicted by capacity.
        """
        ns_id = namespace_id(namespace)  # an id, or the 64-hex digest: blocks carry the id
        by_holder: dict[tuple[Tier, str], list[BlockHash]] = {}
        for shard in range(self.config.directory_shards):
            try:
                found = self.link.call(actor_name("dir", shard), "namespace_blocks", ns_id)
            except UnavailableError:
                continue
            for key, copies in found:
                for c in copies:
                    by_holder.setdefault((c.tier, c.node), []).append(key)
        evicted = 0
        for (tier, node), keys in by_holder.items():
            try:
                evicted += int(self.link.call(actor_name(tier.value, node), "evict", keys))
            except UnavailableError:
                pass
        return evicted

    def shutdown(self, stop_service: bool | None = None) -> None:
        """Disconnect; stop the service too if asked (default: when we started Ray)."""
        import ray

        from cmx.actors.service import stop_service as stop

        if self._hbm is not None:
            self._hbm[1].close()
            self._hbm = None
        if stop_service if stop_service is not None else self._owns_ray:
            stop()
        if self._owns_ray:
            ray.shutdown()

    # -- used by namespaces --------------------------------------------------------------------

    def copies(self, keys: Sequence[BlockHash]) -> list[list[Copy]]:
        """Every committed copy of each key (empty: a miss, or a shard that did not answer);
        one batched call per shard, all in flight together."""
        import ray

        n = self.config.directory_shards
        by_shard: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_shard.setdefault(shard_of(key, n), []).append(i)
        refs = {}
        for shard, idx in by_shard.items():
            try:
                refs[shard] = self.link.submit(actor_name("dir", shard), "lookup",
                                               [keys[i] for i in idx])
            except UnavailableError:
                pass
        out: list[list[Copy]] = [[] for _ in keys]
        for shard, ref in refs.items():
            try:
                answer = ray.get(ref, timeout=self.config.call_timeout_s)
            except Exception as exc:  # noqa: BLE001 - an unreachable shard answers misses
                log.warning("directory shard %d did not answer: %s", shard, exc)
                continue
            for i, copies in zip(by_shard[shard], answer):
                out[i] = copies
        return out

    def _hbm_arena(self, name: str) -> SharedArena:
        if self._hbm is None or self._hbm[0] != name:
            if self._hbm is not None:
                self._hbm[1].close()
            self._hbm = (name, SharedArena.attach(name))
        return self._hbm[1]


class NamespaceClient:
    def __init__(
        self, cm: ContextMemory, namespace: Namespace, replication: int | None = None
    ) -> None:
        self.cm = cm
        self.namespace = namespace
        self.layout = namespace.layout
        self.replication = replication

    def keys(self, token_ids: object) -> list[BlockHash]:
        return chain_keys(self.namespace.digest, token_ids, self.layout.block_tokens)

    def store(self, token_ids: object, kv: Any, start: int = 0) -> StoreHandle:
        """Hand the full blocks of ``kv`` to this node's agent; returns at once.

        ``kv`` holds the KV of ``token_ids[start:]``; ``start`` is a multiple of the block
        size, so an engine that already stored a prefix hands over only what is new.
        """
        import ray
        import torch

        T = self.layout.block_tokens
        if start < 0 or start % T:
            raise LayoutMismatchError(f"start {start} is not a multiple of {T} tokens")
        keys = self.keys(token_ids)
        first = start // T
        self.layout.check_kv(kv)
        if first > len(keys) or kv.shape[3] < (len(keys) - first) * T:
            raise LayoutMismatchError(
                f"kv holds {kv.shape[3]} tokens from {start}; token_ids have "
                f"{len(keys) * T} in full blocks"
            )
        if first >= len(keys):
            return StoreHandle(None, 0, self.cm.config.call_timeout_s)
        new = keys[first:]
        payloads = self.layout.split_blocks(kv[:, :, :, : len(new) * T])
        payload = torch.cat(payloads).numpy()
        parents = [keys[first - 1] if first else None, *new[:-1]]
        ref = self.cm.link.submit(actor_name("agent", self.cm.node_id), "store", new, parents,
                                  ray.put(payload), self.namespace.id, self.replication)
        return StoreHandle(ref, len(new), self.cm.config.load_timeout_s)

    def lookup(self, token_ids: object) -> Match:
        keys = self.keys(token_ids)
        copies = self.cm.copies(keys) if keys else []
        blocks = []
        for key, found in zip(keys, copies):
            if not found:
                break
            best = best_copy(found, self.cm.node_id)
            blocks.append(BlockLocation(key, best.tier, best.node, tuple(found)))
        return Match(len(blocks) * self.layout.block_tokens, tuple(blocks))

    def load(self, token_ids: object, match: Match | None = None, layers: IndexSpec = None,
             heads: IndexSpec = None) -> Any:
        """KV [layers, 2, kv_heads, n, head_dim] of the longest loadable cached prefix.

        ``layers`` / ``heads`` (an index, a range or slice of step 1, consecutive indices):
        only those, [len(layers), 2, len(heads), n, head_dim], and only their bytes moved
        (``cmx.client_slices``); SelectionError for a selection outside the layout."""
        import torch

        if layers is not None or heads is not None:
            from cmx.client_slices import load_selection

            selection = Selection.of(self.layout, layers, heads)
            return load_selection(self, selection, match or self.lookup(token_ids))
        match = match or self.lookup(token_ids)
        T = self.layout.block_tokens
        out = torch.empty(self.layout.shape(match.num_blocks * T), dtype=self.layout.torch_dtype())
        window = self._window()
        blocks = list(match.blocks)
        loaded = 0
        for start in range(0, len(blocks), window):
            chunk = blocks[start : start + window]
            got = self._load_window(chunk, out, start)
            loaded += got
            if got < len(chunk):
                break
        return out[:, :, :, : loaded * T]

    def prefetch(self, token_ids: object) -> Any:
        """Start moving the cached prefix toward this node's HBM tier; returns an ObjectRef."""
        match = self.lookup(token_ids)
        if not match.blocks:
            return None
        blocks = list(match.blocks)[: self._window()]
        return self.cm.link.submit(
            actor_name("agent", self.cm.node_id), "prefetch",
            [b.key for b in blocks], [list(b.copies) for b in blocks],
        )

    def _window(self) -> int:
        """Blocks loaded per agent call: half the HBM tier, so loads stream through it."""
        return max(1, self.cm.config.hbm_bytes // self.cm.config.block_bytes // 2)

    def _load_window(self, blocks: list[BlockLocation], out: Any, first: int) -> int:
        """Load ``blocks`` into ``out`` from block index ``first``; returns how many arrived.

        The HBM pins the agent hands back are leases owned by this call alone: if the call
        gives up waiting, it tells the agent so, and what the load pins is given back."""
        import ray

        agent = actor_name("agent", self.cm.node_id)
        owner = f"client:{uuid.uuid4().hex}"
        try:
            ref = self.cm.link.submit(agent, "load", [b.key for b in blocks],
                                      [list(b.copies) for b in blocks], Priority.LOAD, owner)
            result = ray.get(ref, timeout=self.cm.config.load_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failed or late load is a miss
            log.warning("load failed: %s", exc)
            self.cm.link.tell(agent, "give_up", owner)
            return 0
        if not result.blocks:
            return 0
        intact = 0
        corrupt: list[Loaded] = []
        try:
            arena = self.cm._hbm_arena(result.arena)
            intact, corrupt = copy_verified(self.layout, arena, result.blocks, out, first)
        except (CmxError, OSError, ValueError) as exc:  # the HBM tier restarted: arena gone
            log.warning("load's arena %s is gone: %s", result.arena, exc)
        finally:
            self.cm.link.tell(agent, "release", [b.lease for b in result.blocks], corrupt)
        return intact


def copy_verified(layout: KVLayout, arena: SharedArena, blocks: Sequence[Loaded], out: Any,
                  first: int) -> tuple[int, list[Loaded]]:
    """Copy the blocks of a load out of ``arena`` into ``out`` (from block ``first``), each
    checked against its checksum before it is used; stops at the first that fails.
    Returns (blocks copied, the corrupt one if any)."""
    T = layout.block_tokens
    for i, b in enumerate(blocks):
        payload = arena.slot_view(b.slot)[: b.size]
        if checksum(payload) != b.checksum:
            log.warning("block %s failed its checksum where it was used", b.key.hex()[:12])
            return i, [b]
        block = layout.from_payload(payload)
        out[:, :, :, (first + i) * T : (first + i + 1) * T].copy_(block)
    return len(blocks), []
