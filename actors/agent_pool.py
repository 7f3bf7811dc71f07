"""The agent writing blocks to the pool (G4): each block's owners pull it from DRAM here."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from cmx.actors.agent_base import AgentBase
from cmx.actors.arena_tier import Pinned
from cmx.actors.directory import Copy
from cmx.actors.links import actor_name
from cmx.actors.scheduler import Priority
from cmx.errors import UnavailableError
from cmx.keys import BlockHash
from cmx.policies.rendezvous import owners
from cmx.protocol import Loaded, Offer, copy_tag
from cmx.tiers import Tier

__all__ = ["PoolWrites"]

log = logging.getLogger(__name__)

POOL_REFRESH_S = 2.0  # how long a view of the pool's membership is reused


class PoolWrites(AgentBase):
    _pool: list[str]
    _pool_checked: float

    def _admit(self, key: BlockHash) -> bool:
        self.pool_admission.record(key)
        return self.pool_admission.admit(key)

    def _pool_members(self) -> list[str]:
        now = time.monotonic()
        if now - self._pool_checked > POOL_REFRESH_S:
            try:
                self._pool = list(self.link.call("cmx:controller", "pool_members"))  # type: ignore[attr-defined]
            except UnavailableError:
                pass  # keep the last membership we saw
            self._pool_checked = now
        return self._pool

    def _pool_write(
        self, keys: Sequence[BlockHash], parents: dict[BlockHash, BlockHash | None],
        replicas: int, namespace: str = "",
    ) -> int:
        """Have each block's pool owners pull it from this node's DRAM; returns copies made.
        The pool nodes keep ``namespace`` (the blocks' namespace id; where it is "", the DRAM
        copy's) with them, on disk."""
        members = self._pool_members()
        if not members or not keys:
            return 0
        pins: list[Pinned | None] = self._call(Tier.DRAM, "pin", list(keys), self.owner)
        try:
            by_owner: dict[str, list[Offer]] = {}
            for key, p in zip(keys, pins):
                if p is None or p.epoch not in self._epochs:
                    continue
                region = self._epochs[p.epoch][0].arena
                offer = Offer(key, parents.get(key), region, p.slot, p.size, p.checksum,
                              copy_tag(namespace, p.namespace))
                for owner in owners(key, members, replicas):
                    by_owner.setdefault(owner, []).append(offer)
            made = 0
            me = actor_name("agent", self.node)
            for owner, offers in by_owner.items():
                try:
                    n = int(self.link.call(  # type: ignore[attr-defined]
                        actor_name("pool", owner), "ingest", me, offers,
                        timeout_s=self.config.load_timeout_s,
                    ))
                except Exception as exc:  # noqa: BLE001 - the pool failing never fails a store
                    log.warning("pool write to %s failed: %s", owner[:8], exc)
                    continue
                made += n
                self.moved["dram->pool"] += sum(o.size for o in offers[:n])
                self.moved_via[self.transport.name] += sum(o.size for o in offers[:n])
            return made
        finally:
            self._give_back(Tier.DRAM, unpin=[p.lease for p in pins if p is not None])

    def _pool_later(self, loaded: Sequence[Loaded], copies: Sequence[Sequence[Copy]],
                    namespace: str = "") -> None:
        """Blocks reused often enough and not yet pooled go to the pool in the background
        (where there is a pool: the load that called this does not wait to find out)."""
        for b in loaded:
            self.nvme_admission.record(b.key)
        todo = [b.key for b, c in zip(loaded, copies)
                if self._admit(b.key) and not any(x.tier is Tier.POOL for x in c)]
        if todo:
            self.scheduler.submit(
                Priority.DEMOTE,
                lambda: self._pool_write(todo, {}, self.config.pool_replication, namespace),
            )

