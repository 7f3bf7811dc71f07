"""A block's namespace id travels with it to NVMe and is kept on disk: after the NVMe tier and the
directory restart, a namespace drop still finds the block; and the drop's evictions are durable
as soon as they are made, whatever happens to the tier next."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from plane import Plane, make_plane
from scenarios import blocks, check, small_config

from cmx.actors.directory import DirectoryShard
from cmx.actors.links import actor_name
from cmx.actors.nvme_tier import NvmeTierService
from cmx.keys import BlockHash
from cmx.tiers import Tier

NS = "0123456789abcdef"  # a namespace id, as blocks are tagged with


def reopen_nvme(plane: Plane, node: str, root: str) -> NvmeTierService:
    """A new NVMe tier of ``node`` on the store directory ``root``, as after a restart."""
    cfg = plane.config
    tier = NvmeTierService(node, root, cfg.nvme_bytes, cfg.block_bytes, plane.link,
                           cfg.directory_shards, segment_bytes=cfg.nvme_segment_bytes,
                           lease_s=cfg.lease_s, clock=plane.clock)
    plane.tiers[(node, Tier.NVME)] = plane.link._targets[actor_name("nvme", node)] = tier  # type: ignore[attr-defined]
    return tier


def restart_directory(plane: Plane) -> None:
    for i in range(len(plane.shards)):
        plane.shards[i] = plane.link._targets[actor_name("dir", i)] = DirectoryShard(i)  # type: ignore[attr-defined]


def tagged_on_nvme(plane: Plane, node: str) -> set[BlockHash]:
    out = set()
    for shard in plane.shards:
        for key, copies in shard.namespace_blocks(NS):
            if any(c.tier is Tier.NVME and c.node == node for c in copies):
                out.add(BlockHash(key))
    return out


@pytest.mark.parametrize("placement", ["write_back", "write_through"])
def test_blocks_on_nvme_keep_their_namespace_after_the_tier_and_the_directory_restart(
    tmp_path: Path, placement: str
) -> None:
    plane = make_plane(small_config(tmp_path, placement=placement, nvme_admission_min_count=1))
    try:
        keys, payload = blocks(12, seed=5)  # DRAM holds 8: the first are demoted (write-back)
        plane.agents["node-a"].store(keys, [None, *keys[:-1]], payload, NS)
        nvme = plane.tiers[("node-a", Tier.NVME)]
        on_nvme = {k for k, here in zip(keys, nvme.contains(keys)) if here}
        assert on_nvme, "nothing reached NVMe"
        root = nvme.store.root
        nvme.close()
        restart_directory(plane)
        nvme = reopen_nvme(plane, "node-a", root)
        assert nvme.heartbeat()  # first contact: the tier resyncs the new shards
        assert tagged_on_nvme(plane, "node-a") == on_nvme
        nvme.close()
        nvme = reopen_nvme(plane, "node-a", root)  # the directory kept, the tier restarted
        assert nvme.heartbeat()
        assert tagged_on_nvme(plane, "node-a") == on_nvme
        check(plane)
    finally:
        plane.close()


def test_a_drops_nvme_evictions_are_durable_before_the_tier_is_closed(tmp_path: Path) -> None:
    plane = make_plane(small_config(tmp_path, placement="write_through",
                                    nvme_admission_min_count=1))
    try:
        keys, payload = blocks(4, seed=6)
        plane.agents["node-a"].store(keys, [None, *keys[:-1]], payload, NS)
        nvme = plane.tiers[("node-a", Tier.NVME)]
        assert nvme.contains(keys) == [True] * 4
        assert nvme.evict(keys[2:]) == 2
        # The files as a crash now leaves them: the tier never closes (no snapshot at close).
        crashed = str(tmp_path / "crashed")
        shutil.copytree(nvme.store.root, crashed)
        again = reopen_nvme(plane, "node-a", crashed)
        assert again.contains(keys) == [True, True, False, False]
        again.check_integrity()
    finally:
        plane.close()
