"""Suite "layers": the vLLM connector's loads in groups of layers, through the service.

The worker side of ``CMXConnector`` (``cmx.connectors.vllm_worker.WorkerSide``) driven as vLLM
drives it, one step at a time: ``begin_step`` with one load of the whole prefix, ``start_load``,
``wait_layer`` of every layer in order (vLLM's ``wait_for_layer_load``), ``end_step``. The
service runs on a local Ray cluster (``cmx.bench.harness.cluster``); the worker is this process, on
node a, and the paged caches are vLLM CPU-layout tensors ([blocks, kv_heads, block_size,
2 * head_dim] per layer, ``PagedLayout.VLLM_CPU``).

- Geometry: Llama-3-8B's (``cluster.LLAMA``: 32 layers, 8 KV heads, head_dim 128, bfloat16)
  in vLLM's default 16-token blocks, 2 MiB each. The prefix is ``--gib`` of them, at most
  ``MAX_PREFIX`` (this process holds the stored KV, the paged caches and a load's copy).
- Where the prefix is: in node a's DRAM (HBM copies evicted before each step), then on node
  a's NVMe tier alone (HBM and DRAM copies evicted before each step, page cache dropped where
  allowed).
- Each repetition runs one step with ``load_layer_groups`` = ``GROUPS`` and one with 1 (the
  whole prefix first), in that order, each into the same paged caches zeroed before it; one
  untimed step of each comes first. Per step: ``t0``, from ``start_load`` to layer 0's wait
  returning, and ``tall``, to the last layer's wait returning.
- Every step must load every block (no failed blocks, the report's tokens whole) and leave
  the caches' blocks equal to the stored KV, layer by layer; else the place's figures are not
  reported (a note says why).
- Figures, medians over repetitions with a 95% bootstrap interval over them in the note
  (``intervals.ratio_interval``): grouped ``t0`` / grouped ``tall`` (goal <= 0.3: layer 0's
  attention waits for a fraction of the load), grouped ``tall`` / whole ``tall`` (what the
  pipelining costs over the whole load) and grouped ``t0`` / whole ``t0`` (what it gains).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cmx.bench.harness.cluster import LLAMA, bench_cluster
from cmx.bench.harness.core import BenchContext, Figure, GiB, Goal, MiB, SuiteResult, Table, median
from cmx.bench.harness.intervals import ratio_interval
from cmx.config import ServiceConfig
from cmx.doors import Evict
from cmx.layout import KVLayout

__all__ = ["GROUPS", "LAYOUT", "StepTimes", "layer_figures", "mismatched_layers", "run_layers"]

LAYOUT = dataclasses.replace(LLAMA, block_tokens=16)  # 2 MiB blocks
GROUPS = 4  # load_layer_groups of the grouped steps (ConnectorSettings' default)
GOAL = 0.3  # grouped t0 / grouped tall
MAX_PREFIX = GiB
SPARE = 8  # paged-cache blocks and tier slots beyond the prefix's
STORE_BLOCKS = 64  # blocks per store call
MODEL = "bench-layers"


@dataclass(frozen=True)
class StepTimes:
    """One step's waits, in seconds from ``start_load``."""

    first_s: float  # layer 0's wait returned
    all_s: float  # the last layer's wait returned


def layer_figures(where: str, grouped: Sequence[StepTimes], whole: Sequence[StepTimes],
                  groups: int = GROUPS) -> list[Figure]:
    """The figures of one place the prefix was loaded from; ``grouped[i]`` and ``whole[i]``
    are the steps of repetition i."""
    if len(grouped) != len(whole) or not grouped:
        raise ValueError(f"paired steps of equal, non-zero length, got {len(grouped)} and "
                         f"{len(whole)}")
    g0 = tuple(s.first_s * 1e3 for s in grouped)
    gall = tuple(s.all_s * 1e3 for s in grouped)
    w0 = tuple(s.first_s * 1e3 for s in whole)
    wall = tuple(s.all_s * 1e3 for s in whole)
    ours = f"{groups} groups of layers"
    return [
        Figure("layers", f"layer 0 ready, {ours}, from {where}", "ms", g0,
               "the last layer ready, same steps", gall, Goal("<=", GOAL),
               note=f"ratio {ratio_interval(g0, gall)} over repetitions",
               interval=ratio_interval(g0, gall)),
        Figure("layers", f"every layer ready, {ours}, from {where}", "ms", gall,
               "every layer ready, whole prefix first (1 group), same run", wall, None,
               note=f"what pipelining costs: ratio {ratio_interval(gall, wall)}; whole "
                    f"prefix first, layer 0 ready at {median(w0):.1f} ms"),
        Figure("layers", f"layer 0 ready, {ours} against the whole prefix first, from "
               f"{where}", "ms", g0, "layer 0 ready, whole prefix first (1 group), same run",
               w0, None, note=f"what pipelining gains: ratio {ratio_interval(g0, w0)}"),
    ]


def mismatched_layers(caches: Sequence[Any], block_ids: Sequence[int], stored: Any,
                      head_dim: int) -> list[int]:
    """Layers whose paged-cache blocks ``block_ids`` (vLLM CPU layout) differ from ``stored``
    [layers, 2, kv_heads, len(block_ids) * T, head_dim]."""
    import torch

    from cmx.connectors.paged import PagedLayout, block_view

    bad = []
    for layer, cache in enumerate(caches):
        view = block_view(cache, PagedLayout.VLLM_CPU, head_dim)  # [blocks, heads, 2, T, dim]
        got = view[list(block_ids)].permute(2, 1, 0, 3, 4).reshape(stored[layer].shape)
        if not torch.equal(got, stored[layer]):
            bad.append(layer)
    return bad


class _Engine:
    """Two worker sides (``GROUPS`` groups, and 1) over one set of paged caches, and the
    prefix they load: stored once, through the same namespaces."""

    def __init__(self, cm: Any, layout: KVLayout, blocks: int) -> None:
        import torch

        from cmx.connectors.paged import PagedLayout
        from cmx.connectors.settings import ConnectorSettings, Namespaces
        from cmx.connectors.vllm_meta import LoadSpec
        from cmx.connectors.vllm_worker import WorkerSide

        self.cm, self.layout = cm, layout
        T, L = layout.block_tokens, layout
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(L.num_layers)]
        self.namespaces = Namespaces(cm, MODEL, layout, "w")
        self.salt = uuid.uuid4().hex[:8]
        self.sides = {g: WorkerSide(ConnectorSettings(model=MODEL, weights="w",
                                                      service=cm.config, load_layer_groups=g),
                                    self.namespaces, self.names, PagedLayout.VLLM_CPU)
                      for g in (GROUPS, 1)}
        self.caches = [torch.zeros(blocks + SPARE, L.num_kv_heads, T, 2 * L.head_dim,
                                   dtype=L.torch_dtype()) for _ in self.names]
        for side in self.sides.values():
            side.register(dict(zip(self.names, self.caches)))
        rng = np.random.default_rng(blocks)
        toks = rng.integers(0, 100_000, blocks * T)
        self.block_ids = tuple(int(b) for b in rng.permutation(blocks + SPARE)[:blocks])
        self.spec = LoadSpec("bench", self.salt, tuple(int(t) for t in toks), 0, blocks * T,
                             self.block_ids)
        self.keys = self.ns.keys(toks)
        self.stored = self._store(toks, blocks)

    @property
    def ns(self) -> Any:
        return self.namespaces.get(self.salt)

    def _store(self, toks: np.ndarray, blocks: int) -> Any:
        import torch

        T = self.layout.block_tokens
        kv = torch.empty(self.layout.shape(blocks * T), dtype=self.layout.torch_dtype())
        for first in range(0, blocks, STORE_BLOCKS):
            n = min(STORE_BLOCKS, blocks - first)
            part = kv[:, :, :, first * T : (first + n) * T]
            part.copy_(self.layout.random_kv(n * T, seed=first))
            if self.ns.store(toks[: (first + n) * T], part, start=first * T).wait() != n:
                raise AssertionError(f"stored fewer than {n} blocks")
        return kv

    def place(self, where: str) -> None:
        """Leave the prefix in node a's DRAM ("DRAM") or on its NVMe tier alone ("NVMe")."""
        from cmx.links import actor_name
        from cmx.tiers import Tier

        evict = ("hbm",) if where == "DRAM" else ("hbm", "dram")
        for tier in evict:
            self.cm.link.call(actor_name(tier, self.cm.node_id), Evict(keys=self.keys))
        here = [{c.tier for c in b.copies if c.node == self.cm.node_id}
                for b in self.ns.lookup(self.spec.token_ids).blocks]
        want = Tier.DRAM if where == "DRAM" else Tier.NVME
        if len(here) != len(self.keys) or any(want not in w or Tier.HBM in w for w in here) \
                or (where == "NVMe" and any(w != {Tier.NVME} for w in here)):
            raise AssertionError(f"the prefix is not held in this node's {where} as asked")

    def step(self, groups: int) -> StepTimes:
        """One step of the worker side loading the prefix in ``groups``; AssertionError unless
        every block landed and the caches hold the stored KV."""
        from cmx.connectors.vllm_meta import CMXStepMetadata

        side = self.sides[groups]
        for cache in self.caches:
            cache.zero_()
        side.begin_step(CMXStepMetadata(loads=[self.spec]))
        t0 = time.perf_counter()
        side.start_load()
        side.wait_layer(self.names[0])
        first = time.perf_counter() - t0
        for name in self.names[1:]:
            side.wait_layer(name)
        every = time.perf_counter() - t0
        side.end_step()
        failed, report = side.take_failed(), side.take_report()
        loaded = [x.loaded_tokens for x in report.loads] if report else []
        if failed or loaded != [self.spec.end]:
            raise AssertionError(f"{groups} group(s): loaded {loaded} of {self.spec.end} "
                                 f"tokens, {len(failed)} blocks failed")
        bad = mismatched_layers(self.caches, self.block_ids, self.stored, self.layout.head_dim)
        if bad:
            raise AssertionError(f"{groups} group(s): the paged caches differ from the stored "
                                 f"KV in layers {bad[:4]}{'...' if len(bad) > 4 else ''}")
        return StepTimes(first, every)

    def shutdown(self) -> None:
        for side in self.sides.values():
            side.shutdown()


def _measure(ctx: BenchContext, engine: _Engine, where: str
             ) -> tuple[list[StepTimes], list[StepTimes]]:
    """(grouped steps, whole steps), alternating, each from ``where``."""
    grouped: list[StepTimes] = []
    whole: list[StepTimes] = []
    for rep in range(-1, ctx.config.reps):  # rep -1: untimed
        for groups, into in ((GROUPS, grouped), (1, whole)):
            engine.place(where)
            if where == "NVMe":
                ctx.drop_cache()
            times = engine.step(groups)
            if rep >= 0:
                into.append(times)
        if rep >= 0:
            ctx.log(f"layers: {where} rep {rep + 1}/{ctx.config.reps}: {GROUPS} groups "
                    f"t0 {grouped[-1].first_s * 1e3:.1f} ms, tall {grouped[-1].all_s * 1e3:.1f}"
                    f" ms; whole t0 {whole[-1].first_s * 1e3:.1f} ms, tall "
                    f"{whole[-1].all_s * 1e3:.1f} ms")
    return grouped, whole


def run_layers(ctx: BenchContext) -> SuiteResult:
    result = SuiteResult("layers", command="")
    bb = LAYOUT.block_bytes
    blocks = max(1, min(ctx.config.nbytes, MAX_PREFIX) // bb)
    config = ServiceConfig(block_bytes=bb, hbm_bytes=(blocks + SPARE) * bb,
                           dram_bytes=(blocks + SPARE) * bb, nvme_bytes=4 * (blocks + SPARE) * bb,
                           placement="write_through", nvme_dir=str(ctx.scratch("layers")),
                           load_timeout_s=300)
    what = f"{blocks * bb // MiB} MiB prefix of {bb // MiB} MiB blocks"
    rows = []
    with bench_cluster(config) as bc:
        ctx.log(f"layers: storing a {what}")
        engine = _Engine(bc.cm, LAYOUT, blocks)
        try:
            for where in ("DRAM", "NVMe"):
                try:
                    grouped, whole = _measure(ctx, engine, where)
                except Exception as exc:  # noqa: BLE001 - a place's failure costs its figures
                    ctx.log(f"layers: from {where} failed: {exc}")
                    result.notes.append(f"from {where}: no figures, {type(exc).__name__}: {exc}")
                    continue
                result.figures += layer_figures(where, grouped, whole)
                rows += [(where, str(g), *(f"{median([getattr(s, a) for s in steps]) * 1e3:.1f}"
                                          for a in ("first_s", "all_s")))
                         for g, steps in ((GROUPS, grouped), (1, whole))]
        finally:
            engine.shutdown()
    result.tables.append(Table(f"WorkerSide steps of a {what}, medians",
                               ("from", "load_layer_groups", "t0: layer 0 ready (ms)",
                                "tall: every layer ready (ms)"), tuple(rows)))
    result.notes.append(f"{what}, Llama-3-8B geometry (32 layers, 8 KV heads, head_dim 128, "
                        f"bfloat16); every step's paged-cache blocks checked equal to the "
                        f"stored KV; NVMe reads: {ctx.cold_read_method}")
    return result
