"""A tier's books, chosen by what its copies are (``cmx.tiers.Holds``): the one rule that turns
a registered ``TierSpec`` into the control plane of one node's tier.

- a memory tier (HBM, DRAM, any tier that ``Holds.MEMORY``) is an ``ArenaTierService``;
- an extents tier (NVMe, any tier that ``Holds.EXTENTS``) is an ``NvmeTierService`` on a store
  directory of the node's under the spec's ``files``.

``make_books`` builds them in one process (a plane of tests, a harness); the service's actors
(``actors/service.py``) are these classes as Ray actors, given the same spec and config.
"""

from __future__ import annotations

import os
import time
from typing import Any

from cmx.actors.tiers.arena import ArenaTierService
from cmx.actors.tiers.leases import Clock
from cmx.actors.tiers.nvme import NvmeTierService
from cmx.config import ServiceConfig
from cmx.tiers import TierSpec

__all__ = ["Books", "make_books", "store_root", "tier_folder"]

Books = ArenaTierService | NvmeTierService


def tier_folder(spec: TierSpec, config: ServiceConfig) -> str:
    """The folder of an extents tier's files, each node's store directory under it (the
    service's actors claim theirs: ``cmx.operate.store_dirs``)."""
    if spec.files is None:
        raise ValueError(f"tier {spec.name!r} keeps no files")
    return spec.files(config)


def store_root(spec: TierSpec, node: str, config: ServiceConfig) -> str:
    """The store directory of ``node``'s extents tier ``spec`` in a plane of one process."""
    return os.path.join(tier_folder(spec, config), node)


def make_books(spec: TierSpec, node: str, config: ServiceConfig, link: Any,
               clock: Clock = time.monotonic, root: str | None = None) -> Books:
    """The books of ``node``'s tier ``spec``, publishing to the directory through ``link``;
    an extents tier's on ``root`` (default: ``store_root``)."""
    if spec.in_memory:
        return ArenaTierService(
            spec.tier, node, spec.capacity(config), config.block_bytes, link,
            config.directory_shards, config.eviction, emulated=spec.emulated,
            lease_s=config.lease_s, clock=clock)
    return NvmeTierService(
        node, root if root is not None else store_root(spec, node, config),
        spec.capacity(config), config.block_bytes, link, config.directory_shards,
        config.eviction, segment_bytes=config.nvme_segment_bytes, lease_s=config.lease_s,
        clock=clock, tier=spec.tier)
