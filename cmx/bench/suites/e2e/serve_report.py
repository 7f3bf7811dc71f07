"""The report of suite "e2e-serve" (``vllm_serve``): the table of runs, the CPU each took, the
TTFT figures against vLLM alone, and the judged figure, requests/s at a TTFT p99 target."""

from __future__ import annotations

from cmx.bench.harness.core import Figure, Goal, SuiteResult, Table
from cmx.bench.harness.intervals import ratio_interval
from cmx.bench.harness.proc_cpu import REST, CpuUse
from cmx.bench.suites.e2e.serve_sweep import P99_TARGET_MS, held
from cmx.bench.suites.e2e.vllm_results import ServeRun

__all__ = ["P99_TARGET_MS", "THROUGHPUT_GOAL", "Rounds", "Tokens", "per_rate", "report",
           "sustained"]

THROUGHPUT_GOAL = Goal(">=", 1.5)  # requests/s with the connector over without, at that p99
Tokens = dict[str, dict[tuple[str, float], dict[str, float]]]  # setup -> run -> source -> n
Runs = dict[tuple[str, float], ServeRun]  # (dataset, rate) -> its run
Rounds = dict[str, list[Runs]]  # setup -> its runs, round by round


def sustained(runs: Runs, dataset: str) -> ServeRun | None:
    """Of a setup's runs of ``dataset``, the one with the most requests per second among those
    that held the target (``serve_sweep.held``); None if none did."""
    kept = [r for (ds, _), r in runs.items() if ds == dataset and held(r)]
    return max(kept, key=lambda r: r.request_throughput, default=None)


def per_rate(rounds: int) -> str:
    return ("one run per rate" if rounds == 1 else
            f"{rounds} rounds, a rate's runs pooled over the rounds that reached it")


def _throughput_name(dataset: str) -> str:
    return f"requests/s at TTFT p99 <= {P99_TARGET_MS / 1000:g} s, {dataset}, cmx"


def _unjudged(result: SuiteResult, dataset: str, why: str) -> None:
    """The goal's figure, inconclusive: a MISS the summary counts, with the reason."""
    nan = float("nan")
    result.figures.append(Figure(
        "e2e-serve", _throughput_name(dataset), "req/s", (nan,),
        "vLLM without a connector, the best rate it held within the same p99", (nan,),
        THROUGHPUT_GOAL, unjudged=why))


def _throughput_figure(result: SuiteResult, by_round: Rounds, failed: dict[str, str],
                       dataset: str = "prefix_repetition") -> None:
    """The goal: requests/s with the connector at TTFT p99 <= 10 s over vLLM's alone, one
    sample per round, round ``i`` of each setup a pair (they ran one after the other, with the
    same prompts). Inconclusive where a setup failed, or where vLLM alone held the target up
    to the last rate of a round: its throughput is then a lower bound, and a ratio to it says
    nothing of a gain."""
    gone = [s for s in ("cmx", "none") if s in failed]
    if gone:
        _unjudged(result, dataset, "; ".join(f"setup {s!r} failed: {failed[s]}" for s in gone))
        return
    if "cmx" not in by_round or "none" not in by_round:
        return
    unbroken = [i + 1 for i, runs in enumerate(by_round["none"]) if _held_to_the_end(runs, dataset)]
    if unbroken:
        _unjudged(result, dataset,
                  f"vLLM without a connector held TTFT p99 within {P99_TARGET_MS / 1000:g} s "
                  f"up to the last rate tried in round(s) {unbroken}: its throughput is a "
                  "lower bound, so a ratio to it shows no gain")
        return
    pairs = list(zip(by_round["cmx"], by_round["none"], strict=False))
    bases = [sustained(none, dataset) for _, none in pairs]
    if any(b is None for b in bases):
        result.notes.append(f"{dataset}: vLLM without a connector held TTFT p99 within "
                            f"{P99_TARGET_MS / 1000:g} s at no rate tried in a round, so the "
                            f"throughput goal has no baseline; lower rates are needed")
        return
    ours = [sustained(cmx, dataset) for cmx, _ in pairs]
    a = tuple(o.request_throughput if o is not None else 0.0 for o in ours)
    b = tuple(x.request_throughput for x in bases if x is not None)
    result.figures.append(Figure(
        "e2e-serve", _throughput_name(dataset), "req/s", a,
        "vLLM without a connector, the best rate it held within the same p99", b,
        THROUGHPUT_GOAL,
        f"each round's fastest run whose p99 held (none failed), rates rising until a run "
        f"broke it; {len(pairs)} round(s), paired by round; "
        + "; ".join("the connector held it at no rate tried" if o is None else
                    f"p99 {o.ttft_p99_ms:.0f} ms against {x.ttft_p99_ms:.0f} ms"
                    for o, x in zip(ours, bases, strict=True) if x is not None),
        interval=ratio_interval(a, b)))


def _held_to_the_end(runs: Runs, dataset: str) -> bool:
    """Whether a round's sweep of ``dataset`` held the target at its last rate."""
    mine = [(rate, run) for (ds, rate), run in runs.items() if ds == dataset]
    return bool(mine) and held(max(mine, key=lambda x: x[0])[1])


def _unbroken(result: SuiteResult, by_round: Rounds) -> None:
    """A note for each sweep that held the target up to its last rate: it ran out of rates,
    so its throughput there is a lower bound."""
    for setup, rounds in by_round.items():
        for i, runs in enumerate(rounds):
            for dataset in dict.fromkeys(ds for ds, _ in runs):
                rate, last = max((r, run) for (ds, r), run in runs.items() if ds == dataset)
                if held(last):
                    result.notes.append(
                        f"{setup}, {dataset}, round {i + 1}: held TTFT p99 within "
                        f"{P99_TARGET_MS / 1000:g} s up to the last rate tried, {rate:g} "
                        f"req/s; its throughput there is a lower bound")


def report(result: SuiteResult, got: dict[str, Runs],
           cpu: dict[str, dict[tuple[str, float], CpuUse]] | None = None,
           rounds: int = 1, tokens: Tokens | None = None, by_round: Rounds | None = None,
           failed: dict[str, str] | None = None) -> None:
    """The tables and figures of runs pooled over rounds (``got``), and the judged figure from
    each round's own runs (``by_round``; ``got`` as its one round when not given); ``failed``:
    each setup that raised, with its error."""
    rows = [(setup, ds, f"{rate:g}", f"{r.completed}/{r.failed}", f"{r.request_throughput:.3f}",
             f"{r.token_throughput:.0f}", f"{r.ttft_p50_ms:.0f}", f"{r.ttft_p99_ms:.0f}")
            for setup, runs in got.items() for (ds, rate), r in runs.items()]
    result.tables.append(Table(
        f"vllm bench serve, two servers, one client each (merged; {per_rate(rounds)})",
        ("setup", "dataset", "rate (req/s)", "completed/failed", "req/s", "tokens/s",
         "TTFT p50 (ms)", "TTFT p99 (ms)"), tuple(rows)))
    if cpu:
        result.tables.append(_cpu_table(got, cpu, tokens or {}))
    base = got.get("none", {})
    for setup in ("cmx", "offloading"):
        for key, r in got.get(setup, {}).items():
            if key not in base:
                continue
            ds, rate = key
            result.figures.append(Figure(
                "e2e-serve", f"TTFT p50, {ds} at {rate:g} req/s, {setup}", "ms",
                (r.ttft_p50_ms,), "vLLM without a connector, same run settings",
                (base[key].ttft_p50_ms,), None, f"p99 {r.ttft_p99_ms:.0f} ms against "
                f"{base[key].ttft_p99_ms:.0f} ms; {per_rate(rounds)}"))
    by_round = by_round if by_round is not None else {k: [v] for k, v in got.items()}
    _throughput_figure(result, by_round, failed or {})
    _unbroken(result, by_round)


def _cpu_table(got: dict[str, dict[tuple[str, float], ServeRun]],
               cpu: dict[str, dict[tuple[str, float], CpuUse]], tokens: Tokens) -> Table:
    """CPU-seconds per completed request, by process group, the machine's busy share, and
    the prompt tokens per request the servers computed, found in vLLM's own prefix cache, and
    loaded through the connector."""
    rows = []
    for setup, runs in cpu.items():
        for key, use in runs.items():
            done = got[setup][key].completed or 1
            per = {g: v / done for g, v in use.groups.items()}
            toks = tokens.get(setup, {}).get(key, {})
            rows.append((setup, key[0], f"{key[1]:g}", f"{per.get('servers', 0.0):.2f}",
                         f"{per.get(REST, 0.0):.2f}", f"{per.get('clients', 0.0):.2f}",
                         f"{use.machine_busy_s / done:.2f}", f"{use.machine_share:.0%}",
                         *(f"{toks[k] / done:.0f}" if k in toks else "-" for k in _SOURCES)))
    return Table(
        "CPU-seconds per completed request while the clients ran: the two servers' process "
        "trees (API server, engine core, the connector in it), the rest of the bench's "
        "processes (the Ray cluster and the service's actors; for vLLM alone only the bench "
        "process and this meter), the "
        "clients, and the whole machine; and prompt tokens per request by source "
        "(vLLM's vllm:prompt_tokens_by_source)",
        ("setup", "dataset", "rate (req/s)", "servers", "Ray and service", "clients",
         "machine", "machine busy", "computed", "vLLM's cache", "connector"), tuple(rows))


_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
