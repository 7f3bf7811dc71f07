"""What the admin API needs from the service, and its implementation over the running actors.

``Backend`` is the whole surface: the routes never touch Ray. ``ServiceBackend`` answers it
with a ``ContextMemory`` (stats, nodes, namespaces) and named-actor calls through ``RayLink``
(directory lookups by key, a tier's pin/unpin/evict); unit tests pass a fake.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from cmx.actors.directory import Copy, shard_of
from cmx.actors.links import actor_name
from cmx.config import ServiceConfig
from cmx.errors import CmxError, UnavailableError
from cmx.keys import BlockHash
from cmx.tiers import Tier

__all__ = ["Backend", "NotSupportedError", "ServiceBackend"]


class NotSupportedError(CmxError):
    """The running service has no such operation (an older version of it)."""


class Backend(Protocol):
    def stats(self) -> dict[str, Any]:
        """As ``ContextMemory.stats()``: {"nodes": {node: {"tiers", "agent"}}, "directory",
        and "pool" where the service has one}."""

    def nodes(self) -> list[str]:
        """Ids of the nodes the service runs on."""

    def copies(self, keys: Sequence[BlockHash]) -> list[list[Copy]]:
        """Every committed copy of each key (empty: a miss, or a shard that did not answer)."""

    def tier_call(self, node: str, tier: Tier, method: str, keys: Sequence[BlockHash]) -> Any:
        """``pin``, ``unpin``, ``evict`` or ``contains`` on one node's tier actor."""

    def drop_namespace(self, namespace_id: str) -> int:
        """Evict every block of a namespace; NotSupportedError if the service cannot."""


class ServiceBackend:
    """The API's view of the running service. Thread-safe: routes run in a thread pool."""

    def __init__(self, cm: Any) -> None:
        self.cm = cm  # a connected cmx.ContextMemory
        self.link = cm.link

    @classmethod
    def connect(cls, address: str | None, config: ServiceConfig) -> ServiceBackend:
        """Join the cluster (unless this process already has) without starting the service."""
        from cmx.client import ContextMemory

        return cls(ContextMemory.connect(address=address, config=config, start_service=False))

    @property
    def num_shards(self) -> int:
        return int(self.cm.config.directory_shards)

    def stats(self) -> dict[str, Any]:
        return dict(self.cm.stats())

    def nodes(self) -> list[str]:
        return list(self.cm.nodes())

    def copies(self, keys: Sequence[BlockHash]) -> list[list[Copy]]:
        import ray

        by_shard: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_shard.setdefault(shard_of(key, self.num_shards), []).append(i)
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
                answer = ray.get(ref, timeout=self.link.timeout_s)
            except Exception:  # noqa: BLE001 - a shard that does not answer is a miss
                continue
            for i, found in zip(by_shard[shard], answer):
                out[i] = list(found)
        return out

    def tier_call(self, node: str, tier: Tier, method: str, keys: Sequence[BlockHash]) -> Any:
        return self.link.call(actor_name(tier.value, node), method, list(keys))

    def drop_namespace(self, namespace_id: str) -> int:
        drop = getattr(self.cm, "drop_namespace", None)
        if drop is None:
            raise NotSupportedError("this version of the service cannot drop a namespace")
        return int(drop(namespace_id))
