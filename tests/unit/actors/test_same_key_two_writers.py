"""Two writers that store different bytes under one key: what a load returns.

A block's key is its namespace (model, weights fingerprint, layout, salt) and its tokens, so
an engine computes the same bytes for it every time. A writer that breaks that (a test that
stores random KV under tokens an earlier run stored, on an NVMe store that outlived that run)
finds the tiers holding different bytes for one key: DRAM the newest writer's (its copy of
the first was lost with a restart), NVMe the first writer's (a block already on NVMe is not
written again). Every load returns, block by block, one writer's bytes whole, checked against
that writer's checksum, never a mix and never bytes nobody stored; which writer's depends on
the tier it is read from. The storm that kills memory tiers reports exactly this as "wrong"
when it is run again with the same tokens, salt and NVMe directory.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import ray
import torch
from plane import Plane, make_plane, namespace_client
from scenarios import LAYOUT, check, restart_tier, small_config
from writers import StoreLink

from cmx.client.namespaces import NamespaceClient
from cmx.tiers import Tier

NODE = f"twowriters-{uuid.uuid4().hex[:6]}"  # arenas named apart from other suites' on this host
T = LAYOUT.block_tokens


@pytest.fixture
def plane(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Plane]:
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)  # StoreLink answers itself
    p = make_plane(small_config(tmp_path, placement="write_through"), nodes=(NODE,),
                   link_type=StoreLink)
    yield p
    p.close()


def kv(seed: int, blocks: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(blocks * T), generator=g).to(LAYOUT.torch_dtype())


def writers_of(got: torch.Tensor, *written: torch.Tensor) -> list[int | None]:
    """Per block of ``got``: which of ``written`` it is, whole (None: none of them)."""
    out: list[int | None] = []
    for b in range(got.shape[3] // T):
        block = got[:, :, :, b * T : (b + 1) * T]
        out.append(next((i for i, w in enumerate(written)
                         if torch.equal(block, w[:, :, :, b * T : (b + 1) * T])), None))
    return out


def stored_in_dram(ns: NamespaceClient, plane: Plane) -> int:
    dram = plane.tiers[(NODE, Tier.DRAM)]
    return sum(dram.contains(ns.keys(TOKENS)))


TOKENS = np.arange(3 * T) + 7


def test_each_block_is_one_writers_bytes_whole_from_whichever_tier_holds_it(
    plane: Plane,
) -> None:
    ns = namespace_client(plane, NODE, LAYOUT, "t")
    first, second = kv(1, 3), kv(2, 3)
    assert ns.store(TOKENS, first).wait() == 3  # to DRAM and, written through, to NVMe
    restart_tier(plane, NODE, Tier.DRAM)  # DRAM's copies are gone, NVMe's stay
    assert ns.store(TOKENS, second).wait() == 3  # DRAM holds the second writer's now
    assert stored_in_dram(ns, plane) == 3

    from_dram = ns.load(TOKENS)
    assert writers_of(from_dram, first, second) == [1, 1, 1]

    plane.tiers[(NODE, Tier.DRAM)].evict(ns.keys(TOKENS))
    assert stored_in_dram(ns, plane) == 0
    from_nvme = ns.load(TOKENS)
    assert writers_of(from_nvme, first, second) == [0, 0, 0]  # the copy NVMe kept
    check(plane)
