"""What the ingress sends a replica and what comes back (plain dataclasses, pickled by Ray).

A replica answers a ``GenerateRequest`` with a stream: lists of ``Delta`` (new tokens and text
of one choice) as the engine makes them, then one ``Summary``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Delta", "GenerateRequest", "ReplicaInfo", "Sampling", "Summary"]


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # a sampled request with a seed repeats
    n: int = 1  # choices
    stop: tuple[str, ...] = ()  # the text of a choice ends before the first of these
    ignore_eos: bool = False  # generate max_tokens whatever comes (benchmarks)


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    salt: str = ""  # the tenant's namespace salt; goes to the engine, never back to a client
    use_cache: bool = True  # False: computed from scratch (no load, no store, no local reuse)
    keys: tuple[bytes, ...] = ()  # the prompt's block keys in the tenant's namespace (router)
    replica: str | None = None  # route to this replica id (tests, benchmarks), if it exists
    expect_tokens: int = 0  # a prefill replica stored this many of its prompt's tokens


@dataclass(frozen=True)
class Delta:
    index: int  # the choice
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "stop" or "length" on a choice's last delta


@dataclass(frozen=True)
class Summary:
    """The last item of a replica's stream."""

    prompt_tokens: int
    cached_tokens: int  # prompt tokens not computed: the engine's own prefix cache and loads
    loaded_tokens: int  # of those, loaded from the context memory (the connector's report)
    ttft_s: float  # arrival at the replica -> first token
    total_s: float  # arrival at the replica -> last token
    prefetch: str  # the prefetch on arrival: none, done, cut, failed
    replica: str
    node: str
    memory: dict[str, Any] = field(default_factory=dict)  # the connector's per-request report


@dataclass(frozen=True)
class ReplicaInfo:
    replica: str
    node: str
    model: str
    namespace: dict[str, object]  # model, weights and layout fields; no salt
    block_tokens: int
    max_model_len: int  # prompt plus generated tokens
    vocab_size: int
    cache: bool  # the replica reaches the context memory
