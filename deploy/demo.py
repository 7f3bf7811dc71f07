"""``cmx demo``: the main job. Two vLLM replicas of SmolLM2-135M-Instruct, one per node of an
embedded two-node cluster, each with the context memory as its KV connector, serve a workload
of shared-prefix requests through the OpenAI API, with the context memory and again without it.

For each wave of the workload (``workload``): its requests go out together with the cache on
(routed by the prefix-aware router); then the same requests again with ``"cache": false``
(computed from scratch: no load, no store, no engine-local reuse), each to the replica that
served it, for the baseline. Per request: time to first token both ways, the prompt tokens that
were not computed and how many of them came from the context memory, and whether the output is
the same tokens. Then the tiers' and agents' figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cmx.deploy.config import EngineOptions, ModelOptions, ServeOptions
from cmx.deploy.workload import Ask, Conversation, make_workload
from cmx.stats import ServiceStats

__all__ = ["LLMDemoOptions", "LLMDemoResult", "RequestRow", "run_llm_demo"]

Progress = Callable[[str, int, int], None]  # (what, done, total)


@dataclass(frozen=True)
class LLMDemoOptions:
    scale: float = 1.0  # multiplies the workload's text lengths (about 4 bytes a token)
    seed: int = 0  # seeds the workload's texts
    model: ModelOptions = field(default_factory=ModelOptions)


@dataclass(frozen=True)
class RequestRow:
    index: int
    wave: int
    label: str
    replica: str  # "R1" (head node) or "R2"
    prompt_tokens: int
    cached_tokens: int  # not computed: vLLM's own prefix cache and the context memory
    loaded_tokens: int  # of those, loaded from the context memory
    prefetch: str  # the prefetch on arrival: none, done, cut, failed
    ttft_cached_s: float
    ttft_recompute_s: float
    same_output: bool
    sampled: bool  # temperature > 0 with a seed (else greedy)

    @property
    def speedup(self) -> float:
        return self.ttft_recompute_s / self.ttft_cached_s if self.ttft_cached_s else 0.0


@dataclass
class LLMDemoResult:
    rows: list[RequestRow]
    replicas: dict[str, str]  # "R1" -> node name
    stats: ServiceStats  # ContextMemory.stats() after the workload
    node_names: dict[str, str]  # node id -> "head" / "worker"
    model: str
    setup_s: float
    replay_s: float

    @property
    def ok(self) -> bool:
        return all(r.same_output for r in self.rows)


def run_llm_demo(opts: LLMDemoOptions, progress: Progress,
                 step: Callable[[str], None] = lambda _s: None) -> LLMDemoResult:
    from openai import OpenAI

    from cmx.deploy.local import local_app

    workload = make_workload(opts.seed, opts.scale)
    # float32: the comparison with and without the cache is token for token, and bfloat16's
    # rounding differs between a prompt computed in one pass and its tail over a cached prefix
    # (vLLM's own prefix cache included).
    options = ServeOptions(model=opts.model, replicas=2,
                           engine=EngineOptions(dtype="float32"))
    t0 = time.perf_counter()
    with local_app(options, step=step) as app:
        setup_s = time.perf_counter() - t0
        client = OpenAI(base_url=app.openai_url, api_key="unused", timeout=900, max_retries=0)
        model = options.model.model_id
        names = {r["replica"]: f"R{i + 1}" for i, r in enumerate(app.replicas)}
        node_names = {app.replicas[0]["node"]: "head", app.replicas[1]["node"]: "worker"}
        conversations: dict[str, Conversation] = {}
        rows: list[RequestRow] = []
        total = workload.requests * 2
        progress("replaying the workload", 0, total)
        t1 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            for w, wave in enumerate(workload.waves, 1):
                messages = [workload.messages(ask, conversations) for ask in wave]
                calls = [_call(workload, ask, m, len(rows) + i)
                         for i, (ask, m) in enumerate(zip(wave, messages))]
                cached = list(pool.map(lambda c: _chat(client, model, c, cache=True), calls))
                progress(f"wave {w}: cache off", len(rows) * 2 + len(wave), total)
                served_by = [r.model_extra["cmx"]["replica"] for r in cached]
                baseline = list(pool.map(
                    lambda cr: _chat(client, model, cr[0], cache=False, replica=cr[1]),
                    zip(calls, served_by)))
                for ask, call, hit, miss in zip(wave, calls, cached, baseline):
                    ext, base = hit.model_extra["cmx"], miss.model_extra["cmx"]
                    rows.append(RequestRow(
                        index=len(rows) + 1, wave=w, label=ask.label,
                        replica=names.get(ext["replica"], ext["replica"]),
                        prompt_tokens=hit.usage.prompt_tokens,
                        cached_tokens=hit.usage.prompt_tokens_details.cached_tokens,
                        loaded_tokens=ext["loaded_tokens"], prefetch=ext["prefetch"],
                        ttft_cached_s=ext["ttft_s"],
                        ttft_recompute_s=base["ttft_s"],
                        same_output=ext["completion_token_ids"] == base["completion_token_ids"],
                        sampled=call["temperature"] > 0,
                    ))
                    if ask.conversation is not None:
                        conv = conversations[ask.conversation]
                        conv.history += [call["messages"][-1],
                                         _assistant(hit.choices[0].message.content or "")]
                progress(f"wave {w} done", len(rows) * 2, total)
        replay_s = time.perf_counter() - t1
        stats = app.cm.stats()
    replicas = {names[r["replica"]]: node_names[r["node"]] for r in app.replicas}
    return LLMDemoResult(rows, replicas, stats, node_names, options.model.model_id, setup_s,
                         replay_s)


def _call(workload: Any, ask: Ask, messages: list[Any], i: int) -> dict[str, Any]:
    chat = ask.conversation is not None
    return {
        "messages": messages,
        "max_tokens": workload.chat_max_tokens if chat else workload.max_tokens,
        # Conversations sample (with a seed, so the baseline can be compared); questions are
        # answered greedily.
        "temperature": 0.8 if chat else 0.0,
        "seed": 1000 + i if chat else None,
    }


def _chat(client: Any, model: str, call: dict[str, Any], cache: bool,
          replica: str | None = None) -> Any:
    body: dict[str, Any] = {"cache": cache}
    if replica is not None:
        body["replica"] = replica
    return client.chat.completions.create(
        model=model,
        messages=[{"role": m.role, "content": m.content} for m in call["messages"]],
        max_tokens=call["max_tokens"], temperature=call["temperature"], seed=call["seed"],
        extra_body=body,
    )


def _assistant(text: str) -> Any:
    from cmx.deploy.workload import Message

    return Message("assistant", text)
