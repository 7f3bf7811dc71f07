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
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from cmx.client.namespaces import (
    BlockLocation,
    Match,
    NamespaceClient,
    StoreHandle,
    copy_payloads,
    copy_verified,
)
from cmx.client.node_plane import NodePlane
from cmx.config import ServiceConfig
from cmx.copy_table import CopyTable
from cmx.doors import Evict, FindCopies, NamespaceBlocks, Nodes
from cmx.errors import LayoutMismatchError, UnavailableError
from cmx.keys import KEY_BYTES, BlockHash, Namespace, namespace_id
from cmx.layout import KVLayout
from cmx.links import RayLink
from cmx.operate.ray_cluster import DEFAULT_JOIN_TIMEOUT_S, join_or_start
from cmx.protocol import Copy, actor_name, shards_of
from cmx.stats import ServiceStats, collect
from cmx.tiers import Tier

__all__ = [
    "BlockLocation", "ContextMemory", "Match", "NamespaceClient", "StoreHandle", "copy_payloads",
    "copy_verified",
]

log = logging.getLogger(__name__)


class ContextMemory:
    def __init__(self, config: ServiceConfig, node_id: str, owns_ray: bool) -> None:
        self.config = config
        self.node_id = node_id
        self._owns_ray = owns_ray
        self.link = RayLink(config.call_timeout_s)
        self.plane = NodePlane(self.link, node_id, config.call_timeout_s)  # this node's memory

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
        return list(self.link.call("cmx:controller", Nodes()))

    def stats(self) -> ServiceStats:
        """Per node each tier's figures and the agent's; the directory's shards; the pool.
        A part that did not answer in time is ``Unreachable`` in its place."""
        return collect(self.link, self.config.directory_shards, self.config.pool_replication)

    def drop_namespace(self, namespace: Namespace | str) -> int:
        """Evict every unpinned copy of every block of a namespace; returns copies evicted.

        Blocks are found by the namespace tag the directory keeps. Every copy a store or a
        load makes carries its block's tag (HBM, DRAM, NVMe, pool), and each tier reports it
        again when a restarted directory shard asks; NVMe tiers and pool nodes keep it on
        disk, so it outlives their own restarts too. docs/RELIABILITY.md names the few copies
        that carry none.

        A shard that does not answer, or is still learning its sources' copies (restarted, or
        resyncing one), cannot list the namespace whole, and a tier that does not answer keeps
        its copies: what could be is evicted, and then ``UnavailableError`` says the drop is
        not done (drop again), never a count that reads as success.
        """
        ns_id = namespace_id(namespace)  # an id, or the 64-hex digest: blocks carry the id
        by_holder: dict[tuple[Tier, str], list[bytes]] = {}
        short: list[str] = []  # why a shard's listing is missing or may be short
        for shard in range(self.config.directory_shards):
            try:
                found = self.link.call(actor_name("dir", shard), NamespaceBlocks(namespace=ns_id))
            except UnavailableError as exc:
                short.append(f"shard {shard}: {exc}")
                continue
            for key, copies in found:
                for c in copies:
                    by_holder.setdefault((c.tier, c.node), []).append(key)
        evicted = 0
        for (tier, node), keys in by_holder.items():
            try:
                evicted += int(self.link.call(actor_name(tier.value, node), Evict(keys=keys)))
            except UnavailableError as exc:
                short.append(f"{tier.value} of node {node[:8]}: {exc}")
        if short:
            raise UnavailableError(f"namespace {ns_id} was not dropped whole ({evicted} copies "
                                   f"evicted); drop it again: {'; '.join(short)}")
        return evicted

    def shutdown(self, stop_service: bool | None = None) -> None:
        """Disconnect; stop the service too if asked (default: when we started Ray)."""
        import ray

        from cmx.actors.service import stop_service as stop

        self.plane.close()
        if stop_service if stop_service is not None else self._owns_ray:
            stop()
        if self._owns_ray:
            ray.shutdown()

    # -- used by namespaces --------------------------------------------------------------------

    def copies(self, keys: Sequence[BlockHash]) -> list[list[Copy]]:
        """Every committed copy of each key (empty: a miss, or a shard that did not answer)."""
        return self.copy_table(keys).lists()

    def copy_table(self, keys: Sequence[BlockHash]) -> CopyTable:
        """``copies`` as one table (``cmx.copy_table``): one batched call per shard, all in
        flight together, each sending its keys in one buffer and answered by one table."""
        together = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), KEY_BYTES)
        shard_of_key = shards_of(together, self.config.directory_shards)
        refs = {}
        for shard in np.unique(shard_of_key).tolist():
            at = np.flatnonzero(shard_of_key == shard)
            try:
                refs[shard] = at, self.link.submit(actor_name("dir", shard),
                                                   FindCopies(keys=together[at].tobytes()))
            except UnavailableError:
                pass
        parts = []
        for shard, (at, ref) in refs.items():
            try:
                parts.append((at, self.link.result(ref, self.config.call_timeout_s)))
            except Exception as exc:  # noqa: BLE001 - an unreachable shard answers misses
                log.warning("directory shard %d did not answer: %s", shard, exc)
        return CopyTable.merge(parts, len(keys))
