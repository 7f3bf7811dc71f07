"""The agent's loads: the longest prefix of a request's blocks into this node's HBM, each from
its fastest copy, pinned for the caller.

- ``load(keys, copies, priority, owner, namespace, of_blocks)``: HBM is asked for the keys
  (hits pinned, slots granted for the rest) in the same round trip as the likely peer stages
  its blocks and this node's DRAM and NVMe pin their own (``RemoteFills.acquire``); the
  granted slots' victims are demoted (``Demotion``; a scan's, ``is_scan``, only those NVMe
  does not hold), the slots filled from this node's DRAM and NVMe (``LocalReads``), then from
  other nodes and the pool (``RemoteFills.fill``), and committed pinned for the caller. Every
  copy goes into the arena of its grant's epoch. A load from NVMe whose victims NVMe holds is
  three round trips to the tiers: acquire, which victims are held below, commit.
- ``release(leases, corrupt)``, ``give_up(owner)``, ``quarantine(blocks)``: how the caller
  ends its pins, stops waiting, or reports the blocks it found corrupt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from cmx.actors.agent.demote import Demotion
from cmx.actors.agent.fetch import RemoteFills, StagedAhead
from cmx.actors.agent.host import HostBytes
from cmx.actors.agent.inflight import Claim, InFlight
from cmx.actors.agent.pool import PoolWrites
from cmx.actors.agent.scheduler import Priority
from cmx.actors.agent.shared import Counters, NodeTiers, pin_tag
from cmx.actors.directory.shard import Copy
from cmx.actors.tiers.arena import Grant, Pinned
from cmx.actors.transport.base import TransferError
from cmx.config import ServiceConfig
from cmx.doors import (
    Abort,
    Pin,
    PinExtents,
    QuarantineCopies,
    QuarantineExtents,
    QuarantineKeys,
    ReleaseOwner,
    Unpin,
)
from cmx.errors import CmxError
from cmx.keys import BlockHash
from cmx.links import actor_name
from cmx.protocol import Loaded, LoadResult, copy_tag
from cmx.storage.nvme.dataplane import Extent
from cmx.tiers import Tier, tier_spec

__all__ = ["Loads", "LocalReads"]

log = logging.getLogger(__name__)


class LocalReads:
    """Blocks pinned in this node's DRAM or NVMe into granted HBM or DRAM slots, verified."""

    def __init__(self, tiers: NodeTiers, host: HostBytes, counters: Counters) -> None:
        self.tiers = tiers
        self.host = host
        self.counters = counters

    def read(self, tier: Tier, pins: Sequence[Pinned | Extent], grants: Sequence[Grant],
             priority: Priority) -> list[bool]:
        """Copy each block pinned in this node's ``tier`` into the front of its granted slot;
        per block whether it checked out. Extent reads (NVMe) are all in flight at once; a
        block that failed its checksum is quarantined at the tier (a miss here, never
        served)."""
        if tier_spec(tier).in_memory:
            memory = [(p, g) for p, g in zip(pins, grants) if isinstance(p, Pinned)]
            return self.host.read_memory([p for p, _ in memory], [g for _, g in memory],
                                         priority)
        reads = [(p, g) for p, g in zip(pins, grants) if isinstance(p, Extent)]
        extents = [p for p, _ in reads]
        ok = self.host.read_extents(extents, [g for _, g in reads], priority)
        if bad := [e for e, good in zip(extents, ok) if not good]:
            log.warning("%d %s blocks failed their checksum; quarantined", len(bad), tier.value)
            self.counters.corrupt[tier.value] += len(bad)
            self.tiers.call(tier, QuarantineExtents(extents=bad))  # these copies, not keys
        return ok


class Loads:
    def __init__(self, node: str, config: ServiceConfig, tiers: NodeTiers, link: Any,
                 reads: LocalReads, fills: RemoteFills, demotion: Demotion, pool: PoolWrites,
                 counters: Counters) -> None:
        self.node = node
        self.config = config
        self.tiers = tiers
        self.link = link
        self.reads = reads
        self.fills = fills
        self.demotion = demotion
        self.pool = pool
        self.counters = counters
        self._given_up: dict[str, float] = {}  # load owners that stopped waiting -> until
        self.in_flight = InFlight()  # keys being filled into HBM by a load or prefetch now

    def is_scan(self, of_blocks: int) -> bool:
        """Whether a window of a load of ``of_blocks`` blocks is a scan's: a load of more
        blocks than this node's HBM and DRAM hold together evicts the blocks it brings into
        HBM before it ends, and would evict from DRAM whatever of them it demoted there."""
        c = self.config
        return of_blocks > c.hbm_bytes // c.block_bytes + c.dram_bytes // c.block_bytes

    def load(
        self, keys: Sequence[BlockHash], copies: Sequence[Sequence[Copy]],
        priority: Priority = Priority.LOAD, owner: str = "", namespace: str = "",
        of_blocks: int = 0,
    ) -> LoadResult:
        """The longest prefix of ``keys`` pinned in HBM for ``owner`` (default: this agent);
        the caller reads the slots and ends the pins with ``release``, or they expire. The
        HBM copies made are tagged with ``namespace`` (the blocks' namespace id), or where the
        caller names none with the tag of the copy each was read from. ``of_blocks``: the
        blocks of the whole load these keys are a window of (0: these alone), for ``is_scan``.

        Whatever fails part-way gives back what it was granted: a load never leaves a pin or
        a reservation behind but the returned prefix's."""
        start_time = time.perf_counter()
        tiers = self.tiers
        owner = owner or tiers.owner
        sources = [self.fills.sources(c) for c in copies]  # per key, fastest first
        held, ahead, claims = self._acquire(keys, sources, copies, owner)
        hits = {i: p for i, p in enumerate(held) if isinstance(p, Pinned)}
        granted = {i: g for i, g in enumerate(held) if isinstance(g, Grant)}
        loaded: dict[int, Loaded] = {}  # the blocks filled here, committed and pinned
        try:
            try:
                if granted:
                    loaded.update(self._fill_hbm(keys, sources, granted, priority, ahead,
                                                 owner, namespace, self.is_scan(of_blocks)))
            finally:
                self.in_flight.end(claims)
            stop = next((i for i in granted if i not in loaded), len(keys))  # a failed fill
            taken = [i for i, h in enumerate(held[:stop]) if h is None]
            if taken:  # slots another fill of this agent holds: wait for it, pin its result
                hits.update(self._merge(keys, taken, owner, start_time))
            loaded.update({i: Loaded(keys[i], p.slot, p.size, Tier.HBM, self.node, "local",
                                     p.checksum, p.lease, p.namespace)
                           for i, p in hits.items()})
        except BaseException:
            pinned = {p.lease for p in hits.values()} | {b.lease for b in loaded.values()}
            tiers.give_back(Tier.HBM, unpin=sorted(pinned),
                            abort=[g.lease for i, g in granted.items() if i not in loaded])
            raise
        finally:
            self.fills.release_ahead(ahead)
        prefix: list[Loaded] = []
        for i in range(len(keys)):
            if i not in loaded:
                break
            prefix.append(loaded[i])
        tail = [b.lease for i, b in loaded.items() if i >= len(prefix)]
        if owner in self._given_up:  # the caller stopped waiting: nobody will release these
            tail, prefix = tail + [b.lease for b in prefix], []
        tiers.let_go(Tier.HBM, tail)
        self.pool.later(prefix, copies, namespace)
        op = "load" if priority is Priority.LOAD else "prefetch"
        self.counters.latency[op].observe(time.perf_counter() - start_time)
        epoch = next((h.epoch for h in held if h is not None), tiers.current(Tier.HBM)[0].epoch)
        info = tiers.info(epoch)
        return LoadResult(info.arena if info is not None else "", prefix)

    def _acquire(
        self, keys: Sequence[BlockHash], sources: Sequence[list[tuple[Tier, str]]],
        copies: Sequence[Sequence[Copy]], owner: str,
    ) -> tuple[list[Pinned | Grant | None], StagedAhead, list[Claim]]:
        """HBM's ``acquire`` of ``keys`` (``RemoteFills.acquire``), and the claims in flight
        of the keys it granted slots for, which the load ends once its fill is over. Every
        key is claimed before HBM reserves its slot: a load of the same key that asks HBM
        while the slot is reserved but not yet filled finds this fill to wait for."""
        claims = self.in_flight.start(keys)
        try:
            held, ahead = self.fills.acquire(keys, sources, copies, owner)
        except BaseException:
            self.in_flight.end(claims)
            raise
        self.in_flight.end([c for c, h in zip(claims, held) if not isinstance(h, Grant)])
        return held, ahead, [c for c, h in zip(claims, held) if isinstance(h, Grant)]

    def _merge(self, keys: Sequence[BlockHash], idx: list[int], owner: str,
               started: float) -> dict[int, Pinned]:
        """Pins of ``keys[idx]`` once the fills of this agent that hold their HBM slots are
        over (waited for within the load's bound); a fill that committed nothing pins nothing."""
        wanted = [keys[i] for i in idx]
        # Half the load's bound: the caller's own clock started before this call did.
        until = started + self.config.load_timeout_s / 2
        for event in self.in_flight.waits(wanted):
            if not event.wait(max(0.0, until - time.perf_counter())):
                break
        pins = self.tiers.call(Tier.HBM, Pin(keys=wanted, owner=owner))
        self.tiers.check_epoch(Tier.HBM, pins)
        return {i: p for i, p in zip(idx, pins) if p is not None}

    def release(self, leases: Sequence[int], corrupt: Sequence[Loaded] = ()) -> None:
        """End the pins of a load's blocks; quarantine the copies the caller found corrupt
        (the HBM copy it read, and the copy that one was filled from). The quarantine goes
        first, while the HBM copies are pinned: a copy loaded after the unpin is not it."""
        if corrupt:
            self.counters.corrupt["consumer"] += len(corrupt)
            self.quarantine(corrupt)
        self.tiers.call(Tier.HBM, Unpin(leases=list(leases)))

    def give_up(self, owner: str) -> int:
        """The caller of a load stopped waiting for it: give back what it holds now, and what
        the load pins later as it finishes. How many leases were given back now."""
        now = time.monotonic()
        self._given_up = {o: t for o, t in self._given_up.items() if t > now}
        self._given_up[owner] = now + self.config.load_timeout_s + self.config.call_timeout_s
        return int(self.tiers.call(Tier.HBM, ReleaseOwner(owner=owner)))

    def quarantine(self, blocks: Sequence[Loaded]) -> None:
        """Drop copies found corrupt where they were used: in HBM, and at their source."""
        self.tiers.call(Tier.HBM, QuarantineKeys(keys=[b.key for b in blocks]))
        by_source: dict[tuple[Tier, str], list[BlockHash]] = {}
        for b in blocks:
            if b.source_tier is not Tier.HBM or b.source_node != self.node:
                by_source.setdefault((b.source_tier, b.source_node), []).append(b.key)
        for (tier, node), keys in by_source.items():
            if node == self.node:
                self.tiers.call(tier, QuarantineKeys(keys=keys))
            else:
                kind = "agent" if tier_spec(tier).on_node else "pool"
                self.link.tell(actor_name(kind, node), QuarantineCopies(keys=keys, tier=tier))

    def prefetch(self, keys: Sequence[BlockHash], copies: Sequence[Sequence[Copy]],
                 namespace: str = "") -> int:
        """Move a prefix into HBM at prefetch priority and leave it cached there."""
        loaded = self.load(keys, copies, Priority.PREFETCH, namespace=namespace).blocks
        self.tiers.let_go(Tier.HBM, [b.lease for b in loaded])
        return len(loaded)

    def _fill_hbm(
        self, keys: Sequence[BlockHash], sources: Sequence[list[tuple[Tier, str]]],
        granted: dict[int, Grant], priority: Priority, ahead: StagedAhead, owner: str,
        namespace: str, scan: bool,
    ) -> dict[int, Loaded]:
        """Fill the granted HBM slots, each from its fastest copy; the filled ones pinned."""
        if scan:
            self.demotion.demote_scan_victims(list(granted.values()))
        else:
            self.demotion.demote_victims(Tier.HBM, list(granted.values()))
        # Try each key's sources fastest first, round by round.
        options = {i: ahead.nvme_first(i, sources[i], self.node) for i in granted}
        filled: dict[int, Loaded] = {}
        for rnd in range(max((len(o) for o in options.values()), default=0)):
            by_source: dict[tuple[Tier, str], list[int]] = {}
            for i, opts in options.items():
                if i not in filled and rnd < len(opts):
                    by_source.setdefault(opts[rnd], []).append(i)
            for (tier, node), idx in by_source.items():
                try:
                    filled.update(
                        self._fill_from(tier, node, keys, idx, granted, priority, ahead))
                except (CmxError, TransferError, OSError) as exc:
                    log.warning("load from %s@%s failed: %s", tier.value, node[:8], exc)
        if failed := [granted[i].lease for i in granted if i not in filled]:
            self.tiers.call(Tier.HBM, Abort(leases=failed))
        tags = {i: copy_tag(namespace, b.namespace) for i, b in filled.items()}
        commits = [(tags[i], (granted[i].lease, b.size, b.checksum)) for i, b in filled.items()]
        # A load's caller reads its blocks at once; other nodes learn of the copy a moment
        # later. A prefetch returns once lookups see it. A scan's window is not published: the
        # scan evicts it moments later; should another reader pin it first, the tier
        # publishes it then.
        pins = self.tiers.commit_tagged(Tier.HBM, commits, priority is not Priority.LOAD, owner,
                                        listed=not scan)
        return {i: replace(b, lease=p.lease, namespace=tags[i])
                for (i, b), p in zip(filled.items(), pins) if p is not None}

    def _fill_from(
        self, tier: Tier, node: str, keys: Sequence[BlockHash], idx: list[int],
        granted: dict[int, Grant], priority: Priority, ahead: StagedAhead,
    ) -> dict[int, Loaded]:
        if not tier_spec(tier).on_node:
            return self.fills.fill(actor_name("pool", node), node, keys, idx, granted, priority)
        if node != self.node:
            return self.fills.fill(actor_name("agent", node), node, keys, idx, granted,
                                   priority, ahead)
        pins = self._pin_local(tier, keys, idx, ahead)
        try:
            got = [(i, pin) for i, pin in zip(idx, pins) if pin is not None]
            ok = self.reads.read(tier, [p for _, p in got], [granted[i] for i, _ in got],
                                 priority)
            out: dict[int, Loaded] = {}
            via = "local" if tier_spec(tier).in_memory else tier.value
            for (i, pin), good in zip(got, ok):
                if good:
                    out[i] = Loaded(keys[i], granted[i].slot, pin.size, tier, node, via,
                                    pin.checksum, namespace=pin_tag(pin))
                    self.counters.count_move(f"{tier.value}->hbm", via, pin.size)
            return out
        finally:
            self.tiers.let_go(tier, [p.lease for p in pins if p is not None])

    def _pin_local(self, tier: Tier, keys: Sequence[BlockHash], idx: list[int],
                   ahead: StagedAhead) -> list[Pinned | Extent | None]:
        """Pins of ``keys[idx]`` in this node's ``tier``: those taken ahead, and the rest."""
        pre: dict[int, Pinned | Extent | None] = {}
        if tier is Tier.DRAM:
            pre.update(ahead.take_local(idx))
        elif tier is Tier.NVME:
            pre.update(ahead.take_nvme(idx))
        rest = [i for i in idx if i not in pre]
        wanted, owner = [keys[i] for i in rest], self.tiers.owner
        pins: list[Pinned | Extent | None] = list(self.tiers.call(
            tier, Pin(keys=wanted, owner=owner) if tier_spec(tier).in_memory
            else PinExtents(keys=wanted, owner=owner)))
        pre.update(zip(rest, pins))
        return [pre[i] for i in idx]

