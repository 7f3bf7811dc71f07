"""What the admin API needs from the service, and its implementation over the running actors.

``Backend`` is the whole surface: the routes never touch Ray. ``ServiceBackend`` answers it
with a ``ContextMemory`` (stats, nodes, namespaces, directory lookups by key) and named-actor
calls through ``RayLink`` (a tier's pin/unpin/evict); unit tests pass a fake.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from cmx.actors.directory.shard import Copy
from cmx.actors.tiers.leases import ADMIN
from cmx.config import ServiceConfig
from cmx.doors import PinFor, ReleaseOwner, Request
from cmx.errors import CmxError, UnavailableError
from cmx.keys import BlockHash
from cmx.links import actor_name
from cmx.stats import ServiceStats
from cmx.tiers import Tier

R = TypeVar("R")

__all__ = ["Backend", "NotSupportedError", "ServiceBackend"]


class NotSupportedError(CmxError):
    """The running service has no such operation (an older version of it)."""


class Backend(Protocol):
    def stats(self) -> ServiceStats:
        """As ``ContextMemory.stats()``."""

    def nodes(self) -> list[str]:
        """Ids of the nodes the service runs on."""

    def copies(self, keys: Sequence[BlockHash]) -> list[list[Copy]]:
        """Every committed copy of each key (empty: a miss, or a shard that did not answer)."""

    def tier_call(self, node: str, tier: Tier, request: Request[R]) -> R:
        """``Contains``, ``Unpin`` or ``Evict`` on one node's tier actor."""

    def pin(self, node: str, tier: Tier, key: BlockHash, ttl_s: float) -> bool:
        """An operator's pin of ``key`` in one node's tier, held ``ttl_s`` seconds unless
        unpinned first (``LeasedPins.pin_for``); False if the block is not there."""

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

    def stats(self) -> ServiceStats:
        stats: ServiceStats = self.cm.stats()
        if stats.controller is not None:  # no node is listed: the API's 503, not empty figures
            raise UnavailableError(f"the service's controller: {stats.controller.reason}")
        return stats

    def nodes(self) -> list[str]:
        return list(self.cm.nodes())

    def copies(self, keys: Sequence[BlockHash]) -> list[list[Copy]]:
        return list(self.cm.copies(keys))

    def tier_call(self, node: str, tier: Tier, request: Request[R]) -> R:
        answer: R = self.link.call(actor_name(tier.value, node), request)
        return answer

    def pin(self, node: str, tier: Tier, key: BlockHash, ttl_s: float) -> bool:
        tier_actor, owner = actor_name(tier.value, node), f"{ADMIN}:{uuid.uuid4().hex}"
        try:
            pins = self.link.call(tier_actor, PinFor(keys=[key], ttl_s=ttl_s, owner=owner))
        except Exception:
            # A late pin, run before or after this release, would hold for ttl_s: the tier
            # gives it back, or refuses it (``Leases.grant_pin``).
            self.link.tell(tier_actor, ReleaseOwner(owner=owner))
            raise
        return bool(pins) and pins[0] is not None

    def drop_namespace(self, namespace_id: str) -> int:
        drop = getattr(self.cm, "drop_namespace", None)
        if drop is None:
            raise NotSupportedError("this version of the service cannot drop a namespace")
        return int(drop(namespace_id))
