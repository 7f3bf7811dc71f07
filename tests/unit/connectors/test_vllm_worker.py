"""The worker side of CMXConnector, driven as vLLM's model runner drives it, without an engine.

The service is a fake namespace (a subclass of the client's) holding one stored prefix; the
paged caches are vLLM CPU-layout tensors. What is checked is state: which layers are written
and marked ready while others are still pending, and that a step ends while its store is still
running.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from cmx.checksum import checksum
from cmx.client import BlockLocation, Match, NamespaceClient, StoreHandle
from cmx.client.copy_out import Sink, copy_payloads
from cmx.connectors.paged import PagedLayout, block_view
from cmx.connectors.settings import ConnectorSettings, Namespaces
from cmx.connectors.shards import HeadPlan
from cmx.connectors.vllm_loads import Loaded
from cmx.connectors.vllm_meta import CMXStepMetadata, LoadSpec, SaveSpec, StoreResult
from cmx.connectors.vllm_worker import WorkerSide
from cmx.keys import BlockHash
from cmx.layout import KVLayout
from cmx.tiers import Tier

T, LAYERS, HEADS, DIM, BLOCKS = 4, 3, 2, 8, 6
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, block_tokens=T,
                  dtype="float32")
NAMES = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
PROMPT = tuple(range(100, 112))  # three full blocks
BOUND_S = 30.0  # a liveness bound only: every wait below ends on an event long before


class Handle(StoreHandle):
    def __init__(self, done: threading.Event, blocks: int) -> None:
        super().__init__(None, blocks, BOUND_S)
        self._done = done

    def wait(self, timeout_s: float | None = None) -> int:
        assert self._done.wait(BOUND_S)
        return self.num_blocks


class FakeNamespace(NamespaceClient):
    """Holds the KV of ``PROMPT``; a store waits for ``store_done`` before it completes."""

    def __init__(self) -> None:
        self.kv = torch.randn(LAYOUT.shape(len(PROMPT)))
        self.stored: list[tuple[tuple[int, ...], torch.Tensor, int]] = []
        self.store_done = threading.Event()
        self.finished = threading.Event()

    def lookup(self, token_ids: object, here_first: bool = False) -> Match:
        n = len(token_ids) // T  # type: ignore[arg-type]
        return Match(n * T, tuple(BlockLocation(BlockHash(bytes([i]) * 32), Tier.DRAM, "here",
                                                ()) for i in range(n)))

    def load(self, token_ids: object, match: Match | None = None) -> Any:
        assert match is not None
        return self.kv[:, :, :, :match.num_tokens]

    def load_to(self, sink: Sink, token_ids: object, match: Match | None = None) -> int:
        assert match is not None
        payloads = [LAYOUT.to_payload(self.kv[:, :, :, i * T : (i + 1) * T]).numpy()
                    for i in range(match.num_blocks)]
        return copy_payloads(LAYOUT, [(b.key, p, checksum(p)) for b, p in
                                      zip(match.blocks, payloads)], sink)

    def store(self, token_ids: object, kv: Any, start: int = 0) -> StoreHandle:
        self.stored.append((tuple(token_ids), kv.clone(), start))  # type: ignore[arg-type]
        done = threading.Event()

        def finish() -> None:
            self.store_done.wait(BOUND_S)
            done.set()
            self.finished.set()

        threading.Thread(target=finish, daemon=True).start()
        return Handle(done, (len(token_ids) - start) // T)  # type: ignore[arg-type]


class FakeNamespaces(Namespaces):
    def __init__(self, ns: FakeNamespace) -> None:
        self.layout = LAYOUT
        self.ns = ns

    def get(self, salt: str) -> Any:
        return self.ns

    @property
    def node_id(self) -> str:
        return "here"


class HeldWorker(WorkerSide):
    """Writes layer 0 at once and every later layer only once ``go`` is set."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.go = threading.Event()

    def _write_layer(self, layer: int, loaded: list[Loaded], first: int = 0) -> None:
        if layer > 0:
            assert self.go.wait(BOUND_S)
        super()._write_layer(layer, loaded, first)


def worker(cls: type[WorkerSide] = WorkerSide) -> tuple[Any, FakeNamespace, list[torch.Tensor]]:
    ns = FakeNamespace()
    settings = ConnectorSettings(load_timeout_s=BOUND_S, load_layer_groups=1,  # whole loads
                                 load_mode="sync", save_mode="sync")  # type: ignore[arg-type]
    w = cls(settings, FakeNamespaces(ns), NAMES, PagedLayout.VLLM_CPU)
    caches = [torch.zeros(BLOCKS, HEADS, T, 2 * DIM) for _ in range(LAYERS)]
    w.register(dict(zip(NAMES, caches)))
    return w, ns, caches


def blocks_of(cache: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """[2, heads, len(ids) * T, dim] of the paged cache's blocks ``ids``, in order."""
    view = block_view(cache, PagedLayout.VLLM_CPU, DIM)  # [blocks, heads, 2, T, dim]
    picked = view[ids].permute(2, 1, 0, 3, 4)  # [2, heads, n, T, dim]
    return picked.reshape(2, HEADS, len(ids) * T, DIM)


LOAD = LoadSpec("r", "", PROMPT, 0, 12, (5, 2, 4))


def test_layer_zero_is_usable_while_later_layers_are_still_pending() -> None:
    """Loaded through a host tensor, as a GPU cache is: written layer by layer."""
    w, ns, caches = worker(HeldWorker)
    w.loads.direct = None
    w.begin_step(CMXStepMetadata(loads=[LOAD]))
    w.start_load()
    w.wait_layer(NAMES[0])  # returns with layer 0 in place, the others not yet written
    assert torch.equal(blocks_of(caches[0], [5, 2, 4]), ns.kv[0])
    assert w._step.ready[0].is_set() and not w._step.ready[1].is_set()
    assert not caches[1].any() and not caches[2].any()
    w.go.set()
    w.wait_layer(NAMES[1])
    w.wait_layer(NAMES[2])
    w.end_step()
    for layer in range(LAYERS):
        assert torch.equal(blocks_of(caches[layer], [5, 2, 4]), ns.kv[layer])
    assert w.take_failed() == set()
    report = w.take_report()
    assert report is not None and report.loads[0].loaded_tokens == 12
    w.shutdown()


def test_a_step_ends_while_its_store_is_still_running() -> None:
    w, ns, caches = worker()
    for cache in caches:
        cache.copy_(torch.randn_like(cache))
    save = SaveSpec("r", "", PROMPT[:8], 0, 8, (3, 1))
    w.begin_step(CMXStepMetadata(saves=[save]))
    for name, cache in zip(NAMES, caches):
        w.save_layer(name, cache)
    ended = threading.Thread(target=w.end_step, daemon=True)
    ended.start()
    ended.join(BOUND_S)
    assert not ended.is_alive(), "the step waited for its store"
    assert not ns.finished.is_set()  # the store is still running, the step is over
    report = w.take_report()
    assert report is not None and report.handed == {"r": 8} and report.stores == []
    ns.store_done.set()
    assert ns.finished.wait(BOUND_S)
    w.shutdown()
    report = w.take_report()
    assert report is not None and report.stores == [StoreResult("r", 8, 8, 0)]
    ((ids, kv, start),) = ns.stored
    assert ids == PROMPT[:8] and start == 0
    for layer in range(LAYERS):
        assert torch.equal(kv[layer], blocks_of(caches[layer], [3, 1]))


def two_saves(w: WorkerSide) -> Any:
    """A save of requests "a" and "b" in a step each, from random caches; the report."""
    caches = [torch.randn(BLOCKS, HEADS, T, 2 * DIM) for _ in range(LAYERS)]
    w.register(dict(zip(NAMES, caches)))
    for req in ("a", "b"):
        w.begin_step(CMXStepMetadata(saves=[SaveSpec(req, "", PROMPT[:4], 0, 4, (0,))]))
        for name, cache in zip(NAMES, caches):
            w.save_layer(name, cache)
        w.end_step()
    return w.take_report()


def test_stores_past_the_bound_are_dropped_and_reported() -> None:
    ns = FakeNamespace()
    w = WorkerSide(ConnectorSettings(max_pending_stores=1), FakeNamespaces(ns), NAMES,
                   PagedLayout.VLLM_CPU)
    report = two_saves(w)
    assert report is not None
    assert report.handed == {"a": 4} and report.dropped == {"b": 4}
    ns.store_done.set()
    w.shutdown()


def test_a_rank_whose_heads_another_rank_stores_stores_nothing() -> None:
    # 2 heads at TP=4: ranks 0 and 1 hold head 0, and rank 0 stores it
    ns = FakeNamespace()
    one = dataclasses.replace(LAYOUT, num_kv_heads=1)
    names = FakeNamespaces(ns)
    names.layout = one
    w = WorkerSide(ConnectorSettings(save_mode="sync"), names, NAMES,  # type: ignore[arg-type]
                   PagedLayout.VLLM_CPU, HeadPlan.of(HEADS, 4, 1))
    w.register(dict(zip(NAMES, [torch.randn(BLOCKS, 1, T, 2 * DIM) for _ in range(LAYERS)])))
    w.begin_step(CMXStepMetadata(saves=[SaveSpec("r", "", PROMPT[:8], 0, 8, (3, 1))]))
    for name, cache in zip(NAMES, w.caches):
        w.save_layer(name, cache)
    w.end_step()
    ns.store_done.set()
    w.shutdown()
    assert ns.stored == [] and w.take_report() is None


def test_a_rank_says_a_dropped_save_ended_with_nothing_stored() -> None:
    # at TP>1 the scheduler joins each save's ends from every storing rank: a drop is one
    ns = FakeNamespace()
    w = WorkerSide(ConnectorSettings(max_pending_stores=1, save_mode="sync"),  # type: ignore
                   FakeNamespaces(ns), NAMES, PagedLayout.VLLM_CPU,
                   HeadPlan(HEADS, range(HEADS), True, tp=2))  # a rank's heads, at TP=2
    report = two_saves(w)
    assert report is not None and report.dropped == {"b": 4}
    assert report.stores == [StoreResult("b", 0, 0, 0, 0)]  # ended, nothing handed
    ns.store_done.set()
    w.shutdown()
