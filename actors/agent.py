"""The offload agent: one per node, the only component that moves block bytes.

It maps the node's HBM and DRAM arenas (shared memory, as a DPU reaches host memory by DMA),
owns the node's transport to other agents (NIXL over UCX, registered once, prepared
descriptor lists) and the NVMe data path (O_DIRECT, many I/Os in flight), and runs every move
through its scheduler: loads before prefetches before demotions.

Public calls, each bounded:

- ``grant_store(keys, parents, owner)`` / ``commit_store(keys, parents, done, ..., owner)``:
  a writer on this node (the client) copies blocks straight into the DRAM slots granted to
  it, once, between the two calls; the agent demotes what the grants evict and places what
  commits, holding it pinned for ``owner`` until placed (``agent_stores.py``).
- ``store(keys, parents, payload)``: blocks into this node's DRAM (evicted DRAM blocks demote
  to NVMe first, if NVMe admission lets them in); with write-through placement, admitted
  blocks go to NVMe as well. Returns when committed and visible to lookups.
- ``load(keys, copies, priority, owner, namespace)``: the longest prefix of ``keys`` into this
  node's HBM arena (tagged with the blocks' namespace id, so a namespace drop finds the copy
  after the directory restarts), each from its fastest copy, checksums verified for NVMe and
  network reads; the returned slots are pinned (leases of ``owner``) for the caller, who
  checks each block's checksum, reads them and calls ``release(leases, corrupt)``; a caller
  that stops waiting calls ``give_up(owner)``. Every copy goes into the arena of its grant's
  epoch.
- ``stage(keys, owner)`` / ``unstage(staged)``: for a peer agent: pin blocks in a memory arena
  here (promoting from NVMe if needed) so the peer can read them with one transfer.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from cmx.actors.agent_base import pin_tag
from cmx.actors.agent_fetch import RemoteFills, StagedAhead
from cmx.actors.agent_nvme import Extent, make_nvme_plane
from cmx.actors.agent_peers import PeerServing
from cmx.actors.agent_slices import SliceServing
from cmx.actors.agent_stores import Stores
from cmx.actors.arena_tier import ArenaInfo, Grant, Pinned
from cmx.actors.directory import Copy
from cmx.actors.links import actor_name
from cmx.actors.scheduler import Priority, Scheduler
from cmx.actors.transport import PeerInfo, TransferError, make_transport
from cmx.config import ServiceConfig
from cmx.errors import CmxError
from cmx.keys import BlockHash
from cmx.metrics import Histogram
from cmx.policies.admission import make_admission
from cmx.policies.placement import make_placement
from cmx.protocol import Loaded, LoadResult, copy_tag
from cmx.stats import AgentStats
from cmx.storage.arena import SharedArena
from cmx.tiers import Tier

__all__ = ["LoadResult", "Loaded", "OffloadAgent"]

log = logging.getLogger(__name__)



class OffloadAgent(RemoteFills, PeerServing, Stores, SliceServing):
    def __init__(self, node: str, config: ServiceConfig, link: object) -> None:
        self.node = node
        self.config = config
        self.link = link
        self.name = f"cmx-agent-{node[:12]}-{uuid.uuid4().hex[:6]}"
        self.scheduler = Scheduler(
            config.agent_workers, config.agent_queue_bound, config.staging_bytes
        )
        self.transport = make_transport(self.name, config.transport, self._fetch_from_peer)
        self.owner = f"agent:{self.name}"
        self._arenas: dict[Tier, tuple[ArenaInfo, SharedArena]] = {}
        self._epochs: dict[str, tuple[ArenaInfo, SharedArena]] = {}
        self._given_up: dict[str, float] = {}  # load owners that stopped waiting -> until
        self._peers: dict[str, PeerInfo] = {}
        self.moved: Counter[str] = Counter()  # "src->dst" -> bytes
        self.moved_via: Counter[str] = Counter()  # transport or "local"/"nvme" -> bytes
        self.dropped: Counter[str] = Counter()  # why evicted blocks were not demoted -> blocks
        self.commits: Counter[str] = Counter()  # a store's blocks "committed" or "refused"
        # "nvme_write": the bytes of a batch of NVMe writes; "nvme_books": the tier's reserve
        # and commit around them (the commit flushes: durable before announced).
        self.latency = {op: Histogram() for op in ("store", "load", "stage", "prefetch",
                                                   "grant_store", "nvme_write", "nvme_books")}
        self.corrupt: Counter[str] = Counter()  # where a copy failed its checksum -> blocks
        self.nvme = make_nvme_plane()
        self.pool_admission = make_admission("frequency", min_count=config.pool_admission_min_count)
        self.placement_policy = make_placement(config.placement)
        self.nvme_admission = make_admission("frequency",
                                             min_count=config.nvme_admission_min_count)
        self._pool: list[str] = []
        self._pool_checked = float("-inf")
        for tier in (Tier.HBM, Tier.DRAM):
            self._attach_when_up(tier)

    # -- load ----------------------------------------------------------------------------------

    def load(
        self, keys: Sequence[BlockHash], copies: Sequence[Sequence[Copy]],
        priority: Priority = Priority.LOAD, owner: str = "", namespace: str = "",
    ) -> LoadResult:
        """The longest prefix of ``keys`` pinned in HBM for ``owner`` (default: this agent);
        the caller reads the slots and ends the pins with ``release``, or they expire. The
        HBM copies made are tagged with ``namespace`` (the blocks' namespace id), or where the
        caller names none with the tag of the copy each was read from.

        Whatever fails part-way gives back what it was granted: a load never leaves a pin or
        a reservation behind but the returned prefix's."""
        start_time = time.perf_counter()
        owner = owner or self.owner
        sources = [self._sources(c) for c in copies]  # per key, fastest first
        held, ahead = self._acquire(keys, sources, copies, owner)
        hits = {i: p for i, p in enumerate(held) if isinstance(p, Pinned)}
        granted = {i: g for i, g in enumerate(held) if isinstance(g, Grant)}
        try:
            loaded: dict[int, Loaded] = {
                i: Loaded(keys[i], p.slot, p.size, Tier.HBM, self.node, "local", p.checksum,
                          p.lease, p.namespace)
                for i, p in hits.items()
            }
            if granted:
                loaded.update(self._fill_hbm(keys, sources, granted, priority, ahead, owner,
                                             namespace))
        except BaseException:
            self._give_back(Tier.HBM, unpin=[p.lease for p in hits.values()],
                            abort=[g.lease for g in granted.values()])
            raise
        finally:
            self._release_ahead(ahead)
        prefix: list[Loaded] = []
        for i in range(len(keys)):
            if i not in loaded:
                break
            prefix.append(loaded[i])
        tail = [b.lease for i, b in loaded.items() if i >= len(prefix)]
        if owner in self._given_up:  # the caller stopped waiting: nobody will release these
            tail, prefix = tail + [b.lease for b in prefix], []
        self._let_go(Tier.HBM, tail)
        self._pool_later(prefix, copies, namespace)
        op = "load" if priority is Priority.LOAD else "prefetch"
        self.latency[op].observe(time.perf_counter() - start_time)
        epoch = next((h.epoch for h in held if h is not None), self._arenas[Tier.HBM][0].epoch)
        return LoadResult(self._epochs[epoch][0].arena if epoch in self._epochs else "", prefix)

    def release(self, leases: Sequence[int], corrupt: Sequence[Loaded] = ()) -> None:
        """End the pins of a load's blocks; quarantine the copies the caller found corrupt
        (the HBM copy it read, and the copy that one was filled from). The quarantine goes
        first, while the HBM copies are pinned: a copy loaded after the unpin is not it."""
        if corrupt:
            self.corrupt["consumer"] += len(corrupt)
            self.quarantine(corrupt)
        self._call(Tier.HBM, "unpin", list(leases))

    def give_up(self, owner: str) -> int:
        """The caller of a load stopped waiting for it: give back what it holds now, and what
        the load pins later as it finishes. How many leases were given back now."""
        now = time.monotonic()
        self._given_up = {o: t for o, t in self._given_up.items() if t > now}
        self._given_up[owner] = now + self.config.load_timeout_s + self.config.call_timeout_s
        return int(self._call(Tier.HBM, "release_owner", owner))

    def quarantine(self, blocks: Sequence[Loaded]) -> None:
        """Drop copies found corrupt where they were used: in HBM, and at their source."""
        self._call(Tier.HBM, "quarantine", [b.key for b in blocks])
        by_source: dict[tuple[Tier, str], list[BlockHash]] = {}
        for b in blocks:
            if b.source_tier is not Tier.HBM or b.source_node != self.node:
                by_source.setdefault((b.source_tier, b.source_node), []).append(b.key)
        for (tier, node), keys in by_source.items():
            if node == self.node:
                self._call(tier, "quarantine", keys)
            else:
                kind = "pool" if tier is Tier.POOL else "agent"
                self.link.tell(actor_name(kind, node), "quarantine_copies", keys, tier)  # type: ignore[attr-defined]

    def prefetch(self, keys: Sequence[BlockHash], copies: Sequence[Sequence[Copy]],
                 namespace: str = "") -> int:
        """Move a prefix into HBM at prefetch priority and leave it cached there."""
        loaded = self.load(keys, copies, Priority.PREFETCH, namespace=namespace).blocks
        self._let_go(Tier.HBM, [b.lease for b in loaded])
        return len(loaded)

    def _fill_hbm(
        self, keys: Sequence[BlockHash], sources: Sequence[list[tuple[Tier, str]]],
        granted: dict[int, Grant], priority: Priority, ahead: StagedAhead, owner: str,
        namespace: str,
    ) -> dict[int, Loaded]:
        """Fill the granted HBM slots, each from its fastest copy; the filled ones pinned."""
        self._demote_victims(Tier.HBM, list(granted.values()))
        # Try each key's sources fastest first, round by round.
        options = {i: sources[i] for i in granted}
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
            self._call(Tier.HBM, "abort", failed)
        tags = {i: copy_tag(namespace, b.namespace) for i, b in filled.items()}
        commits = [(tags[i], (granted[i].lease, b.size, b.checksum)) for i, b in filled.items()]
        # A load's caller reads its blocks at once; other nodes learn of the copy a moment
        # later. A prefetch returns once lookups see it.
        pins = self._commit_tagged(Tier.HBM, commits, priority is not Priority.LOAD, owner)
        return {i: replace(b, lease=p.lease, namespace=tags[i])
                for (i, b), p in zip(filled.items(), pins) if p is not None}

    def _fill_from(
        self, tier: Tier, node: str, keys: Sequence[BlockHash], idx: list[int],
        granted: dict[int, Grant], priority: Priority, ahead: StagedAhead,
    ) -> dict[int, Loaded]:
        if tier is Tier.POOL:
            return self._fill_remote(actor_name("pool", node), node, keys, idx, granted, priority)
        if node != self.node:
            return self._fill_remote(actor_name("agent", node), node, keys, idx, granted,
                                     priority, ahead)
        pins = self._pin_local(tier, keys, idx, ahead)
        try:
            got = [(i, pin) for i, pin in zip(idx, pins) if pin is not None]
            ok = self._read_pinned(tier, [p for _, p in got], [granted[i] for i, _ in got],
                                   priority)
            out: dict[int, Loaded] = {}
            via = "nvme" if tier is Tier.NVME else "local"
            for (i, pin), good in zip(got, ok):
                if good:
                    out[i] = Loaded(keys[i], granted[i].slot, pin.size, tier, node, via,
                                    pin.checksum, namespace=pin_tag(pin))
                    self.moved[f"{tier.value}->hbm"] += pin.size
                    self.moved_via[via] += pin.size
            return out
        finally:
            self._let_go(tier, [p.lease for p in pins if p is not None])

    def _pin_local(self, tier: Tier, keys: Sequence[BlockHash], idx: list[int],
                   ahead: StagedAhead) -> list[Pinned | Extent | None]:
        """Pins of ``keys[idx]`` in this node's ``tier``: those taken ahead, and the rest."""
        pre: dict[int, Pinned | Extent | None] = {}
        if tier is Tier.DRAM:
            pre.update(ahead.take_local(idx))
        rest = [i for i in idx if i not in pre]
        pre.update(zip(rest, self._call(tier, "pin", [keys[i] for i in rest], self.owner)))
        return [pre[i] for i in idx]

    def _read_pinned(self, tier: Tier, pins: Sequence[Pinned | Extent], grants: Sequence[Grant],
                     priority: Priority) -> list[bool]:
        """Copy each block pinned in this node's ``tier`` into the front of its granted HBM
        slot; per block whether it checked out. NVMe reads are all in flight at once."""
        dsts = [self._arena(g.epoch).slot_view(g.slot) for g in grants]
        if tier is Tier.NVME:
            return self._read_extents([p for p in pins if isinstance(p, Extent)], dsts, priority)
        jobs = [self.scheduler.submit(priority, functools.partial(self._copy_local, p, dst))
                for p, dst in zip(pins, dsts) if isinstance(p, Pinned)]
        return [f.result() for f in jobs]

    def _copy_local(self, pin: Pinned, slot: np.ndarray) -> bool:
        """Copy one block pinned in this node's DRAM into the front of ``slot``."""
        src = self._arena(pin.epoch).slot_view(pin.slot)
        np.copyto(slot[: pin.size], src[: pin.size])
        return True

    # -- plumbing ------------------------------------------------------------------------------

    def stats(self) -> AgentStats:
        return AgentStats(
            agent=self.name, node=self.node, placed_on=self.node, transport=self.transport.name,
            moved_bytes=dict(self.moved), moved_via=dict(self.moved_via),
            dropped_blocks=dict(self.dropped), corrupt_blocks=dict(self.corrupt),
            store_commits={k: self.commits[k] for k in ("committed", "refused")},
            latency={op: h.snapshot() for op, h in self.latency.items()},
            queues=self.scheduler.stats(),
            transport_stats=replace(self.transport.stats,
                                    per_peer=dict(self.transport.stats.per_peer)),
            plane=self.nvme.stats(),
        )

    def _fetch_from_peer(self, peer_agent: str, slots: list[tuple[str, int]]) -> list[np.ndarray]:
        actor = next(a for a, p in self._peers.items() if p.agent == peer_agent)
        return self.link.call(actor, "read_slots", slots)  # type: ignore[attr-defined]

    def close(self) -> None:
        self.scheduler.close()
        self.transport.close()
        self.nvme.close()

