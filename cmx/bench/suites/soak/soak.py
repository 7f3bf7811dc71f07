"""Suite "soak": the application as users run it, under faults, for ``--minutes`` (default 30).

``cmx serve --replicas 2 --dtype float32`` (vLLM's CPU build, SmolLM2-135M-Instruct, an API key
file with two tenants, its own Ray head, state directory and NVMe directory), driven through the
OpenAI client by streamed chat completions at a steady rate (``soak_traffic``): greedy and
sampled, prompts sharing a system prompt and one of two documents. First the greedy prompts'
cache-off outputs (``"cache": false``: the reference); then the traffic, while a tier actor,
the agent, a directory shard and a replica are killed at seeded random intervals
(``soak_faults``); then ``cmx serve --stop``.

Figures (``soak_figures``): requests completed, failed cleanly, cut, hung (goal: none); greedy
outputs identical to the reference (float32: the same token for token with and without the
cache; goal: all); resident memory of the cluster's processes and the application's /dev/shm,
end over start (goal: flat); p99 TTFT per window.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from cmx.bench.harness.core import BenchContext, SuiteResult
from cmx.bench.harness.serve_app import ServeApp, replicas_up, wait_replicas
from cmx.bench.suites.soak.soak_faults import Killer, ProcessMemory
from cmx.bench.suites.soak.soak_figures import (
    Outcome,
    Snapshot,
    greedy_mismatches,
    soak_figures,
    soak_tables,
)
from cmx.bench.suites.soak.soak_traffic import SoakTraffic, TrafficShape, ask, make_prompts

__all__ = ["SoakSettings", "run_soak"]

TENANTS = ("tenant-a", "tenant-b")
REPLICAS = 2


@dataclass(frozen=True)
class SoakSettings:
    minutes: float = 30.0  # of traffic
    rate: float = 0.25  # requests per second: two cores serve it with a replica down
    greedy_share: float = 0.5
    greedy_prompts: int = 8  # prompts sent greedy, each with its cache-off reference
    prompts: int = 40  # greedy and sampled together
    max_tokens: int = 16
    bound_s: float = 120.0  # a request with no whole answer within this hung
    kill_every_s: float = 90.0  # mean gap between kills (each 0.5-1.5x of it), at most a fifth
    window_s: float = 300.0  # of p99 TTFT, at most a quarter of the run
    settle_s: float = 30.0  # after the traffic, before the last memory sample
    seed: int = 7

    @property
    def duration_s(self) -> float:
        return self.minutes * 60

    @property
    def kill_gap_s(self) -> float:
        return min(self.kill_every_s, self.duration_s / 5)

    @property
    def window(self) -> float:
        return min(self.window_s, self.duration_s / 4)


def run_soak(ctx: BenchContext, settings: SoakSettings | None = None) -> SuiteResult:
    import openai
    import ray

    from cmx.operate.ray_cluster import join

    s = settings or SoakSettings(minutes=ctx.config.minutes)
    result = SuiteResult("soak", command="")
    serve = ServeApp(ctx.scratch("soak"), ctx.log, REPLICAS, tenants=TENANTS)
    try:
        base = serve.start()
        state = serve.state()
        clients = {t: openai.OpenAI(base_url=base, api_key=k, timeout=s.bound_s, max_retries=0)
                   for t, k in serve.keys.items()}
        model = clients[TENANTS[0]].models.list().data[0].id
        prompts = make_prompts(s.seed, s.prompts)
        reference = []
        for i in range(s.greedy_prompts):
            outcome, _, total, text, error = ask(clients[TENANTS[0]], model, prompts[i],
                                                 s.max_tokens, s.bound_s, cache=False)
            if outcome is not Outcome.COMPLETED:
                raise RuntimeError(f"the cache-off reference of prompt {i}: {outcome.value}: "
                                   f"{error}")
            reference.append(text)
            ctx.log(f"reference {i} ({total:.1f} s): {text!r}")
        join(state["ray_address"], log_to_driver=False)
        # One node, this machine's: the driver's node is the application's.
        memory = ProcessMemory(int(state["ray_pid"]), ray.get_runtime_context().get_node_id())
        shape = TrafficShape(s.rate, s.greedy_share, s.greedy_prompts, s.max_tokens, s.bound_s,
                             s.seed)
        traffic = SoakTraffic(clients, model, prompts, shape, ctx.log)
        killer = Killer(state["app"], s.kill_gap_s, s.seed, traffic.elapsed,
                        lambda: replicas_up(base), REPLICAS, ctx.log)
        samples = [memory.snapshot(0.0)]
        traffic.start()
        killer.start()
        load = [os.getloadavg()[0]]
        try:
            while traffic.elapsed() < s.duration_s:
                time.sleep(min(s.window, s.duration_s - traffic.elapsed()))
                samples.append(memory.snapshot(traffic.elapsed()))
                load.append(os.getloadavg()[0])
                ctx.log(f"{traffic.elapsed() / 60:.1f} min: {len(traffic.records)} answered, "
                        f"{samples[-1].rss_bytes >> 20} MiB resident")
        finally:
            killer.stop()
            traffic.stop()
        replicas = wait_replicas(base, REPLICAS, 300)
        time.sleep(s.settle_s)
        end = memory.snapshot(traffic.elapsed())
        samples.append(end)
        ray.shutdown()
    finally:  # a start that failed or timed out too: what it started is stopped
        ray.shutdown()
        try:
            ctx.log(f"cmx serve --stop: {serve.stop()}")
        except Exception as exc:  # noqa: BLE001 - the run's own error stands
            ctx.log(f"cmx serve --stop failed: {exc}")
    _report(result, s, traffic, killer, reference, samples, replicas, load)
    return result


def _report(result: SuiteResult, s: SoakSettings, traffic: SoakTraffic, killer: Killer,
            reference: list[str], samples: list[Snapshot], replicas: int,
            load: list[float]) -> None:
    records = sorted(traffic.records, key=lambda r: r.sent_s)
    result.figures += soak_figures(records, reference, samples[0], samples[-1])
    result.tables += soak_tables(records, s.window, s.duration_s, killer.kills, samples)
    kinds = {k.kind for k in killer.kills if k.killed}
    result.notes += [
        f"cmx serve --replicas {REPLICAS} --dtype float32 (SmolLM2-135M-Instruct, vLLM CPU), "
        f"its own Ray head; {s.minutes:g} min of streamed chat completions at {s.rate:g}/s, "
        f"{s.greedy_share:.0%} greedy over {s.greedy_prompts} prompts, the rest sampled "
        f"(temperature 0.8) over {s.prompts - s.greedy_prompts}; {len(TENANTS)} tenants by API "
        f"key; {s.max_tokens} tokens each; bound {s.bound_s:g} s",
        f"{sum(k.killed for k in killer.kills)} kills of {len(killer.kills)} tried, every "
        f"{s.kill_gap_s:.0f} s on average (seed {s.seed}); kinds killed: "
        f"{', '.join(sorted(kinds)) or 'none'}; {replicas} of {REPLICAS} replicas answered "
        f"before the last memory sample",
        f"load average (1 min) over the run: {min(load):.1f}-{max(load):.1f}",
    ]
    for r in greedy_mismatches(records, reference)[:5]:
        result.notes.append(f"greedy prompt {r.prompt} at {r.sent_s:.0f} s ({r.tenant}): "
                            f"{r.text!r}, cache-off {reference[r.prompt]!r}")
    for r in [r for r in records if r.outcome is not Outcome.COMPLETED][:5]:
        result.notes.append(f"{r.outcome.value} at {r.sent_s:.0f} s ({r.tenant}, prompt "
                            f"{r.prompt}) after {r.total_s:.1f} s: {r.error[:300]}")
