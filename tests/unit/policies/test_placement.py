"""Placement: which tiers a stored block goes to, and where an evicted block goes next."""

from __future__ import annotations

import pytest

from cmx.policies import PLACEMENTS, Placement, WriteBack, WriteThrough, make_placement
from cmx.tiers import Tier


def test_tiers_are_named_and_ranked_fastest_first() -> None:
    assert [t.value for t in Tier] == ["hbm", "dram", "nvme", "pool"]
    assert [t.rank for t in Tier] == [0, 1, 2, 3]
    assert Tier("nvme") is Tier.NVME


def test_write_through_writes_below_at_once_if_admitted() -> None:
    wt = make_placement("write_through")
    assert isinstance(wt, WriteThrough) and wt.mode is Placement.WRITE_THROUGH
    assert wt.on_store(admitted=True) == (Tier.DRAM, Tier.NVME)
    assert wt.on_store(admitted=False) == (Tier.DRAM,)
    # the NVMe copy exists already: nothing to write on eviction
    assert wt.on_evict(Tier.DRAM, admitted=True, has_lower_copy=True) is None
    # stored before it was admitted, hot by the time DRAM evicts it: demote now
    assert wt.on_evict(Tier.DRAM, admitted=True, has_lower_copy=False) is Tier.NVME


def test_write_back_writes_below_only_on_eviction() -> None:
    wb = make_placement(Placement.WRITE_BACK)
    assert isinstance(wb, WriteBack)
    assert wb.on_store(admitted=True) == (Tier.DRAM,)
    assert wb.on_store(admitted=False) == (Tier.DRAM,)
    assert wb.on_evict(Tier.DRAM, admitted=True, has_lower_copy=False) is Tier.NVME
    assert wb.on_evict(Tier.DRAM, admitted=False, has_lower_copy=False) is None
    assert wb.on_evict(Tier.NVME, admitted=True, has_lower_copy=False) is None  # last tier


def test_a_longer_chain_demotes_one_tier_at_a_time() -> None:
    chain = (Tier.HBM, Tier.DRAM, Tier.NVME, Tier.POOL)
    wb = make_placement("write_back", chain=chain)
    assert [wb.below(t) for t in chain] == [Tier.DRAM, Tier.NVME, Tier.POOL, None]
    assert wb.on_store(admitted=True) == (Tier.HBM,)
    wt = make_placement("write_through", chain=("dram", "nvme", "pool"))
    assert wt.on_store(admitted=True) == (Tier.DRAM, Tier.NVME, Tier.POOL)
    assert wt.on_evict(Tier.NVME, admitted=True, has_lower_copy=False) is Tier.POOL


def test_bad_chains_and_names_are_refused() -> None:
    for chain in ((), (Tier.NVME, Tier.DRAM), (Tier.DRAM, Tier.DRAM), ("dram", "tape")):
        with pytest.raises(ValueError):
            make_placement("write_back", chain=chain)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown placement"):
        make_placement("write_around")
    with pytest.raises(ValueError, match="not in chain"):
        make_placement().on_evict(Tier.HBM, admitted=True, has_lower_copy=False)
    assert set(PLACEMENTS) == set(Placement)


def test_a_placement_is_a_frozen_value() -> None:
    wt = make_placement()
    assert wt == WriteThrough((Tier.DRAM, Tier.NVME))
    assert make_placement(wt) is wt
    with pytest.raises(AttributeError):
        wt.chain = (Tier.DRAM,)  # type: ignore[misc]
