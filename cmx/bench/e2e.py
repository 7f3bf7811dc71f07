"""Suite "e2e": time to first token through the Serve application, a cached prefix against
recompute, on a two-node local cluster with one replica per node (``cmx.deploy.local``).

By prefix length: a prompt of N tokens whose first 90% replica A computed and stored is sent to
replica B, on the other node, with the cache (the production path: prefetch on arrival,
break-even gate, chunked prefill adopting the load), then again with ``"cache": false``. The
baseline of every figure is that recompute, measured in the same repetition, on the same
replica, with the same prompt. Each repetition uses a new random prefix.

By tier: at 4,096 tokens, the same prefix served from each place it can be, seen from the
replica that loads it: this node's HBM, DRAM, NVMe, and the other node's DRAM and NVMe (the
service stores write-through, and the bench evicts the memory copies to leave only NVMe ones).
A tier slower than recompute must not make the first token later: the gate's goal is ratio <= 1.

TTFT is the replica's own: from the request's arrival at the replica to its first token.
"""

from __future__ import annotations

import random
import time
from typing import Any

from cmx.bench.core import BenchContext, Figure, Goal, SuiteResult, Table

__all__ = ["LENGTHS", "run_e2e"]

LENGTHS = (1024, 2048, 4096, 8192, 16384)  # prompt tokens
SHARE = 0.9  # of each prompt, the prefix the other replica stored
TIER_TOKENS = 4096
SOURCES = ("dram@peer", "dram", "hbm", "nvme@peer", "nvme")


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 264) for _ in range(n)]  # byte-tokenizer ids: any text


class _Driver:
    def __init__(self, app: Any, ctx: BenchContext) -> None:
        import httpx

        self.app = app
        self.ctx = ctx
        self.http = httpx.Client(timeout=900)
        self.ns = app.namespace()
        self.head, self.other = app.replicas  # head node's replica first
        self.rows: list[tuple[str, ...]] = []

    def ask(self, ids: list[int], replica: dict[str, str], cache: bool = True) -> dict[str, Any]:
        body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
                "replica": replica["replica"], "cache": cache}
        r = self.http.post(f"{self.app.openai_url}/completions", json=body)
        r.raise_for_status()
        ext: dict[str, Any] = r.json()["cmx"]
        if ext["replica"] != replica["replica"]:
            raise AssertionError(f"asked for {replica['replica']}, served by {ext['replica']}")
        return ext

    def wait_stored(self, ids: list[int], tokens: int, tier: str | None = None) -> None:
        """Until the first ``tokens`` of ``ids`` (whole blocks of them) are visible."""
        T = self.ns.layout.block_tokens
        tokens = min(tokens, len(ids)) // T * T
        deadline = time.monotonic() + 120
        while True:
            match = self.ns.lookup(ids)
            have = match.num_tokens >= tokens and (tier is None or all(
                any(c.tier.value == tier for c in b.copies) for b in match.blocks))
            if have:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{tokens} tokens never became visible ({tier or 'any'})")
            time.sleep(0.2)

    def evict_memory(self, ids: list[int]) -> None:
        """Drop the prefix's HBM and DRAM copies on every node: only NVMe copies remain."""
        import ray

        from cmx.actors.links import RAY_NAMESPACE, actor_name

        keys = self.ns.keys(ids)
        for node in {self.head["node"], self.other["node"]}:
            for tier in ("hbm", "dram"):
                actor = ray.get_actor(actor_name(tier, node), namespace=RAY_NAMESPACE)
                ray.get(actor.evict.remote(keys), timeout=60)

    def pair(self, label: str, ids: list[int], replica: dict[str, str]) -> tuple[float, float]:
        """(cached TTFT, recompute TTFT) of ``ids`` on ``replica``; one table row."""
        hit = self.ask(ids, replica)
        miss = self.ask(ids, replica, cache=False)
        same = hit["completion_token_ids"] == miss["completion_token_ids"]
        served = ", ".join(f"{k} {v}" for k, v in hit["served_from"].items()) or "-"
        self.rows.append((label, str(len(ids)), str(hit["cached_tokens"]), served,
                          f"{hit['ttft_s']:.3f}", f"{miss['ttft_s']:.3f}",
                          f"{miss['ttft_s'] / hit['ttft_s']:.1f}x",
                          f"{hit['timings']['prefetch_wait_s'] + hit['timings']['load_s']:.3f}",
                          hit["prefetch"], "yes" if same else "NO"))
        if not same:
            raise AssertionError(f"{label}: greedy tokens differ with the cache")
        self.ctx.log(f"{label}: {hit['ttft_s']:.3f} s cached ({hit['cached_tokens']} tokens, "
                     f"{served}) vs {miss['ttft_s']:.3f} s recompute")
        return hit["ttft_s"], miss["ttft_s"]


def _by_length(d: _Driver, reps: int, lengths: tuple[int, ...]) -> list[Figure]:
    figures = []
    for n in lengths:
        cached, recompute = [], []
        for rep in range(reps):
            rng = random.Random(n * 1000 + rep)
            prefix = _ids(rng, int(n * SHARE))
            seed = d.ask(prefix + _ids(rng, n - len(prefix)), d.head)
            d.wait_stored(prefix, seed["stored_tokens"])
            c, r = d.pair(f"{n} tokens, rep {rep + 1}", prefix + _ids(rng, n - len(prefix)),
                          d.other)
            cached.append(c)
            recompute.append(r)
        figures.append(Figure(
            suite="e2e",
            name=f"TTFT, {n:,}-token prompt, 90% stored by the other replica",
            unit="s", samples=tuple(cached),
            baseline_name="recompute (cache off), same replica and prompt",
            baseline_samples=tuple(recompute),
            goal=Goal("<=", 0.25) if n >= 4096 else None,
            note="ratio <= 0.25: at least 4x lower TTFT than recompute" if n >= 4096 else "",
        ))
    return figures


def _by_tier(d: _Driver, reps: int) -> list[Figure]:
    samples: dict[str, tuple[list[float], list[float]]] = {s: ([], []) for s in SOURCES}
    for rep in range(reps):
        rng = random.Random(77_000 + rep)
        n = TIER_TOKENS
        prefix = _ids(rng, int(n * SHARE))

        def prompt(prefix: list[int] = prefix, rng: random.Random = rng) -> list[int]:
            return prefix + _ids(rng, TIER_TOKENS - len(prefix))

        seed = d.ask(prompt(), d.head)
        d.wait_stored(prefix, seed["stored_tokens"], tier="nvme")
        order = (("dram@peer", d.other), ("dram", d.head), ("hbm", d.head),
                 ("evict", None), ("nvme@peer", d.other), ("evict", None), ("nvme", d.head))
        for source, replica in order:
            if replica is None:
                d.evict_memory(prefix)
                continue
            c, r = d.pair(f"{n} tokens in {source}, rep {rep + 1}", prompt(), replica)
            samples[source][0].append(c)
            samples[source][1].append(r)
    return [Figure(
        suite="e2e", name=f"TTFT, {TIER_TOKENS:,}-token prompt, 90% prefix in {source}",
        unit="s", samples=tuple(c), baseline_name="recompute (cache off), same replica",
        baseline_samples=tuple(r), goal=Goal("<=", 1.0),
        note="never worse than recompute (break-even gate)",
    ) for source, (c, r) in samples.items()]


def run_e2e(ctx: BenchContext, lengths: tuple[int, ...] = LENGTHS) -> SuiteResult:
    from cmx.deploy.config import ServeOptions
    from cmx.deploy.local import local_app

    result = SuiteResult("e2e", command="")
    options = ServeOptions()
    scratch = str(ctx.scratch("e2e"))
    with local_app(options, service={"placement": "write_through"}, step=ctx.log,
                   scratch=scratch) as app:
        d = _Driver(app, ctx)
        result.figures += _by_length(d, ctx.config.reps, lengths)
        result.figures += _by_tier(d, ctx.config.reps)
        m = options.model
        result.notes.append(
            f"model: random Llama, {m.num_layers} layers, hidden {m.hidden_size}, "
            f"{m.num_heads} heads / {m.num_kv_heads} KV heads, float32, "
            f"{options.torch_threads} torch thread(s) per replica; blocks of "
            f"{options.engine.block_tokens} tokens, prefill chunk {options.engine.chunk_tokens} "
            f"(a prefix is reused up to its last whole chunk); two Ray nodes on this machine, "
            f"one replica each; TTFT measured by the replica, arrival to first token")
    result.tables.append(Table(
        "Requests (cached run, then the same prompt with the cache off)",
        ("request", "prompt", "cached", "served from", "TTFT cached s", "TTFT recompute s",
         "speedup", "prefetch+load s", "prefetch", "same tokens"),
        tuple(d.rows)))
    return result
