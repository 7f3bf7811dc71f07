"""The reader's side of a partial load over NIXL: ask the owner to expose a window of blocks'
selections (``slices.expose``), pull every range of them in one READ into a landing buffer
here, check each block's bytes against the checksum its owner took, and release.

Bytes that fail their checksum are a miss, and the owner's copy they came from is
quarantined, after the owner has let go of it (a pinned copy cannot be dropped at once).
Blocks the owner had no outbox room for come in the next window.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cmx.actors.slices.expose import ExposedSlice, Exposure, read_descriptors
from cmx.actors.transport.base import PeerInfo, TransferError, Transport
from cmx.buffers import aligned_empty
from cmx.checksum import checksum
from cmx.doors import ExposeSelection, QuarantineCopies, ReleaseSelection
from cmx.errors import UnavailableError
from cmx.keys import BlockHash
from cmx.selection import Runs, SlicedBlock
from cmx.tiers import Tier

__all__ = ["SlicePuller"]

log = logging.getLogger(__name__)


class SlicePuller:
    """Pulls selections from one owner actor (a peer agent or a pool node) over ``transport``.

    ``peer(actor, refresh)`` answers the owner's ``PeerInfo`` (cached unless ``refresh``);
    ``forget(actor)`` drops the cached one after a failed transfer (the owner may have
    restarted)."""

    def __init__(self, transport: Transport, link: Any, owner: str, timeout_s: float,
                 peer: Callable[[str, bool], PeerInfo], forget: Callable[[str], None]) -> None:
        self.transport = transport
        self.link = link
        self.owner = owner
        self.timeout_s = timeout_s
        self._peer = peer
        self._forget = forget

    def pull(self, actor: str, node: str, keys: Sequence[BlockHash],
             runs: Runs) -> list[SlicedBlock | None]:
        """The verified selections of ``keys`` the owner holds (None for the others)."""
        out: list[SlicedBlock | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        while todo:
            exposure: Exposure = self.link.call(actor, ExposeSelection(
                keys=[keys[i] for i in todo], runs=runs, owner=self.owner),
                timeout_s=self.timeout_s)
            held = [(todo[j], e) for j, e in enumerate(exposure.slices) if e is not None]
            if not held:
                break
            exposed = [e for _, e in held]
            try:
                landed = self._land(actor, exposed)
            except BaseException:
                self.link.tell(actor, ReleaseSelection(exposed=exposed))
                raise
            corrupt = [e for e, data in zip(exposed, landed) if checksum(data) != e.checksum]
            self._release(actor, exposed, wait=bool(exposure.later or corrupt))
            for (i, e), data in zip(held, landed):
                if e not in corrupt:
                    out[i] = SlicedBlock(keys[i], data, e.checksum, e.source_tier, node)
            if corrupt:
                self._quarantine(actor, node, corrupt)
            todo = [todo[j] for j in exposure.later]
        return out

    def _land(self, actor: str, exposed: list[ExposedSlice]) -> list[np.ndarray]:
        """Every range of ``exposed`` in one READ; each block's bytes, in order."""
        peer = self._peer(actor, False)
        if any(e.region not in {r.name for r in peer.regions} for e in exposed):
            peer = self._peer(actor, True)  # the owner registered a region since
        bases = {r.name: r.base for r in peer.regions}
        landing = aligned_empty(sum(e.nbytes for e in exposed))
        remote, local = read_descriptors(exposed, bases, landing.ctypes.data)
        try:
            self.transport.read_ranges(peer, remote, local, landing, self.timeout_s)
        except TransferError:
            self._forget(actor)
            raise
        out, at = [], 0
        for e in exposed:
            out.append(landing[at : at + e.nbytes])
            at += e.nbytes
        return out

    def _release(self, actor: str, exposed: list[ExposedSlice], wait: bool) -> None:
        if not wait:
            self.link.tell(actor, ReleaseSelection(exposed=exposed))
            return
        try:
            self.link.call(actor, ReleaseSelection(exposed=exposed), timeout_s=self.timeout_s)
        except UnavailableError:
            pass  # the owner restarted: its pins and outbox went with it

    def _quarantine(self, actor: str, node: str, corrupt: list[ExposedSlice]) -> None:
        """A copy in memory, held in place while read, is quarantined by the owner; a
        selection from NVMe was checked against its chunks as it went into the outbox, so a
        mismatch here is the outbox slot's or the crossing's, and the disk copy stays."""
        by_tier: dict[Tier, list[BlockHash]] = {}
        for e in corrupt:
            if e.source_tier is Tier.NVME:
                log.warning("NVMe selection of %s from %s changed after its check: a miss",
                            e.key.hex()[:12], node[:8])
                continue
            by_tier.setdefault(e.source_tier, []).append(e.key)
        for tier, keys in by_tier.items():
            log.warning("%d %s selections from %s failed their checksum where they landed",
                        len(keys), tier.value, node[:8])
            self.link.tell(actor, QuarantineCopies(keys=keys, tier=tier))
