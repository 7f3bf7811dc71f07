"""``PrefixAwareRouter``: Ray Serve's request router for the LLM replicas.

Serve's ``RequestRouter`` owns the mechanism (pending requests, queue-length probes, backoff,
fulfilment); this class fills its one hook, ``choose_replicas``. It takes Serve's default
fulfilment, not its FIFO mixin: the replica chosen for a request's prefix (or its pin) goes to
that request, not to whichever request waits first. For a request carrying
block keys it asks the directory shards where the prompt's prefix is (awaited, never blocking
the router's loop, bounded by ``lookup_timeout_s``: a late answer means no preference), prices
each replica with ``routing.rank_replicas`` from the figures the replicas report in their
routing stats, and returns the replicas best first, one per rank. Serve then probes the first
rank's queue and falls through to the next if that replica is full. A request pinned to a
replica (``GenerateRequest.replica``, for tests and benchmarks) goes there when it exists.

The router lives in the process of the handle's owner (the ingress), which lists the replicas
it routes to with ``routing.known_replicas``. Serve ships this module to that process by value
(cloudpickle), so state shared with the rest of the process lives in ``routing``, not here.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cmx.deploy.messages import GenerateRequest
from cmx.deploy.routing import CopySeen, ReplicaView, publish_replicas, rank_replicas

__all__ = ["PrefixAwareRouter"]

log = logging.getLogger(__name__)


class PrefixAwareRouter(RequestRouter):
    def initialize_state(
        self, block_tokens: int = 256, chunk_tokens: int = 256, directory_shards: int = 2,
        lookup_timeout_s: float = 0.25, **_: Any,
    ) -> None:
        self.block_tokens = block_tokens
        self.chunk_tokens = chunk_tokens
        self.directory_shards = directory_shards
        self.lookup_timeout_s = lookup_timeout_s
        self._shards: dict[int, Any] = {}
        self._rng = random.Random()
        self.last_routes: list[Any] = []  # the last ranking, for logs and tests

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        publish_replicas(self._deployment_id.name, [
            {"replica": r.replica_id.unique_id, "node": r.node_id or ""} for r in replicas])

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        req = _request_of(pending_request)
        if req is None or (not req.keys and req.replica is None):
            return [candidate_replicas]  # Serve picks the shortest queue among them
        if req.replica is not None:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == req.replica]
            if pinned:
                return [pinned]
        prefix = await self._where(req.keys) if req.use_cache else []
        views = [self._view(r) for r in candidate_replicas]
        routes = rank_replicas(views, prefix, self.block_tokens, len(req.prompt_ids),
                               self.chunk_tokens, self._rng)
        self.last_routes = routes
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[route.replica_id]] for route in routes]

    def _view(self, replica: RunningReplica) -> ReplicaView:
        stats = replica.routing_stats or {}
        queue = self.replica_queue_len_cache.get(replica.replica_id)
        prefill = stats.get("prefill")
        return ReplicaView(
            replica_id=replica.replica_id.unique_id, node=replica.node_id or "",
            queue_len=int(queue or 0), per_request_s=float(stats.get("per_request_s", 1.0)),
            prefill=tuple(prefill) if prefill else None,
            links={k: tuple(v) for k, v in (stats.get("links") or {}).items()},
            gating=bool(stats.get("gating", True)),
        )

    async def _where(self, keys: tuple[bytes, ...]) -> list[list[CopySeen]]:
        """Copies of the prompt's cached prefix, block by block; [] if the directory is late."""
        from cmx.actors.directory.shard import shard_of

        by_shard: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_shard.setdefault(shard_of(key, self.directory_shards), []).append(i)
        try:
            refs = {s: self._shard(s).lookup.remote([keys[i] for i in idx])
                    for s, idx in by_shard.items()}
            answers = await asyncio.wait_for(asyncio.gather(*refs.values()),
                                             timeout=self.lookup_timeout_s)
        except Exception as exc:  # noqa: BLE001 - no answer in time: route on queues alone
            log.info("directory lookup for routing failed: %s", exc)
            self._shards.clear()
            return []
        copies: list[list[Any]] = [[] for _ in keys]
        for shard, answer in zip(refs, answers):
            for i, found in zip(by_shard[shard], answer):
                copies[i] = found
        prefix = []
        for found in copies:
            if not found:
                break
            prefix.append([CopySeen(c.tier.value, c.node, c.size) for c in found])
        return prefix

    def _shard(self, shard: int) -> Any:
        import ray

        from cmx.links import RAY_NAMESPACE, actor_name

        if shard not in self._shards:
            self._shards[shard] = ray.get_actor(actor_name("dir", shard), namespace=RAY_NAMESPACE)
        return self._shards[shard]


def _request_of(pending: PendingRequest | None) -> GenerateRequest | None:
    if pending is None:
        return None
    for arg in pending.args:
        if isinstance(arg, GenerateRequest):
            return arg
    return None
