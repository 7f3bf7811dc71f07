"""Options of the Serve application: the model, the engine around it, and the deployment.

Frozen, typed, one comment per field. They travel to the replicas inside the application's
arguments (``ServeOptions.to_args`` / ``from_args``), so a Serve config file can carry them too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cmx.config import ServiceConfig

__all__ = ["EngineOptions", "ModelOptions", "ServeOptions"]


@dataclass(frozen=True)
class ModelOptions:
    """The causal LM. ``path`` None: a Llama with seeded random weights, nothing downloaded."""

    path: str | None = None  # a local Hugging Face model directory (weights and tokenizer)
    name: str | None = None  # the model id clients send; default: the directory's name
    seed: int = 0  # torch.manual_seed before the random model's weights are made
    hidden_size: int = 512  # random model: width
    intermediate_size: int = 2048  # random model: MLP width
    num_layers: int = 6  # random model: decoder layers
    num_heads: int = 8  # random model: query heads (head_dim = hidden_size / num_heads)
    num_kv_heads: int = 2  # random model: KV heads (GQA groups of num_heads / num_kv_heads)
    vocab_size: int = 32_000  # random model: vocabulary; the byte tokenizer uses the first 264
    max_positions: int = 32_768  # random model: RoPE positions, so 16K-token prompts fit
    attn: str = "sdpa"  # attention implementation; "sdpa" and "eager" give exact reuse

    @property
    def model_id(self) -> str:
        if self.name:
            return self.name
        if self.path:
            return self.path.rstrip("/").rsplit("/", 1)[-1]
        return "cmx-llama-random"


@dataclass(frozen=True)
class EngineOptions:
    """How a replica runs the model and uses the context memory."""

    block_tokens: int = 256  # tokens per cached block
    chunk_tokens: int = 256  # prefill chunk; a multiple of block_tokens (see engine: exactness)
    threads: int | None = None  # torch threads per replica; None: cores / replicas, at least 1
    salt: str = ""  # tenant salt of the namespace: different salts never share a block
    prefetch: str = "wait_complete"  # prefetch policy (cmx.policies.prefetch)
    prefetch_timeout_s: float = 0.5  # for the "timeout" policy
    margin: float = 0.05  # a load must beat recompute by this fraction (break-even gating)
    gate: bool = True  # False: load every hit, however slow (tests of the load path)
    warmup_tokens: int = 1024  # prefilled at start: warms kernels, measures prefill speed
    max_tokens_limit: int = 4096  # the most tokens one request may generate

    def __post_init__(self) -> None:
        if self.block_tokens <= 0 or self.chunk_tokens % self.block_tokens:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} must be a positive multiple of "
                             f"block_tokens {self.block_tokens}")


@dataclass(frozen=True)
class ServeOptions:
    """The application: replicas of the model behind an OpenAI-compatible ingress."""

    model: ModelOptions = field(default_factory=ModelOptions)
    engine: EngineOptions = field(default_factory=EngineOptions)
    replicas: int = 2  # LLM replicas
    app_name: str = "cmx-llm"  # Serve application name
    route_prefix: str = "/"  # the OpenAI routes live under <route_prefix>v1/
    replica_cpus: float = 0.0  # Ray CPUs reserved per replica (0: fit beside the service)
    max_ongoing_requests: int = 32  # per replica; requests queue in the replica, prefetching
    max_replicas_per_node: int | None = None  # 1 spreads replicas over nodes
    directory_shards: int = 2  # of the running service, for the router's lookups
    route_lookup_timeout_s: float = 0.25  # the router's directory lookup; late = no preference
    use_cache: bool = True  # False: every request recomputes (requests can still opt out)
    service: ServiceConfig | None = None  # the running service's config; None: from CMX_* env

    def replace(self, **changes: Any) -> ServeOptions:
        return dataclasses.replace(self, **changes)

    def to_args(self) -> dict[str, Any]:
        """Plain data for a Serve config's ``args`` (and for ``from_args``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> ServeOptions:
        args = dict(args or {})
        model = ModelOptions(**args.pop("model", {}) or {})
        engine = EngineOptions(**args.pop("engine", {}) or {})
        service = args.pop("service", None)
        if isinstance(service, dict):
            service = ServiceConfig(**service)
        return cls(model=model, engine=engine, service=service, **args)

    @property
    def torch_threads(self) -> int:
        if self.engine.threads:
            return self.engine.threads
        import os

        return max(1, (os.cpu_count() or 1) // max(1, self.replicas))
