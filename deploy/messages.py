"""What the ingress sends a replica and what comes back (plain dataclasses, pickled by Ray)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cmx.deploy.sampling import SamplingParams

__all__ = ["GenerateRequest", "GenerateResult", "ReplicaInfo", "Timings"]


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # stop strings; the text ends before the first one
    use_cache: bool = True  # False: no lookup, no load, no store ("cache": false)
    ignore_eos: bool = False  # generate max_tokens whatever comes (benchmarks)
    keys: tuple[bytes, ...] = ()  # block keys of the prompt, for the router's lookup
    replica: str | None = None  # route to this replica id (tests, benchmarks), if it exists


@dataclass(frozen=True)
class Timings:
    queue_s: float  # arrival at the replica -> the replica starts it
    prefetch_wait_s: float  # the free replica waiting for the prefix to arrive
    load_s: float  # lookup, plan and load, until the engine had the KV it used
    prefill_s: float  # computing the rest of the prompt
    ttft_s: float  # arrival at the replica -> first token
    decode_s: float  # the other tokens
    total_s: float  # arrival at the replica -> last token


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was loaded, not computed
    matched_tokens: int  # prompt tokens the memory held (a plan may load fewer)
    served_from: dict[str, int]  # tokens loaded per source class ("dram@peer": 3584)
    prefetched_from: dict[str, int]  # where the prefetch on arrival moved tokens from
    timings: Timings
    plan: str  # the break-even decision, in words
    prefetch: str  # the prefetch's outcome: none, done, cut
    stored_tokens: int  # prompt tokens handed to the agent to store
    replica: str
    node: str


@dataclass(frozen=True)
class ReplicaInfo:
    replica: str
    node: str
    model: str
    namespace: dict[str, object]  # model, weights, salt, layout fields
    block_tokens: int
    chunk_tokens: int
    cache: bool  # the replica reaches the context memory
