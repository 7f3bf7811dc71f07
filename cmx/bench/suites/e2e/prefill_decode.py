"""Suite "prefill-decode": ``cmx serve --replicas 1 --prefill-replicas 1`` (one replica computes
each prompt and stores its KV, the other loads it and decodes) against ``cmx serve --replicas
2`` (each replica does both), SmolLM2-135M-Instruct on vLLM's CPU build, float32, driven
through each one's OpenAI endpoint by vLLM's own benchmark client (``vllm bench serve``, run by
``vllm_client``).

Both applications run at once, each with its own Ray head, service, state and port
(``harness.serve_app``): neither finds the other's prefixes. Every repetition runs the client
once against each, one after the other, the order swapped each repetition (A B, B A, ...). A
run is ``requests`` prompts of ``input_len`` tokens (vLLM's random dataset: consecutive
vocabulary ids from a random offset, as text), each
decoding ``output_len`` tokens greedily and streamed, arriving at ``rate`` per second (Poisson);
the repetition's seed draws them, so both applications get the same prompts and no
repetition finds an earlier one's.

Figures, split over colocated, each the ratio of medians over repetitions with a bootstrap
interval (``e2e_pairs.ratio_interval``): TTFT p50 and p99, and the inter-token latency p50 and
p99 (every gap between two streamed tokens of every request of a run). And the judged one:
every greedy output of the split the same text as the colocated replicas' for that prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cmx.bench.harness.core import BenchContext, Figure, Goal, SuiteResult, Table
from cmx.bench.harness.serve_app import ServeApp
from cmx.bench.suites.e2e.e2e_pairs import prompt_ids, ratio_interval

__all__ = ["SETUPS", "PDSettings", "RunStats", "run_prefill_decode", "run_stats"]

SUITE = "prefill-decode"
SETUPS = {"split": (1, 1), "colocated": (2, 0)}  # setup -> (replicas, prefill replicas)


@dataclass(frozen=True)
class PDSettings:
    # Sized to two cores: a replica prefills ~1K tokens in about a second and decodes a few
    # tokens a second beside it, so requests overlap and prefills land beside decodes.
    input_len: int = 1024
    output_len: int = 32
    requests: int = 12  # per run
    rate: float = 0.5  # requests per second, Poisson arrivals
    run_timeout_s: float = 1200.0


@dataclass(frozen=True)
class RunStats:
    """One client run against one application."""

    completed: int
    failed: int
    ttft_ms: tuple[float, ...]  # per completed request
    itl_ms: tuple[float, ...]  # every gap between streamed tokens of every completed request
    texts: tuple[str | None, ...]  # per request, in the dataset's order; None: it failed

    def ttft(self, q: float) -> float:
        return float(np.percentile(self.ttft_ms, q)) if self.ttft_ms else float("nan")

    def itl(self, q: float) -> float:
        return float(np.percentile(self.itl_ms, q)) if self.itl_ms else float("nan")


def run_stats(data: dict[str, Any], output_len: int) -> RunStats:
    """A ``RunStats`` from a result file of ``vllm bench serve --save-result --save-detailed``;
    ValueError if it lacks the per-request lists. A request completed when it reported no
    error and all ``output_len`` tokens (a stream cut short, or a failure with no reason
    phrase, did not)."""
    keys = ("ttfts", "itls", "generated_texts", "errors", "output_lens")
    missing = [k for k in keys if k not in data]
    if missing:
        raise ValueError(f"the result lacks {missing}: run the client with --save-detailed")
    ok = [not e and n == output_len
          for e, n in zip(data["errors"], data["output_lens"], strict=True)]
    return RunStats(
        completed=sum(ok), failed=len(ok) - sum(ok),
        ttft_ms=tuple(1e3 * t for t, good in zip(data["ttfts"], ok, strict=True) if good),
        itl_ms=tuple(1e3 * g for gaps, good in zip(data["itls"], ok, strict=True) if good
                     for g in gaps),
        texts=tuple(t if good else None
                    for t, good in zip(data["generated_texts"], ok, strict=True)))


def _client(app: ServeApp, base: str, model: str, s: PDSettings, seed: int,
            result: Path) -> RunStats:
    from cmx.models import smollm2_path

    args = ["--backend", "vllm", "--base-url", base.removesuffix("/v1"),
            "--model", smollm2_path(), "--served-model-name", model,
            "--dataset-name", "random", "--random-input-len", str(s.input_len),
            "--random-output-len", str(s.output_len), "--num-prompts", str(s.requests),
            "--request-rate", f"{s.rate:g}", "--seed", str(seed), "--temperature", "0",
            "--ignore-eos", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(result.parent), "--result-filename", result.name]
    with open(result.with_suffix(".log"), "w") as log:
        done = subprocess.run([sys.executable, "-m", "cmx.bench.suites.e2e.vllm_client", *args],
                              stdout=log, stderr=subprocess.STDOUT, timeout=s.run_timeout_s,
                              check=False, cwd=app.work)
    if done.returncode:
        tail = result.with_suffix(".log").read_text(errors="replace")[-800:]
        raise RuntimeError(f"vllm bench serve exited {done.returncode}: {tail}")
    return run_stats(json.loads(result.read_text()), s.output_len)


def _warm(base: str, model: str, seed: int, s: PDSettings, replica: str | None = None) -> int:
    """One untimed request of fresh random tokens (to ``replica``, or where the router sends
    it); the prompt tokens its answer says came from a cache (the split's decode replica loads
    the prefill's blocks)."""
    import httpx

    body: dict[str, Any] = {"model": model, "prompt": prompt_ids(seed, s.input_len),
                            "max_tokens": 2, "temperature": 0}
    if replica is not None:
        body["replica"] = replica
    reply = httpx.post(f"{base}/completions", json=body, timeout=s.run_timeout_s)
    reply.raise_for_status()
    details = reply.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _replica_ids(base: str) -> list[str]:
    import httpx

    listed = httpx.get(f"{base.removesuffix('/v1')}/cmx/replicas", timeout=60).json()
    return [str(r["replica"]) for r in listed["replicas"]]


def _model(base: str) -> str:
    import httpx

    return str(httpx.get(f"{base}/models", timeout=60).json()["data"][0]["id"])


def run_prefill_decode(ctx: BenchContext, settings: PDSettings | None = None) -> SuiteResult:
    s = settings or PDSettings()
    result = SuiteResult(SUITE, command="")
    apps = {name: ServeApp(ctx.scratch(f"pd-{name}"), ctx.log, replicas, prefill)
            for name, (replicas, prefill) in SETUPS.items()}
    runs: dict[str, list[RunStats]] = {name: [] for name in apps}
    cached: dict[str, int] = {}
    started: list[ServeApp] = []
    try:
        bases: dict[str, str] = {}
        for name, app in apps.items():
            started.append(app)
            bases[name] = app.start()
        model = _model(bases["split"])
        for name, base in bases.items():  # untimed: every replica's first requests
            cached[name] = _warm(base, model, 1, s)
            if apps[name].prefill_replicas:
                _warm(base, model, 2, s)  # the prefill replica computes every prompt
            else:
                for i, replica in enumerate(_replica_ids(base)):
                    _warm(base, model, 3 + i, s, replica)
        order = list(apps)
        for rep in range(ctx.config.reps):
            for name in order if rep % 2 == 0 else order[::-1]:
                out = ctx.scratch(f"pd-{name}") / f"run-{rep}.json"
                got = _client(apps[name], bases[name], model, s, 100 + rep, out)
                runs[name].append(got)
                ctx.log(f"prefill-decode {name} rep {rep + 1}: {got.completed} done, "
                        f"{got.failed} failed; TTFT p50 {got.ttft(50):.0f} ms, "
                        f"p99 {got.ttft(99):.0f} ms; ITL p50 {got.itl(50):.0f} ms, "
                        f"p99 {got.itl(99):.0f} ms")
    finally:
        for app in started:
            try:
                ctx.log(f"cmx serve --stop: {app.stop()}")
            except Exception as exc:  # noqa: BLE001 - the run's error stands; stop the others
                ctx.log(f"cmx serve --stop failed: {exc}")
    _report(result, s, runs, cached)
    return result


def _report(result: SuiteResult, s: PDSettings, runs: dict[str, list[RunStats]],
            cached: dict[str, int]) -> None:
    split, colo = runs["split"], runs["colocated"]
    base_name = ("cmx serve --replicas 2 (each replica prefills and decodes), same prompts, "
                 "alternated")
    for label, stat, q in (("TTFT p50", RunStats.ttft, 50), ("TTFT p99", RunStats.ttft, 99),
                           ("inter-token latency p50", RunStats.itl, 50),
                           ("inter-token latency p99", RunStats.itl, 99)):
        a = tuple(stat(r, q) for r in split)
        b = tuple(stat(r, q) for r in colo)
        result.figures.append(Figure(
            SUITE, f"{label}, cmx serve --replicas 1 --prefill-replicas 1", "ms", a, base_name,
            b, interval=ratio_interval(a, b),
            note="ratio of medians over repetitions, bootstrap interval"))
    pairs = [(x, y) for r, c in zip(split, colo, strict=True)
             for x, y in zip(r.texts, c.texts, strict=True)]
    same = sum(x is not None and x == y for x, y in pairs)
    failed = sum(r.failed for r in (*split, *colo))
    result.figures.append(Figure.count(
        SUITE, "greedy outputs of the split identical to the colocated replicas'", "requests",
        same, len(pairs), "requests sent to each", Goal(">=", 1.0),
        "goal: all identical (float32: the same token for token with and without the cache); "
        "a request either failed counts as not identical"))
    result.figures.append(Figure.count(
        SUITE, "requests that failed or came back short, both applications", "requests",
        failed, 2 * len(pairs), "requests sent to both", Goal("<=", 0.0),
        "goal: none; the latency figures are of completed requests only"))
    rows = []
    for name, got in runs.items():
        for rep, r in enumerate(got):
            rows.append((name, str(rep + 1), f"{r.completed}/{r.completed + r.failed}",
                         f"{r.ttft(50):.0f}", f"{r.ttft(99):.0f}", f"{r.itl(50):.0f}",
                         f"{r.itl(99):.0f}"))
    result.tables.append(Table(
        "Each run (ms)", ("setup", "repetition", "completed", "TTFT p50", "TTFT p99",
                          "ITL p50", "ITL p99"), tuple(rows)))
    result.notes.append(
        f"SmolLM2-135M-Instruct, vLLM CPU, float32, two replicas per application, both "
        f"applications up at once on this machine; {s.requests} requests a run of "
        f"{s.input_len} tokens (vLLM's random dataset, a seed per repetition), "
        f"{s.output_len} greedy tokens each, streamed, Poisson arrivals at {s.rate:g}/s")
    result.notes.append(
        "a fresh prompt's tokens the answer said were cached, before the timed runs: split "
        f"{cached.get('split', 0)}, colocated {cached.get('colocated', 0)} (the split's decode "
        "replica loads the prefill replica's whole blocks)")
