"""The agent's partial loads: the selected bytes of blocks (some layers, some KV heads), from
whichever tier or node holds them, and only those bytes moved on.

- ``load_slices(keys, copies, runs)``: for this node's client. Each block from its fastest
  source: this node's tiers (HBM, DRAM, then NVMe, read as the chunks that cover the runs),
  then the other nodes that hold a copy (their agent's ``read_selection``), then the pool.
  Nothing is pinned after the call returns and nothing is promoted: a partial load leaves the
  tiers as it found them.
- ``read_selection(keys, runs)``: for a peer agent: the same, from this node's tiers only.

Bytes cross nodes through Ray's object store, only the selection of each block. Each block is
verified at its source before it is sliced and carries the checksum of its slice
(``cmx.selection``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import numpy as np

from cmx.actors.agent_base import AgentBase
from cmx.actors.arena_tier import Pinned
from cmx.actors.links import actor_name
from cmx.actors.scheduler import Priority
from cmx.actors.slice_reads import ExtentSlices, slice_memory
from cmx.checksum import checksum
from cmx.errors import CmxError
from cmx.keys import BlockHash
from cmx.protocol import Copy
from cmx.selection import Runs, SlicedBlock, check_runs
from cmx.storage.nvme.dataplane import Extent
from cmx.tiers import Tier

__all__ = ["SliceServing"]

log = logging.getLogger(__name__)

_LOCAL = "local"


class SliceServing(AgentBase):
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
        here = any(c.node == self.node and c.tier is not Tier.POOL for c in copies)
        best: dict[tuple[str, str], int] = {}
        for c in copies:
            if c.tier is Tier.POOL:
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
        if kind == _LOCAL:
            found = self.read_selection(keys, runs)
        else:
            found = self.link.call(actor_name(kind, node), "read_selection", keys, runs,
                                   timeout_s=self.config.load_timeout_s)
        out: list[SlicedBlock | None] = []
        for key, s in zip(keys, found):
            if s is not None and (s.key != key or checksum(s.data) != s.checksum):
                log.warning("selection of %s from %s@%s failed its checksum", key.hex()[:12],
                            kind, node[:8])
                s = None
            out.append(s)
            if s is not None:
                where = "" if kind == _LOCAL else "@peer" if kind == "agent" else "@pool"
                self.moved[f"{s.source_tier.value}{where}->selection"] += s.data.nbytes
        return out

    def _slice_memory(self, keys: Sequence[BlockHash], runs: Runs) -> list[SlicedBlock | None]:
        """Selections of blocks in this node's HBM and DRAM arenas, each checked whole first."""
        out: list[SlicedBlock | None] = [None] * len(keys)
        answers = self._pin_memory(keys, self.owner)
        corrupt: dict[Tier, list[Pinned]] = {}
        try:
            for tier, pins in answers:
                for i, p in enumerate(pins):
                    if not isinstance(p, Pinned) or out[i] is not None:
                        continue
                    if p.epoch not in self._epochs:
                        continue
                    payload = self._arena(p.epoch).slot_view(p.slot)[: p.size]
                    data = slice_memory(payload, p.checksum, runs)
                    if data is None:
                        corrupt.setdefault(tier, []).append(p)
                        continue
                    out[i] = SlicedBlock(keys[i], data, checksum(data), tier, self.node)
            # While pinned: the copy read goes at its last unpin, never one stored after it.
            for tier, bad in corrupt.items():
                log.warning("%d %s copies failed their checksum", len(bad), tier.value)
                self._call(tier, "quarantine_pinned", bad)
        finally:
            for tier, pins in answers:
                self._give_back(tier, unpin=[p.lease for p in pins if p is not None])
        return out

    def _slice_nvme(self, keys: list[BlockHash], runs: Runs) -> list[SlicedBlock | None]:
        """Selections of blocks on this node's NVMe: only the chunks that cover the runs."""
        pins: list[Extent | None] = self._call(Tier.NVME, "pin", keys, self.owner)
        reader = ExtentSlices(self.nvme)
        out: list[SlicedBlock | None] = [None] * len(keys)
        bad: list[Extent] = []
        try:
            jobs = [(i, p, self.scheduler.submit(Priority.LOAD,
                                                 functools.partial(reader.read, p, runs)))
                    for i, p in enumerate(pins) if p is not None]
            for i, p, fut in jobs:
                data: np.ndarray | None = fut.result()
                if data is None:
                    bad.append(p)  # the copy read: one written since stays
                    continue
                out[i] = SlicedBlock(keys[i], data, checksum(data), Tier.NVME, self.node)
                self.moved_via["nvme"] += data.nbytes
        finally:
            self._give_back(Tier.NVME, unpin=[p.lease for p in pins if p is not None])
        if bad:
            log.warning("%d NVMe copies failed a chunk checksum", len(bad))
            self._call(Tier.NVME, "quarantine_extents", bad)
        return out
