"""KV heads shared across tensor-parallel degrees (``cmx.connectors.shards``), on a real plane:
what an engine of one degree stores, an engine of another loads exactly, each rank its own
heads, and the scheduler counts a block only when every head of it can be loaded."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from plane import Plane, make_plane
from scenarios import LAYOUT, check, small_config

from cmx.client import ContextMemory
from cmx.client.node_plane import NodePlane
from cmx.connectors.paged import PagedLayout, PagedSink, WriteGate, block_view
from cmx.connectors.settings import Namespaces
from cmx.connectors.shards import HeadPlan, HeadShards, ShardMatch, cut
from cmx.connectors.vllm_meta import CMXWorkerReport, LoadResult, RankReports, StoreResult
from cmx.errors import LayoutMismatchError

NODE = f"shards-{uuid.uuid4().hex[:6]}"
T, H = LAYOUT.block_tokens, LAYOUT.num_kv_heads  # 2 heads: TP=2 gives each rank one
ONE = dataclasses.replace(LAYOUT, num_kv_heads=1)


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path), nodes=(NODE,))
    yield p
    p.close()


def memory(plane: Plane) -> ContextMemory:
    cm = ContextMemory(plane.config, NODE, owns_ray=False)
    cm.link = plane.link  # type: ignore[assignment]
    cm.plane = NodePlane(plane.link, NODE, 5.0)
    return cm


def engine(plane: Plane, tp: int, rank: int | None, salt: str) -> HeadShards:
    """One salt's namespaces as a process of an engine at ``tp`` sees them (rank None: its
    scheduler)."""
    plan = HeadPlan.everything(H, tp) if rank is None else HeadPlan.of(H, tp, rank)
    layout = dataclasses.replace(LAYOUT, num_kv_heads=len(plan.local))
    shards = Namespaces(memory(plane), "m", layout, "w", plan).get(salt)
    assert isinstance(shards, HeadShards)
    return shards


def prompt(blocks: int, seed: int) -> tuple[list[int], torch.Tensor]:
    toks = [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, blocks * T)]
    return toks, LAYOUT.random_kv(len(toks), seed=seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # random bytes make NaNs, which equal nothing


def paged(heads: int, blocks: int = 8) -> list[torch.Tensor]:
    """vLLM CPU-layout caches, one a layer: [blocks, heads, T, 2 * head_dim]."""
    return [torch.zeros(blocks, heads, T, 2 * LAYOUT.head_dim, dtype=LAYOUT.torch_dtype())
            for _ in range(LAYOUT.num_layers)]


def read_back(caches: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The blocks ``ids`` of the paged caches as KV [layers, 2, heads, n * T, head_dim]."""
    out = []
    for cache in caches:
        view = block_view(cache, PagedLayout.VLLM_CPU, LAYOUT.head_dim)[ids]  # [n, h, 2, T, D]
        out.append(view.permute(2, 1, 0, 3, 4).reshape(2, view.shape[1], -1, LAYOUT.head_dim))
    return torch.stack(out)


def test_the_plans_split_heads_as_vllm_does() -> None:
    assert [HeadPlan.of(4, 2, r).local for r in range(2)] == [range(0, 2), range(2, 4)]
    # fewer heads than ranks: each head held by consecutive ranks, stored by the first
    plans = [HeadPlan.of(2, 4, r) for r in range(4)]
    assert [p.local for p in plans] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert [p.stores for p in plans] == [True, False, True, False]
    assert plans[0].storing_ranks == 2 and HeadPlan.of(4, 2, 0).storing_ranks == 2
    for bad in ((3, 2, 0), (2, 3, 0), (2, 2, 2), (0, 1, 0)):
        with pytest.raises((ValueError, LayoutMismatchError)):
            HeadPlan.of(*bad)


def test_a_tp1_store_loads_into_each_rank_of_a_tp2_engine(plane: Plane) -> None:
    toks, kv = prompt(3, seed=1)
    assert engine(plane, 1, 0, "a").store(toks, kv).wait() == 3
    assert engine(plane, 2, None, "a").lookup(toks).num_blocks == 3  # the scheduler's count
    for rank in range(2):
        ns = engine(plane, 2, rank, "a")
        match = ns.lookup(toks, here_first=True)
        assert match.whole and match.num_blocks == 3
        assert torch.equal(bits(ns.load(toks, match)), bits(kv[:, :, rank : rank + 1]))
        caches, ids = paged(1), [5, 0, 3]
        sink = PagedSink(caches, PagedLayout.VLLM_CPU, LAYOUT.head_dim, ids, WriteGate())
        assert ns.load_to(sink, toks, match) == 3
        assert torch.equal(bits(read_back(caches, ids)), bits(kv[:, :, rank : rank + 1]))
    check(plane)


def test_tp2_ranks_store_their_heads_and_a_tp1_engine_loads_them_whole(plane: Plane) -> None:
    toks, kv = prompt(3, seed=2)
    for rank in range(2):
        ns = engine(plane, 2, rank, "b")
        assert ns.store(toks, kv[:, :, rank : rank + 1]).wait() == 3
    assert engine(plane, 2, None, "b").lookup(toks).num_blocks == 3
    whole = engine(plane, 1, 0, "b")
    assert whole.whole.lookup(toks).num_blocks == 0  # nothing was stored whole...
    match = whole.lookup(toks, here_first=True)
    assert not match.whole and match.num_blocks == 3  # ...each head was
    assert torch.equal(bits(whole.load(toks, match)), bits(kv))
    caches, ids = paged(H), [7, 2, 4]
    sink = PagedSink(caches, PagedLayout.VLLM_CPU, LAYOUT.head_dim, ids, WriteGate())
    assert whole.load_to(sink, toks, match) == 3
    assert torch.equal(bits(read_back(caches, ids)), bits(kv))
    # a later slice of the prefix, as a worker loads what its engine lacks
    tail = cut(match, 1, 3)
    assert isinstance(tail, ShardMatch) and tail.num_blocks == 2
    assert all(p.num_blocks == 2 for p in tail.parts)
    check(plane)


def test_a_block_counts_only_when_every_head_of_it_is_held(plane: Plane) -> None:
    toks, kv = prompt(3, seed=3)
    assert engine(plane, 2, 0, "c").store(toks, kv[:, :, :1]).wait() == 3
    scheduler = engine(plane, 2, None, "c")
    assert scheduler.lookup(toks).num_blocks == 0  # head 1 of no block is held
    assert engine(plane, 2, 1, "c").store(toks[: 2 * T], kv[:, :, 1:, : 2 * T]).wait() == 2
    assert scheduler.lookup(toks).num_blocks == 2
    # a rank finds its own heads' prefix: rank 0 holds all three of its blocks
    assert engine(plane, 2, 0, "c").lookup(toks).num_blocks == 3
    # whole blocks of a longer prefix win over the heads'
    more, kv2 = prompt(3, seed=3)
    assert engine(plane, 1, 0, "c").store(more, kv2).wait() == 3
    assert scheduler.lookup(more).whole
    check(plane)


def test_a_rank_refuses_to_store_another_ranks_shape(plane: Plane) -> None:
    toks, kv = prompt(2, seed=4)
    with pytest.raises(LayoutMismatchError):
        engine(plane, 2, 0, "d").store(toks, kv)  # both heads, from a one-head rank
    assert engine(plane, 2, None, "d").lookup(toks).num_blocks == 0
    check(plane)


def test_rank_reports_join_each_end_of_every_rank() -> None:
    ranks = RankReports(loading=2, storing=2)
    a = StoreResult("r", 64, 64, 0, 0, 0)
    b = StoreResult("r", 64, 32, 32, 0, 1)
    assert ranks.stores([a]) == []  # one rank's end is not the store's
    assert ranks.stores([b]) == [StoreResult("r", 64, 32, 32, 0)]
    load = LoadResult("r", 64, 64, 100, 0.5, (("dram", 100),), 0, 0)
    short = LoadResult("r", 64, 32, 50, 0.7, (("nvme", 50),), 0, 1)
    joined = ranks.loads([load, short])
    assert [(j.loaded_tokens, j.nbytes, j.seconds) for j in joined] == [(32, 150, 0.7)]
    assert RankReports(1, 1).stores([a]) == [a]


def test_a_steps_reports_from_every_rank_are_kept() -> None:
    mine = CMXWorkerReport(stores=[StoreResult("r", 64, 64, 0, 0)], handed={"r": 64},
                           step_s=0.1, computed=[(0, 64)])
    theirs = CMXWorkerReport(stores=[StoreResult("r", 64, 64, 0, 0)], handed={"r": 64},
                             dropped={"s": 32}, step_s=0.2)
    joined: Any = mine.aggregate(theirs)
    assert len(joined.stores) == 2 and joined.handed == {"r": 64}
    assert joined.dropped == {"s": 32} and joined.step_s == 0.2
    assert joined.computed == [(0, 64)]


def scheduler(plane: Plane, tp: int) -> Any:
    from cmx.connectors.settings import ConnectorSettings
    from cmx.connectors.vllm_scheduler import SchedulerSide

    plan = HeadPlan.everything(H, tp)
    layout = dataclasses.replace(LAYOUT, num_kv_heads=H // tp)
    settings = ConnectorSettings(gate=False, lookup_wait_s=30.0, load_mode="sync",  # type: ignore[arg-type]
                                 prefetch=False)
    return SchedulerSide(settings, Namespaces(memory(plane), "m", layout, "w", plan), T,
                         ranks=(tp, plan.storing_ranks))


def scheduled(side: Any, req_id: str, ids: list[int], computed: int, scheduled: int) -> Any:
    from types import SimpleNamespace

    from vllm.v1.core.sched.output import CachedRequestData

    new = [SimpleNamespace(req_id=req_id, block_ids=(ids,), num_computed_tokens=computed)]
    return side.build_step(new, CachedRequestData.make_empty(), {req_id: scheduled}, ())


def test_a_prefix_from_the_other_form_is_stored_again_in_this_engines(plane: Plane) -> None:
    # Whole blocks 0-1 from a TP=1 engine; a TP=2 engine loads them and computes block 2.
    # Its heads' keys chain from block 0: stored from block 2 on, no lookup would reach it.
    toks, kv = prompt(3, seed=7)
    prompt_ids = (*toks, 1)
    assert engine(plane, 1, 0, "e").store(toks[: 2 * T], kv[:, :, :, : 2 * T]).wait() == 2
    side = scheduler(plane, 2)
    side.track("r", prompt_ids, "e")
    assert side.matched_tokens("r", 0) == 2 * T
    side.after_alloc("r", 2 * T, [4, 5, 6, 7])
    meta = scheduled(side, "r", [4, 5, 6, 7], 2 * T, T + 1)
    (save,) = meta.saves
    assert (save.start, save.end, save.block_ids) == (0, 3 * T, (4, 5, 6))
    for rank in range(2):  # each rank stores its head of the save, as its store thread does
        shards = engine(plane, 2, rank, "e")
        assert shards.store(list(save.token_ids), kv[:, :, rank : rank + 1], save.start
                            ).wait() == 3
    assert engine(plane, 2, None, "e").lookup(toks).num_blocks == 3
    assert engine(plane, 1, 0, "e").lookup(toks).num_blocks == 3  # and TP=1 finds it all
    side.shutdown()
    check(plane)


def test_a_save_every_rank_dropped_leaves_nothing_pending() -> None:
    from cmx.connectors.settings import ConnectorSettings
    from cmx.connectors.vllm_scheduler import SchedulerSide

    class Opened(Namespaces):
        def __init__(self) -> None:
            self.layout, self.plan, self._open = LAYOUT, None, {}

        def get(self, salt: str) -> Any:
            return None

    side = SchedulerSide(ConnectorSettings(), Opened(), T, ranks=(2, 2))
    side.track("r", tuple(range(3 * T)), None)
    ends = [StoreResult("r", 0, 0, 0, 0, rank) for rank in range(2)]  # dropped by both
    side.take_report(CMXWorkerReport(dropped={"r": 2 * T}, stores=ends))
    side.take_report(CMXWorkerReport(handed={"r": 2 * T}))  # a later save, handed
    report = side.finished("r")
    assert report is not None and report["store_pending_tokens"] == 2 * T
    assert report["store_dropped_tokens"] == 2 * T
    side.shutdown()


def test_one_ranks_two_ends_are_not_two_ranks() -> None:
    ranks = RankReports(loading=2, storing=2)
    first, again = StoreResult("r", 64, 64, 0, 0, 0), StoreResult("r", 64, 0, 64, 0, 0)
    assert ranks.stores([first, again]) == []  # rank 0 twice (the id used again): not over
    joined = ranks.stores([StoreResult("r", 64, 64, 0, 0, 1)])
    assert joined == [StoreResult("r", 64, 64, 0, 0)]  # rank 0's first with rank 1's
    assert ranks.stores([StoreResult("r", 64, 64, 0, 0, 1)]) == [
        StoreResult("r", 64, 0, 64, 0)]  # then its second


def test_pipeline_and_context_parallel_engines_are_refused() -> None:
    from types import SimpleNamespace

    from cmx.connectors.vllm import check_parallel

    for sizes in ((2, 1, 1), (1, 2, 1), (1, 1, 2)):
        with pytest.raises(ValueError, match="tensor parallelism only"):
            check_parallel(SimpleNamespace(pipeline_parallel_size=sizes[0],
                                           decode_context_parallel_size=sizes[1],
                                           prefill_context_parallel_size=sizes[2]))
    check_parallel(SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=1,
                                   prefill_context_parallel_size=1))
