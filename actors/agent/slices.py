"""The agent's partial loads: the selected bytes of blocks (some layers, some KV heads), from
whichever tier or node holds them, and only those bytes moved on.

- ``load_slices(keys, copies, runs)``: for this node's client. Each block from its fastest
  source: this node's tiers (HBM, DRAM, then NVMe, read as the chunks that cover the runs),
  then the other nodes that hold a copy (their agents), then the pool.
  Nothing is pinned after the call returns and nothing is promoted: a partial load leaves the
  tiers as it found them.
- ``expose_selection(keys, runs, owner)`` / ``release_selection(exposed)``: for a peer agent
  reading over NIXL: the selection of each block held here, verified and held in place
  (``slices.expose``) until the reader has pulled its ranges (``slices.pull``).
- ``read_selection(keys, runs)``: the same bytes by value, for a reader without NIXL.

Only the selection of each block crosses nodes: over NIXL, as the ranges of one transfer,
where both ends have it; through Ray's object store otherwise, a fallback that is logged and
counted (``moved_via["ray"]``). Each block is verified at its source before it is sliced and
carries the checksum of its slice (``cmx.selection``), checked where it lands.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from cmx.actors.agent.host import HostBytes
from cmx.actors.agent.scheduler import Priority, Scheduler
from cmx.actors.agent.shared import Counters, NodeTiers, Peers
from cmx.actors.slices.expose import ExposedSlice, Exposure, exposed_ranges
from cmx.actors.slices.pull import SlicePuller
from cmx.actors.tiers.arena import Pinned
from cmx.actors.transport.base import TransferError, Transport
from cmx.checksum import checksum
from cmx.config import ServiceConfig
from cmx.doors import PinExtents, QuarantineExtents, QuarantinePinned, ReadSelection
from cmx.errors import CmxError
from cmx.keys import BlockHash
from cmx.links import actor_name
from cmx.protocol import Copy
from cmx.selection import Runs, SlicedBlock, check_runs, runs_bytes
from cmx.storage.nvme.dataplane import Extent
from cmx.tiers import Tier, tier_spec

__all__ = ["SliceServing"]

log = logging.getLogger(__name__)

_LOCAL = "local"


class SliceServing:
    def __init__(self, node: str, config: ServiceConfig, tiers: NodeTiers, host: HostBytes,
                 peers: Peers, link: Any, transport: Transport, scheduler: Scheduler,
                 counters: Counters) -> None:
        self.node = node
        self.config = config
        self.tiers = tiers
        self.host = host  # where each copy is checked and sliced
        self.peers = peers
        self.link = link
        self.transport = transport
        self.scheduler = scheduler
        self.counters = counters
        self.owner = tiers.owner

    def load_slices(self, keys: Sequence[BlockHash], copies: Sequence[Sequence[Copy]],
                    runs: Runs) -> list[SlicedBlock]:
        """The selected bytes (``runs`` of each payload) of the longest prefix of ``keys``
        found, each from its fastest copy (``copies``, from the directory)."""
        for found in copies:
            for c in found[:1]:
                check_runs(runs, c.size)
        sources = [self._slice_sources(c) for c in copies]
        got: dict[int, SlicedBlock] = {}
        for rnd in range(max((len(s) for s in sources), default=0)):
            by_source: dict[tuple[str, str], list[int]] = {}
            for i, options in enumerate(sources):
                if i not in got and rnd < len(options):
                    by_source.setdefault(options[rnd], []).append(i)
            for (kind, node), idx in by_source.items():
                try:
                    answers = self._slices_from(kind, node, [keys[i] for i in idx], runs)
                except (CmxError, OSError) as exc:
                    log.warning("selection from %s@%s failed: %s", kind, node[:8], exc)
                    continue
                got.update((i, a) for i, a in zip(idx, answers) if a is not None)
        prefix = []
        for i in range(len(keys)):
            if i not in got:
                break
            prefix.append(got[i])
        return prefix

    def read_selection(self, keys: Sequence[BlockHash], runs: Runs) -> list[SlicedBlock | None]:
        """The selected bytes of each of ``keys`` that this node's tiers hold (None where they
        hold none, or only a corrupt copy, which is then quarantined)."""
        out = self._slice_memory(keys, runs)
        rest = [i for i, s in enumerate(out) if s is None]
        if rest:
            for i, s in zip(rest, self._slice_nvme([keys[i] for i in rest], runs)):
                out[i] = s
        return out

    def _slice_sources(self, copies: Sequence[Copy]) -> list[tuple[str, str]]:
        """Where to read a block's selection, fastest first: this node (any of its tiers; the
        directory may lag a demotion, so all are asked), then other nodes, memory before
        NVMe, then the pool."""
        here = any(c.node == self.node and tier_spec(c.tier).on_node for c in copies)
        best: dict[tuple[str, str], float] = {}
        for c in copies:
            if not tier_spec(c.tier).on_node:
                source = ("pool", c.node)
            elif c.node != self.node:
                source = ("agent", c.node)
            else:
                continue
            best[source] = min(best.get(source, c.tier.rank), c.tier.rank)
        remote = sorted(best, key=lambda s: (s[0] == "pool", best[s], s[1]))
        return ([(_LOCAL, self.node)] if here else []) + remote

    def _slices_from(self, kind: str, node: str, keys: list[BlockHash],
                     runs: Runs) -> list[SlicedBlock | None]:
        actor = actor_name(kind, node)
        via = None
        pulled = False  # over NIXL: each block already checked where it landed
        if kind == _LOCAL:
            found = self.read_selection(keys, runs)
        elif self._ranges_over_nixl(actor):
            via, pulled = self.transport.name, True
            found = SlicePuller(self.transport, self.link, self.owner,
                                self.config.load_timeout_s, self.peers.get,
                                self.peers.forget).pull(actor, node, keys, runs)
        else:
            via = "ray"
            found = self.link.call(actor, ReadSelection(keys=keys, runs=runs),
                                   timeout_s=self.config.load_timeout_s)
        out: list[SlicedBlock | None] = []
        for key, s in zip(keys, found):
            if (s is not None and not pulled
                    and (s.key != key or checksum(s.data) != s.checksum)):
                log.warning("selection of %s from %s@%s failed its checksum", key.hex()[:12],
                            kind, node[:8])
                s = None
            out.append(s)
            if s is not None:
                where = "" if kind == _LOCAL else "@peer" if kind == "agent" else "@pool"
                self.counters.moved[f"{s.source_tier.value}{where}->selection"] += s.data.nbytes
                if via is not None:
                    self.counters.moved_via[via] += s.data.nbytes
        return out

    def _ranges_over_nixl(self, actor: str) -> bool:
        """Whether a selection from ``actor`` travels over NIXL: both ends must have it. The
        fallback, by value through Ray's object store, is logged each time and counted."""
        if self.transport.reads_ranges:
            peer = self.peers.get(actor)
            if peer.transport == self.transport.name:
                return True
            reason = f"{actor} has no NIXL ({peer.transport})"
        else:
            reason = f"this agent has no NIXL ({self.transport.name})"
        log.warning("partial load from %s through Ray's object store: %s", actor, reason)
        return False

    # -- the owner's side of a partial load over NIXL --------------------------------------

    def expose_selection(self, keys: Sequence[BlockHash], runs: Runs, owner: str) -> Exposure:
        """The selection of each of ``keys`` held here, verified and held for ``owner`` to
        pull (``slices.expose``): memory copies pinned in place, NVMe copies read as the
        chunks that cover the runs into the outbox. A corrupt copy is quarantined here."""
        slices = self._expose_memory(keys, runs, owner)
        rest = [i for i, s in enumerate(slices) if s is None]
        later: list[int] = []
        if rest:
            found, deferred = self._expose_nvme([keys[i] for i in rest], runs, owner)
            for i, s in zip(rest, found):
                slices[i] = s
            later = [rest[j] for j in deferred]
        return Exposure(tuple(slices), tuple(later))

    def release_selection(self, exposed: Sequence[ExposedSlice]) -> None:
        """A reader pulled these (or gave up): end their pins and outbox leases."""
        box = self.host.made_outbox()
        boxed = [e.lease for e in exposed if box is not None and e.region == box.region.name]
        if boxed and box is not None:
            box.end(boxed)
        by_tier: dict[Tier, list[int]] = {}
        for e in exposed:
            if box is None or e.region != box.region.name:
                by_tier.setdefault(e.source_tier, []).append(e.lease)
        for tier, leases in by_tier.items():
            self.tiers.give_back(tier, unpin=leases)

    def _expose_memory(self, keys: Sequence[BlockHash], runs: Runs,
                       owner: str) -> list[ExposedSlice | None]:
        """Selections of blocks in this node's HBM and DRAM, each checked whole, left pinned
        for ``owner``."""
        out: list[ExposedSlice | None] = [None] * len(keys)
        answers = self.tiers.pin_memory(keys, owner)
        kept: set[int] = set()
        try:
            for tier, pins in answers:
                bad = []
                for i, p in enumerate(pins):
                    info = None if p is None else self.tiers.info(p.epoch)
                    if p is None or out[i] is not None or info is None:
                        continue
                    try:
                        sum_of_selection = self.host.pinned_selection_checksum(p, runs)
                    except TransferError as exc:  # this block's only: a miss, its copy intact
                        log.warning("selection of %s not exposed: %s", keys[i].hex()[:12], exc)
                        continue
                    if sum_of_selection is None:
                        bad.append(p)
                        continue
                    out[i] = ExposedSlice(keys[i], info.arena,
                                          exposed_ranges(p.slot * info.slot_bytes, runs),
                                          sum_of_selection, tier, p.lease)
                    kept.add(p.lease)
                if bad:  # while pinned: the copy read goes at its last unpin
                    log.warning("%d %s copies failed their checksum", len(bad), tier.value)
                    self.tiers.call(tier, QuarantinePinned(pins=bad))
        except BaseException:
            kept.clear()
            raise
        finally:
            for tier, pins in answers:
                self.tiers.give_back(tier, unpin=[p.lease for p in pins
                                                  if p is not None and p.lease not in kept])
        return out

    def _expose_nvme(self, keys: list[BlockHash], runs: Runs,
                     owner: str) -> tuple[list[ExposedSlice | None], list[int]]:
        """Selections of blocks only on this node's NVMe, read into outbox slots leased to
        ``owner``; and the positions of those left for later (no free slot)."""
        box = self.host.outbox()  # before anything is pinned: it may fail
        pins = self.tiers.call(Tier.NVME, PinExtents(keys=keys, owner=self.owner))
        out: list[ExposedSlice | None] = [None] * len(keys)
        later: list[int] = []
        bad: list[Extent] = []
        jobs = []
        try:
            for i, p in enumerate(pins):
                if p is None:
                    continue
                took = box.take(owner, keys[i])
                if took is None:
                    later.append(i)
                    continue
                slot, lease = took
                jobs.append((i, p, slot, lease, self.scheduler.submit(
                    Priority.LOAD, functools.partial(self.host.extent_into_outbox, p, runs,
                                                     box, slot))))
            for i, p, slot, lease, fut in jobs:
                try:
                    sum_of_selection: int | None = fut.result()
                except TransferError as exc:  # this block's only: a miss, its copy intact
                    log.warning("selection of %s not exposed: %s", keys[i].hex()[:12], exc)
                    box.end([lease])
                    continue
                if sum_of_selection is None:
                    box.end([lease])
                    bad.append(p)  # the copy read: one written since stays
                    continue
                nbytes = runs_bytes(runs)
                out[i] = ExposedSlice(keys[i], box.region.name, ((box.offset(slot), nbytes),),
                                      sum_of_selection, Tier.NVME, lease)
                self.counters.moved_via["nvme"] += nbytes
        except BaseException:
            for *_, fut in jobs:  # no slot is given back while a read into it may still run
                concurrent.futures.wait([fut])
            box.end([lease for _, _, _, lease, _ in jobs])
            raise
        finally:
            self.tiers.give_back(Tier.NVME, unpin=[p.lease for p in pins if p is not None])
        if bad:
            log.warning("%d NVMe copies failed a chunk checksum", len(bad))
            self.tiers.call(Tier.NVME, QuarantineExtents(extents=bad))
        return out, later

    def _slice_memory(self, keys: Sequence[BlockHash], runs: Runs) -> list[SlicedBlock | None]:
        """Selections of blocks in this node's HBM and DRAM arenas, each checked whole first."""
        out: list[SlicedBlock | None] = [None] * len(keys)
        answers = self.tiers.pin_memory(keys, self.owner)
        corrupt: dict[Tier, list[Pinned]] = {}
        try:
            for tier, pins in answers:
                for i, p in enumerate(pins):
                    if not isinstance(p, Pinned) or out[i] is not None:
                        continue
                    if self.tiers.info(p.epoch) is None:
                        continue
                    try:
                        data = self.host.pinned_selection(p, runs)
                    except TransferError as exc:  # this block's only: a miss, its copy intact
                        log.warning("selection of %s not read: %s", keys[i].hex()[:12], exc)
                        continue
                    if data is None:
                        corrupt.setdefault(tier, []).append(p)
                        continue
                    out[i] = SlicedBlock(keys[i], data, checksum(data), tier, self.node)
            # While pinned: the copy read goes at its last unpin, never one stored after it.
            for tier, bad in corrupt.items():
                log.warning("%d %s copies failed their checksum", len(bad), tier.value)
                self.tiers.call(tier, QuarantinePinned(pins=bad))
        finally:
            for tier, pins in answers:
                self.tiers.give_back(tier, unpin=[p.lease for p in pins if p is not None])
        return out

    def _slice_nvme(self, keys: list[BlockHash], runs: Runs) -> list[SlicedBlock | None]:
        """Selections of blocks on this node's NVMe: only the chunks that cover the runs."""
        pins = self.tiers.call(Tier.NVME, PinExtents(keys=keys, owner=self.owner))
        out: list[SlicedBlock | None] = [None] * len(keys)
        bad: list[Extent] = []
        try:
            jobs = [(i, p, self.scheduler.submit(
                        Priority.LOAD, functools.partial(self.host.extent_selection, p, runs)))
                    for i, p in enumerate(pins) if p is not None]
            for i, p, fut in jobs:
                try:
                    data: np.ndarray | None = fut.result()
                except TransferError as exc:  # this block's only: a miss, its copy intact
                    log.warning("selection of %s not read: %s", keys[i].hex()[:12], exc)
                    continue
                if data is None:
                    bad.append(p)  # the copy read: one written since stays
                    continue
                out[i] = SlicedBlock(keys[i], data, checksum(data), Tier.NVME, self.node)
                self.counters.moved_via["nvme"] += data.nbytes
        finally:
            self.tiers.give_back(Tier.NVME, unpin=[p.lease for p in pins if p is not None])
        if bad:
            log.warning("%d NVMe copies failed a chunk checksum", len(bad))
            self.tiers.call(Tier.NVME, QuarantineExtents(extents=bad))
        return out
