"""Suite "e2e-miss": what a prompt nobody stored costs with CMXConnector, paired against vLLM
without a connector, on vLLM's offline ``LLM`` API (CPU) with SmolLM2-135M-Instruct.

Two engines, each in a process of its own (``e2e_engine``): one with CMXConnector joined to the
service on a local Ray cluster, one without a connector. Every repetition sends one request of
each variant below, one at a time, in an order rotated each repetition (``e2e_pairs.schedule``),
each a fresh random prompt of 1K, 4K or 8K tokens and one generated token; a figure is the ratio of
a variant's median TTFT to that of vLLM without a connector, with a bootstrap interval over
repetitions (``e2e_pairs.ratio_interval``).

- **miss**: the connector looks the prompt up, finds nothing, computes it and stores its blocks.
- **opted out**: the same engine, the request's ``kv_transfer_params`` ``{"cmx": {"skip":
  true}}``: neither lookup nor stores; what having the connector in the engine costs at all.
- **no lookup** / **no store**: one of the two off for the request (``"load": false`` /
  ``"store": false``): which of them costs what.
- **next after a miss**: a miss, then at once another fresh prompt; the second one's TTFT, in
  each engine. The first's stores run in the background then: they must not hold it up.
- **service stopped**: afterwards, with the connector's engine and the service stopped, the
  engine without a connector once more: what the idle service and Ray cost a neighbour.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from cmx.bench.harness.core import BenchContext, Figure, Goal, SuiteResult, Table, median
from cmx.bench.suites.e2e.e2e_pairs import Interval, Slot, prompt_seed, ratio_interval, schedule

__all__ = ["LENGTHS", "VARIANTS", "Variant", "run_e2e_miss"]

# Prompt tokens: a short prompt pays a miss's fixed costs (the lookup, the stores' hand-over)
# over the least compute; SmolLM2-135M's context is 8,192 tokens.
LENGTHS = (1024, 4096, 8128)
MiB = 1 << 20


@dataclass(frozen=True)
class Variant:
    """One kind of request: which engine serves it, with what ``kv_transfer_params``."""

    name: str
    engine: str  # "cmx" or "none"
    label: str  # what a figure calls it
    params: dict[str, Any] | None = None
    follow: bool = False  # time the fresh request sent right after this one, not this one


VARIANTS = (
    Variant("none", "none", "vLLM without a connector"),
    Variant("miss", "cmx", "CMXConnector, a prompt nobody stored"),
    Variant("opted-out", "cmx", "CMXConnector, request opted out (skip)", {"cmx": {"skip": True}}),
    Variant("no-lookup", "cmx", "CMXConnector, lookup off (stores on)", {"cmx": {"load": False}}),
    Variant("no-store", "cmx", "CMXConnector, stores off (lookup on)", {"cmx": {"store": False}}),
    Variant("none-next", "none", "next request after one, without a connector", follow=True),
    Variant("miss-next", "cmx", "next request after a miss, CMXConnector", follow=True),
)
BASE = {"miss": "none", "opted-out": "none", "no-lookup": "none", "no-store": "none",
        "miss-next": "none-next"}  # variant -> the variant its ratio is taken to


def _service_config(ctx: BenchContext) -> Any:
    from cmx.config import ServiceConfig

    return ServiceConfig(block_bytes=2 * MiB, hbm_bytes=128 * MiB, dram_bytes=1024 * MiB,
                         nvme_bytes=4096 * MiB, nvme_dir=str(ctx.scratch("e2e-miss-nvme")))


def _spec(connector: str, lengths: tuple[int, ...], address: str = "",
          service: dict[str, Any] | None = None) -> Any:
    from cmx.bench.suites.e2e.e2e_engine import EngineSpec
    from cmx.models import smollm2_path

    longest = max(lengths)
    kv_gib = max(1, round(3 * longest * 23_040 / 2**30 + 0.5))  # three prompts of the longest
    return EngineSpec(model=smollm2_path(), connector=connector, ray_address=address,
                      service=service or {}, max_model_len=longest + 64, kv_gib=kv_gib,
                      threads=_threads())


def _threads() -> int:
    """OpenMP threads per engine: one engine computes at a time; the rest is the service's."""
    return max(1, (os.cpu_count() or 2) // 2)


Samples = dict[int, dict[str, list[float]]]  # prompt tokens -> variant -> TTFTs, by repetition


def _measure(ctx: BenchContext, engines: dict[str, Any], slots: list[Slot]) -> Samples:
    by_name = {v.name: v for v in VARIANTS}
    got: Samples = {}
    for slot in slots:
        v = by_name[slot.variant]
        seed = prompt_seed(slot)
        follow = prompt_seed(slot, salt=1) if v.follow else None
        ans = engines[v.engine].ask(slot.tokens, seed, v.params, follow)
        ttft = ans["follow_ttft_s"] if v.follow else ans["ttft_s"]
        got.setdefault(slot.tokens, {}).setdefault(v.name, []).append(ttft)
        ctx.log(f"e2e-miss {slot.tokens} rep {slot.rep + 1} {v.name}: {ttft:.3f} s "
                f"({ans['cached']} cached{_report(ans)})")
    return got


def _report(ans: dict[str, Any]) -> str:
    rep = (ans.get("report") or {}).get("cmx") if isinstance(ans.get("report"), dict) else None
    if not isinstance(rep, dict):
        return ""
    keys = ("hit_tokens", "loaded_tokens", "stored_tokens", "store_pending_tokens")
    return "".join(f", {k} {rep[k]}" for k in keys if k in rep)


def _warm(engines: dict[str, Any], lengths: tuple[int, ...]) -> None:
    """One request of each length per engine first: its first passes are slower than the rest."""
    for name, engine in engines.items():
        for n in lengths:
            engine.ask(n, prompt_seed(Slot(n, -1, f"warm-{name}")), {"cmx": {"skip": True}}
                       if name == "cmx" else None)


def _figures(got: Samples, idle: dict[int, list[float]]) -> tuple[list[Figure], list[Table]]:
    figures: list[Figure] = []
    rows: list[tuple[str, ...]] = []
    labels = {v.name: v.label for v in VARIANTS}
    for n, by in got.items():
        k = f"{n:,}"
        for name, base in BASE.items():
            iv = ratio_interval(by[name], by[base])
            goal = Goal("<=", 1.05) if name in ("miss", "miss-next") else None
            figures.append(Figure(
                "e2e-miss", f"TTFT, {k}-token prompt, {labels[name]}", "s", tuple(by[name]),
                f"{labels[base]}, paired", tuple(by[base]), goal,
                f"ratio of medians and 95% bootstrap interval over repetitions: {iv}; "
                "judged by the interval's upper end", interval=iv))
            rows.append(_row(k, labels[name], by[name], by[base], iv))
        if idle.get(n):
            iv = ratio_interval(by["none"], idle[n])
            figures.append(Figure(
                "e2e-miss", f"TTFT, {k}-token prompt, vLLM without a connector, service and "
                "connector engine idle beside it", "s", tuple(by["none"]),
                "the same engine, service and other engine stopped", tuple(idle[n]), None,
                f"not interleaved (measured after): {iv}"))
            rows.append(_row(k, "no connector, service running vs stopped", by["none"],
                             idle[n], iv))
    table = Table("Median TTFT (s) by variant, paired with its baseline in the same run",
                  ("prompt", "variant", "median", "baseline median", "ratio [95% interval]"),
                  tuple(rows))
    return figures, [table]


def _row(k: str, label: str, a: list[float], b: list[float], iv: Interval) -> tuple[str, ...]:
    return (k, label, f"{median(a):.3f}", f"{median(b):.3f}",
            f"{iv.ratio:.3f} [{iv.low:.3f}, {iv.high:.3f}]")


def run_e2e_miss(ctx: BenchContext, lengths: tuple[int, ...] = LENGTHS) -> SuiteResult:
    from cmx.bench.harness.cluster import bench_cluster
    from cmx.bench.suites.e2e.e2e_engine import EngineProcess

    result = SuiteResult("e2e-miss", command="")
    reps = ctx.config.reps
    logs = ctx.scratch("e2e-miss-logs")
    none = EngineProcess(_spec("none", lengths), logs / "none.log")  # starts meanwhile
    try:
        with bench_cluster(_service_config(ctx)) as bc:
            ctx.log("e2e-miss: service up; starting the connector's engine")
            cmx = EngineProcess(_spec("cmx", lengths, bc.cluster.address, asdict(bc.config)),
                                logs / "cmx.log")
            try:
                none.wait_ready()
                cmx.wait_ready()
                engines = {"cmx": cmx, "none": none}
                _warm(engines, lengths)
                got = _measure(ctx, engines, schedule([v.name for v in VARIANTS], reps,
                                                      lengths))
            finally:
                cmx.stop()
        idle: dict[int, list[float]] = {}
        for slot in schedule(["idle"], reps, lengths):
            idle.setdefault(slot.tokens, []).append(none.ask(slot.tokens, prompt_seed(slot))
                                                    ["ttft_s"])
    finally:
        none.stop()
    figures, tables = _figures(got, idle)
    result.figures += figures
    result.tables += tables
    spec = _spec("none", lengths)
    result.notes.append(
        f"model: SmolLM2-135M-Instruct on vLLM (CPU, {spec.dtype}, {spec.threads} OpenMP "
        f"thread(s) per engine, blocks of {spec.block_size} tokens), offline LLM API; each "
        f"engine in its own process, the service on a local Ray cluster; TTFT is the wall time "
        f"of one request with one generated token; {reps} repetition(s), variants rotated "
        f"each repetition")
    return result
