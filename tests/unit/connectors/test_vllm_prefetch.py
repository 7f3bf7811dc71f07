"""The scheduler side's lookup starts moving what it found outside this node's memory (here:
on NVMe) into it at once, once per request, against the in-process service plane."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from plane import Plane, make_plane
from vllm_plane import BOUND_S, LAYOUT, LEASE_S, NODE, T, client_of

from cmx.config import ServiceConfig
from cmx.connectors.settings import ConnectorSettings, Namespaces
from cmx.connectors.vllm_scheduler import SchedulerSide
from cmx.doors import Prefetch, Request
from cmx.links import LocalLink
from cmx.tiers import Tier

R = TypeVar("R")
BLOCK_BYTES = 8192


class PrefetchCountingLink(LocalLink):
    """Records the keys of every prefetch sent to an agent."""

    def __init__(self, targets: dict[str, Any]) -> None:
        super().__init__(targets)
        self.prefetched: list[list[bytes]] = []

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        if isinstance(request, Prefetch):
            self.prefetched.append(list(request.keys))
        return super().call(name, request)


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    config = ServiceConfig(block_bytes=BLOCK_BYTES, hbm_bytes=16 * BLOCK_BYTES,
                           dram_bytes=32 * BLOCK_BYTES, nvme_bytes=64 * BLOCK_BYTES,
                           nvme_dir=str(tmp_path), nvme_segment_bytes=16 * BLOCK_BYTES,
                           directory_shards=2, call_timeout_s=5.0, load_timeout_s=BOUND_S,
                           lease_s=LEASE_S, placement="write_through")
    p = make_plane(config, nodes=(NODE,), link_type=PrefetchCountingLink)
    yield p
    p.close()


def test_a_lookup_finding_nvme_only_blocks_prefetches_them_once_per_request(
    plane: Plane,
) -> None:
    link = plane.link
    assert isinstance(link, PrefetchCountingLink)
    namespaces = Namespaces(client_of(plane, plane.config), "m", LAYOUT, "w")
    side = SchedulerSide(ConnectorSettings(
        gate=False, lookup_wait_s=BOUND_S, prefetch=True), namespaces, T)
    prompt = list(range(1000, 1000 + 4 * T + 1))
    side.track("r1", prompt, None)
    ns = namespaces.get(side.requests["r1"].salt)
    ns.store(prompt[: 4 * T], LAYOUT.random_kv(4 * T, seed=1)).wait()  # DRAM and NVMe
    keys = ns.keys(prompt[: 4 * T])
    plane.tiers[(NODE, Tier.DRAM)].evict(keys)  # NVMe only
    assert all(b.tier is Tier.NVME for b in ns.lookup(prompt).blocks)

    assert side.matched_tokens("r1", 0) == 4 * T
    assert link.prefetched == [keys]
    assert plane.tiers[(NODE, Tier.HBM)].contains(keys) == [True] * 4  # moved here

    # Asked about again (preempted, say) with the blocks back on NVMe only: no second one.
    side.after_alloc("r1", 4 * T)
    plane.tiers[(NODE, Tier.HBM)].evict(keys)
    assert side.matched_tokens("r1", 0) == 4 * T
    assert link.prefetched == [keys]
    side.shutdown()


def test_a_lookup_finding_the_prefix_in_memory_here_prefetches_nothing(plane: Plane) -> None:
    link = plane.link
    assert isinstance(link, PrefetchCountingLink)
    namespaces = Namespaces(client_of(plane, plane.config), "m", LAYOUT, "w")
    side = SchedulerSide(ConnectorSettings(
        gate=False, lookup_wait_s=BOUND_S, prefetch=True), namespaces, T)
    prompt = list(range(2000, 2000 + 3 * T + 1))
    side.track("r2", prompt, None)
    ns = namespaces.get(side.requests["r2"].salt)
    ns.store(prompt[: 3 * T], LAYOUT.random_kv(3 * T, seed=2)).wait()
    assert side.matched_tokens("r2", 0) == 3 * T
    assert link.prefetched == []
    side.shutdown()
