"""The host's staging for partial loads through an agent on a DPU.

The host endpoint gathers a block's selection from NVMe into a slot of its staging region
(registered with NIXL), where the DPU or a peer reads it. The DPU agent keeps the slots'
leases (``HostOutbox``): a peer's exposures leave LOCAL_STAGING_SLOTS for the node's own
loads, and a slot whose gather may still land (its call timed out) stays out of use until
its lease expires.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from cmx.actors.dpu.forbid import HostAccessForbidden
from cmx.actors.slices.expose import SliceOutbox, outbox_slots
from cmx.actors.transport.base import Region
from cmx.keys import BlockHash

__all__ = ["LOCAL_STAGING_SLOTS", "HostOutbox", "host_staging_slots"]

LOCAL_STAGING_SLOTS = 2  # host staging slots a peer's exposures never take


def host_staging_slots(block_bytes: int) -> int:
    """A host endpoint's staging: an outbox's worth for peers, and the slots kept for this
    node's own partial loads."""
    return outbox_slots(block_bytes) + LOCAL_STAGING_SLOTS


class HostOutbox(SliceOutbox):
    """The outbox of partial loads from NVMe, in the host's memory: the endpoint's staging
    region, registered there; this agent keeps only its slots' leases.

    A gather into a slot whose call failed without an answer (a timeout) may still land
    there: the slot is ``doubted``, and its lease, however ended, keeps it out of use until
    it expires."""

    def __init__(self, region: Region, lease_s: float, local_owner: str) -> None:
        self._books(region, lease_s, time.monotonic)
        self._local_owner = local_owner  # this node's own partial loads
        self._slot_of: dict[int, int] = {}  # lease -> slot
        self._doubted: set[int] = set()  # slots whose last gather may still land

    def take(self, owner: str, key: BlockHash) -> tuple[int, int] | None:
        took = super().take(owner, key)
        if took is not None:
            with self._lock:
                self._slot_of[took[1]] = took[0]
        return took

    def _kept_from(self, owner: str) -> int:
        """Peers' exposures leave LOCAL_STAGING_SLOTS free for this node's own partial
        loads, which need a slot for each block they read from NVMe."""
        return 0 if owner == self._local_owner else LOCAL_STAGING_SLOTS

    def doubt(self, slot: int) -> None:
        with self._lock:
            self._doubted.add(slot)

    def end(self, leases: Sequence[int]) -> None:
        with self._lock:
            ending = [lease for lease in leases if self._slot_of.get(lease) not in self._doubted]
        super().end(ending)

    def _put_back(self, slot: int) -> Callable[[int], None]:
        put_back = super()._put_back(slot)

        def undo(lease: int) -> None:
            with self._lock:
                self._slot_of.pop(lease, None)
                self._doubted.discard(slot)
            put_back(lease)
        return undo

    def view(self, slot: int) -> np.ndarray:
        raise HostAccessForbidden(
            f"no view of host staging {self.region.name}: it is read through NIXL")
