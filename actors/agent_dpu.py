"""The offload agent on a DPU that reaches its host only over the network (``dpu_access="nixl"``).

A BlueField is a separate computer: it cannot map the host's shared memory or open the
host's NVMe files. This agent is the node's agent with its host-facing moves replaced: the
host's arenas are reached through ``NixlAccess`` (UCX, via the host's ``HostEndpoint``), NVMe
extents move on the host through the endpoint's NIXL POSIX backend, and the process refuses
to map a host arena or open a host file at all (``forbid_host_access``).

What it moves through NIXL: stores into DRAM, loads from this node's DRAM and NVMe, DRAM to
NVMe writes (write-through and write-back). What it does not: HBM to DRAM demotion (those
blocks are dropped, as a cache may drop any block, and counted), and serving or pulling
blocks between nodes (its transport has no host region registered: a peer's pull from it
fails and the peer loads from elsewhere or misses).
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cmx.actors.agent_base import KEEP_EPOCHS
from cmx.actors.arena_tier import Grant, Pinned
from cmx.actors.dpu_access import HostAccessForbidden, NixlAccess, forbid_host_access
from cmx.actors.dpu_host import RayEndpoint, host_endpoint_actor
from cmx.actors.links import RAY_NAMESPACE, actor_name
from cmx.actors.scheduler import Priority
from cmx.actors.service import AgentActor
from cmx.checksum import checksum
from cmx.config import ServiceConfig
from cmx.stats import AgentStats, HostAccessStats
from cmx.storage.nvme.chunks import block_sums
from cmx.storage.nvme.dataplane import Extent
from cmx.tiers import Tier

__all__ = ["DpuAgentActor", "start_host_endpoint"]

log = logging.getLogger(__name__)


class HostArena:
    """A host arena as this agent knows it: a name to address over NIXL, never memory."""

    def __init__(self, name: str) -> None:
        self.name = name

    def slot_view(self, slot: int) -> np.ndarray:
        raise HostAccessForbidden(
            f"no view of host arena {self.name}: this agent reaches its host through NIXL")


def start_host_endpoint(node: str, config: ServiceConfig) -> Any:
    """The host endpoint of ``node``, on ``node`` (started once, found after)."""
    return host_endpoint_actor().options(
        name=actor_name("host-endpoint", node), namespace=RAY_NAMESPACE, get_if_exists=True,
        max_concurrency=8, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(f"cmx-host-{node[:12]}-{uuid.uuid4().hex[:6]}")


class DpuAgentActor(AgentActor):
    def __init__(self, node: str, config: ServiceConfig) -> None:
        forbid_host_access()  # before anything could map or open what is the host's
        endpoint = RayEndpoint(start_host_endpoint(node, config), config.call_timeout_s)
        self.host = NixlAccess(f"cmx-dpu-{node[:12]}-{uuid.uuid4().hex[:6]}", endpoint,
                               timeout_s=config.load_timeout_s)
        super().__init__(node, config)

    # -- the host's arenas: names to address, never mapped -------------------------------------

    def _attach(self, tier: Tier) -> None:
        info = self.link.call(actor_name(tier.value, self.node), "info")
        if info.epoch in self._epochs:
            return
        self.host.attach(info)
        arena: Any = HostArena(info.arena)
        self._arenas[tier] = (info, arena)
        self._epochs[info.epoch] = (info, arena)
        of_tier = [e for e, (i, _) in self._epochs.items() if i.tier is tier]
        for old in of_tier[:-KEEP_EPOCHS]:
            del self._epochs[old]

    def _name(self, epoch: str) -> str:
        return self._arena(epoch).name

    # -- stores and local loads ----------------------------------------------------------------

    def _copy_in(
        self, grants: Sequence[Grant | None], payload: np.ndarray, size: int
    ) -> list[tuple[Grant, int, int]]:
        futures = []
        for i, grant in enumerate(grants):
            if grant is None:
                continue
            src = payload[i * size : (i + 1) * size]

            def copy(grant: Grant = grant, src: np.ndarray = src) -> tuple[Grant, int, int]:
                self.host.write(self._name(grant.epoch), grant.slot, src)
                return grant, src.nbytes, checksum(src)

            futures.append(self.scheduler.submit(Priority.DEMOTE, copy))
        return [f.result() for f in futures]

    def _read_pinned(self, tier: Tier, pins: Sequence[Pinned | Extent], grants: Sequence[Grant],
                     priority: Priority) -> list[bool]:
        """One NIXL move per block (the host's memory and files are out of reach here); an
        NVMe block that fails its checksum is quarantined at the tier."""
        jobs = [self.scheduler.submit(priority, functools.partial(self._read_local, tier, p, g))
                for p, g in zip(pins, grants)]
        ok = [f.result() for f in jobs]
        if tier is Tier.NVME and (bad := [p.key for p, good in zip(pins, ok) if not good]):
            self.corrupt["nvme"] += len(bad)
            self._call(Tier.NVME, "quarantine", bad)
        return ok

    def _read_local(self, tier: Tier, pin: Pinned | Extent, grant: Grant) -> bool:
        dst = self._name(grant.epoch)
        if isinstance(pin, Extent):
            self.host.read_extent(pin, dst, grant.slot)
            return checksum(self.host.read(dst, grant.slot, pin.size)) == pin.checksum
        self.host.copy((self._name(pin.epoch), pin.slot), (dst, grant.slot), pin.size)
        return True

    # -- DRAM to NVMe --------------------------------------------------------------------------

    def _slot_source(self, epoch: str, slot: int) -> tuple[str, int]:
        """A host slot by name (arena, slot): its bytes are read over NIXL."""
        return self._name(epoch), slot

    def _write_extents(self, extents: Sequence[Extent], sources: Sequence[Any]
                       ) -> list[tuple[int, bytes]]:
        """Each block's checksums from its bytes read over NIXL; the host endpoint writes it
        to its extent. HBM victims are not demoted here: mapping the host's HBM arena is
        forbidden, so those demotions fail and their blocks are dropped."""
        jobs = [self.scheduler.submit(Priority.DEMOTE,
                                      functools.partial(self._to_extent, ext, src, ext.size))
                for ext, src in zip(extents, sources)]
        return [f.result() for f in jobs]

    def _to_extent(self, ext: Extent, src: tuple[str, int], size: int) -> tuple[int, bytes]:
        """The block's checksums from its bytes read over NIXL; then the host writes it."""
        sums = block_sums(self.host.read(src[0], src[1], size))
        self.host.write_extent(ext, *src)
        return sums

    # -- plumbing ------------------------------------------------------------------------------

    def stats(self) -> AgentStats:
        host = HostAccessStats(self.host.name, self.host.bytes_read, self.host.bytes_written)
        return replace(super().stats(), host_access=host)

    def close(self) -> None:
        super().close()
        self.host.close()
