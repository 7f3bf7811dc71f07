"""The scheduler side of CMXConnector, driven as vLLM's scheduler drives it, without an engine.

The service is a fake namespace whose lookups answer from a dict of cached prefixes; vLLM's
per-step data are its own ``CachedRequestData`` and stand-ins for ``NewRequestData``.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.core.sched.output import CachedRequestData

from cmx.client import BlockLocation, Match, NamespaceClient
from cmx.connectors.settings import ConnectorSettings, Namespaces, namespace_salt
from cmx.connectors.vllm_meta import CMXWorkerReport, LoadResult, StoreResult
from cmx.connectors.vllm_scheduler import SchedulerSide
from cmx.keys import BlockHash
from cmx.layout import KVLayout
from cmx.tiers import Tier

T = 4  # tokens per block
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_tokens=T)
PROMPT = list(range(100, 118))  # 18 tokens: four full blocks and a partial one


class FakeNamespace(NamespaceClient):
    """Answers lookups with ``cached`` tokens of any prompt, from ``tier``; can be held."""

    def __init__(self, cached: int = 0, tier: Tier = Tier.DRAM) -> None:
        self.cached = cached
        self.tier = tier
        self.release = threading.Event()
        self.release.set()
        self.fail = False
        self.asked: list[int] = []

    def lookup(self, token_ids: object, here_first: bool = False) -> Match:
        self.release.wait(10)
        if self.fail:
            raise ConnectionError("directory unreachable")
        n = min(self.cached, len(token_ids)) // T  # type: ignore[arg-type]
        self.asked.append(len(token_ids))  # type: ignore[arg-type]
        blocks = tuple(BlockLocation(BlockHash(bytes([i]) * 32), self.tier, "here", ())
                       for i in range(n))
        return Match(n * T, blocks)


class FakeNamespaces(Namespaces):
    """One fake namespace answers for every salt; the salts asked for are kept."""

    def __init__(self, ns: FakeNamespace) -> None:
        self.layout = LAYOUT
        self.ns = ns
        self.salts: list[str] = []

    def get(self, salt: str) -> Any:
        self.salts.append(salt)
        return self.ns

    @property
    def node_id(self) -> str:
        return "here"


def side(cached: int = 0, gate: bool = False, **kw: Any) -> tuple[SchedulerSide, FakeNamespace]:
    ns = FakeNamespace(cached)
    # The sync paths' scheduler side; the fast paths' (the defaults) have suites of their own.
    settings = ConnectorSettings(gate=gate, lookup_wait_s=kw.pop("wait", 1.0),
                                 load_mode="sync", save_mode="sync",  # type: ignore[arg-type]
                                 prefetch=False)
    return SchedulerSide(settings, FakeNamespaces(ns), T, **kw), ns


def new_req(req_id: str, blocks: list[int], computed: int) -> Any:
    return SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=computed)


def cached(req_id: str, new_blocks: list[int] | None, computed: int,
           resumed: bool = False) -> CachedRequestData:
    return CachedRequestData(
        req_ids=[req_id], resumed_req_ids={req_id} if resumed else set(), new_token_ids=[[]],
        all_token_ids={}, new_block_ids=[(new_blocks,) if new_blocks is not None else None],
        num_computed_tokens=[computed], num_output_tokens=[0])


NONE = CachedRequestData.make_empty()


def test_offers_the_cached_prefix_but_never_the_last_prompt_token() -> None:
    s, _ = side(cached=len(PROMPT))
    s.track("r", PROMPT, None)
    assert s.matched_tokens("r", 0) == 16  # (18 - 1) // 4 * 4
    s2, _ = side(cached=len(PROMPT))
    s2.track("r", PROMPT[:17], None)
    assert s2.matched_tokens("r", 0) == 16
    s3, _ = side(cached=len(PROMPT))
    s3.track("r", PROMPT[:16], None)
    assert s3.matched_tokens("r", 0) == 12  # 16 tokens: the last block is computed


def test_a_slow_lookup_is_not_known_yet_then_answered() -> None:
    s, ns = side(cached=8, wait=0.0)
    ns.release.clear()
    s.track("r", PROMPT, None)
    assert s.matched_tokens("r", 0) is None
    ns.release.set()
    deadline = time.monotonic() + 30
    while (got := s.matched_tokens("r", 0)) is None:
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.01)
    assert got == 8
    assert ns.asked == [16]  # one lookup, however often vLLM asks


def test_a_failed_lookup_is_a_miss() -> None:
    s, ns = side(cached=8)
    ns.fail = True
    s.track("r", PROMPT, None)
    assert s.matched_tokens("r", 0) == 0


def test_only_what_is_beyond_the_engines_own_cache_is_offered() -> None:
    s, _ = side(cached=12)
    s.track("r", PROMPT, None)
    assert s.matched_tokens("r", 8) == 4
    s2, _ = side(cached=8)
    s2.track("r", PROMPT, None)
    assert s2.matched_tokens("r", 8) == 0


def test_the_gate_refuses_a_load_slower_than_recompute() -> None:
    s, _ = side(cached=16, gate=True)
    # A link of 1 s latency against a prompt that computes in milliseconds.
    s.gate.link("dram").latency_s = 1.0
    s.track("r", PROMPT, None)
    assert s.matched_tokens("r", 0) == 0
    assert "recompute" in s.finished("r")["plan"]  # type: ignore[index]


def test_a_load_goes_into_the_requests_new_blocks_and_later_blocks_are_stored_once() -> None:
    s, _ = side(cached=8)
    s.track("r", PROMPT, "tenant")
    assert s.matched_tokens("r", 0) == 8
    s.after_alloc("r", 8)
    # Step 1: the whole prompt is scheduled (8 loaded + 10 computed) in blocks 7, 3, 9, 1, 5.
    meta = s.build_step([new_req("r", [7, 3, 9, 1, 5], 8)], NONE, {"r": 10}, [])
    (load,) = meta.loads
    assert (load.start, load.end, load.block_ids) == (0, 8, (7, 3))
    assert load.salt == namespace_salt("", "tenant") and load.token_ids == tuple(PROMPT[:8])
    (save,) = meta.saves
    assert (save.start, save.end, save.block_ids) == (8, 16, (9, 1))  # the partial tail waits
    # Step 2: a decode step completes no prompt block: nothing more to store.
    meta = s.build_step([], cached("r", None, 18), {"r": 1}, [])
    assert not meta.saves and not meta.loads


def test_chunked_prefill_stores_each_block_as_it_completes() -> None:
    s, _ = side(cached=0)
    s.track("r", PROMPT, None)
    assert s.matched_tokens("r", 0) == 0
    meta = s.build_step([new_req("r", [0, 1], 0)], NONE, {"r": 6}, [])
    assert [(x.start, x.end, x.block_ids) for x in meta.saves] == [(0, 4, (0,))]
    meta = s.build_step([], cached("r", [2, 3, 4], 6), {"r": 12}, [])
    assert [(x.start, x.end, x.block_ids) for x in meta.saves] == [(4, 16, (1, 2, 3))]


def test_a_preempted_request_loads_into_its_new_blocks_and_stores_nothing_twice() -> None:
    s, ns = side(cached=0)
    s.track("r", PROMPT, None)
    s.matched_tokens("r", 0)
    s.build_step([new_req("r", [0, 1, 2, 3, 4], 0)], NONE, {"r": 18}, [])
    # Preempted, then asked about afresh: its own stored blocks are found now.
    ns.cached = 16
    assert s.matched_tokens("r", 0) == 16
    s.after_alloc("r", 16)
    meta = s.build_step([], cached("r", [8, 9, 10, 11, 12], 16, resumed=True), {"r": 3}, [])
    (load,) = meta.loads
    assert load.block_ids == (8, 9, 10, 11)
    assert not meta.saves


def test_finished_and_aborted_requests_leave_nothing_behind() -> None:
    s, ns = side(cached=8, wait=0.0)
    ns.release.clear()
    s.track("slow", PROMPT, None)
    assert s.matched_tokens("slow", 0) is None
    s.track("done", PROMPT, None)
    ns.release.set()
    s.build_step([], NONE, {}, ["slow", "done"])
    assert s.requests == {} and s._lookups == {}


def test_worker_reports_reach_the_request_and_the_gate() -> None:
    s, _ = side(cached=8)
    s.track("r", PROMPT, None)
    s.matched_tokens("r", 0)
    before = s.gate.link("dram").samples.copy()
    s.take_report(CMXWorkerReport(
        loads=[LoadResult("r", 8, 4, 4 * 1024, 0.01, (("dram", 2048), ("dram", 2048)))],
        handed={"r": 8}, stores=[StoreResult("r", 8, 8, 0)]))
    report = s.finished("r")
    assert report is not None
    assert report["loaded_tokens"] == 4 and report["load_failed_tokens"] == 4
    assert report["stored_tokens"] == 8
    assert len(s.gate.link("dram").samples) == len(before) + 1


@pytest.mark.parametrize("base,salt,expected", [
    ("", None, ""), ("", "a", "a"), ("t", None, "t"), ("t", "a", '["t", "a"]'),
])
def test_namespace_salts(base: str, salt: str | None, expected: str) -> None:
    assert namespace_salt(base, salt) == expected


def test_unknown_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown"):
        ConnectorSettings.from_extra({"gating": False})


@pytest.mark.parametrize("params,load,store", [
    (None, True, True),
    ({"other_connector": {"x": 1}}, True, True),
    ({"cmx": {}}, True, True),
    ({"cmx": {"skip": True}}, False, False),
    ({"cmx": {"skip": False, "load": True, "store": True}}, True, True),
    ({"cmx": {"load": False}}, False, True),
    ({"cmx": {"store": False}}, True, False),
    ({"cmx": {"skip": "yes"}}, False, False),  # malformed: kept out, never in
    ({"cmx": {"skipp": True}}, False, False),
    ({"cmx": True}, False, False),
])
def test_a_request_keeps_itself_out_of_the_cache(params: Any, load: bool, store: bool) -> None:
    s, ns = side(cached=8)
    s.track("r", PROMPT, None, params)
    offered = s.matched_tokens("r", 0)
    assert offered == (8 if load else 0)
    assert ns.asked == ([16] if load else [])  # a request that loads nothing asks nothing
    if offered:
        s.after_alloc("r", offered)
    meta = s.build_step([new_req("r", [7, 3, 9, 1, 5], offered)], NONE, {"r": 18 - offered},
                        [])
    assert [x.block_ids for x in meta.loads] == ([(7, 3)] if load else [])
    expected = [(9, 1)] if load else [(7, 3, 9, 1)]
    assert [x.block_ids for x in meta.saves] == (expected if store else [])


def test_a_request_that_finishes_in_its_load_step_still_gets_the_workers_figures() -> None:
    # vLLM frees a one-token request before it passes on the workers' report of that step,
    # and sends the request's kv_transfer_params after both.
    s, _ = side(cached=8)
    s.track("r", PROMPT, None)
    assert s.matched_tokens("r", 0) == 8
    s.after_alloc("r", 8)
    s.build_step([new_req("r", [7, 3, 9, 1, 5], 8)], NONE, {"r": 10}, [])
    sent = s.finished("r")
    assert sent is not None and "loaded_tokens" not in sent
    s.take_report(CMXWorkerReport(loads=[LoadResult("r", 8, 8, 8 * 1024, 0.01, ())],
                                  handed={"r": 8}, stores=[StoreResult("r", 8, 8, 0)]))
    assert sent["loaded_tokens"] == 8 and sent["stored_tokens"] == 8
    s.build_step([], NONE, {}, [])  # the next step: last step's reports are gone
    s.take_report(CMXWorkerReport(stores=[StoreResult("r", 4, 4, 0)]))
    assert sent["stored_tokens"] == 8 and s._finishing == {}
