"""``LLMServer``: one replica of the model, a thin Serve shell around ``Engine``.

A request that arrives starts its prefetch at once (on an I/O thread), then waits for the one
compute thread: requests queue *in* the replica (``max_ongoing_requests`` is large), so their
prefixes move while they wait. ``record_routing_stats`` reports what the router prices replicas
with: the node, the measured prefill speed and link costs, and the time per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cmx.deploy.config import ServeOptions
from cmx.deploy.engine import Engine
from cmx.deploy.memory import KVMemory, NamespaceMemory
from cmx.deploy.messages import GenerateRequest, GenerateResult, ReplicaInfo
from cmx.deploy.model import LoadedModel, NamespaceSpec, load_model
from cmx.policies.breakeven import BreakEven
from cmx.policies.prefetch import make_prefetch

__all__ = ["LLMServer", "connect_memory", "warm_up"]

log = logging.getLogger(__name__)


class LLMServer:
    def __init__(self, args: dict[str, Any]) -> None:
        import torch

        self.options = ServeOptions.from_args(args)
        torch.set_num_threads(self.options.torch_threads)
        self.replica_id, self.node = _identity()
        self.loaded: LoadedModel = load_model(self.options.model, self.options.engine)
        memory = connect_memory(self.loaded.spec, self.options) if self.options.use_cache else None
        eng = self.options.engine
        policy_options = {"timeout_s": eng.prefetch_timeout_s} if eng.prefetch == "timeout" else {}
        self.engine = Engine(
            self.loaded, memory, eng.chunk_tokens,
            BreakEven(margin=eng.margin, enabled=eng.gate),
            make_prefetch(eng.prefetch, **policy_options), replica=self.replica_id,
        )
        warm_up(self.engine, eng.warmup_tokens)
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="cmx-compute")
        self._io = ThreadPoolExecutor(4, thread_name_prefix="cmx-io")
        self._per_request_s = 1.0
        self.served = 0

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        arrived = time.monotonic()
        loop = asyncio.get_running_loop()
        prefetch = await loop.run_in_executor(self._io, self.engine.start_prefetch, req)
        result = await loop.run_in_executor(self._compute, self.engine.run, req, prefetch, arrived)
        busy = result.timings.total_s - result.timings.queue_s
        self._per_request_s = 0.8 * self._per_request_s + 0.2 * busy
        self.served += 1
        return result

    def info(self) -> ReplicaInfo:
        spec = self.loaded.spec
        layout = spec.layout
        return ReplicaInfo(
            replica=self.replica_id, node=self.node, model=spec.model,
            namespace={"model": spec.model, "weights": spec.weights, "salt": spec.salt,
                       "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
                       "head_dim": layout.head_dim, "dtype": layout.dtype,
                       "block_tokens": layout.block_tokens},
            block_tokens=layout.block_tokens, chunk_tokens=self.options.engine.chunk_tokens,
            cache=self.engine.memory is not None,
        )

    async def flush(self) -> int:
        """Wait until the stores handed out so far are committed (tests, benchmarks)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._io, self.engine.flush)
        return len(self.engine.pending_stores)

    def stats(self) -> dict[str, Any]:
        return {"replica": self.replica_id, "node": self.node, "served": self.served,
                "per_request_s": self._per_request_s, "gate": self.engine.gate.snapshot()}

    def record_routing_stats(self) -> dict[str, Any]:
        gate = self.engine.gate
        return {
            "node": self.node,
            "per_request_s": self._per_request_s,
            "prefill": list(gate.prefill.snapshot()),
            "links": {name: [lc.latency_s, lc.bandwidth] for name, lc in gate.links.items()},
            "gating": gate.enabled,
        }


def connect_memory(spec: NamespaceSpec, options: ServeOptions) -> KVMemory | None:
    """This replica's view of the service, or None (and a warning) if it cannot be reached."""
    try:
        from cmx.client import ContextMemory
        from cmx.config import ServiceConfig

        config = options.service or ServiceConfig.from_env()
        cm = ContextMemory.connect(config=config, start_service=False)
        return NamespaceMemory(cm.namespace(**spec.kwargs()))
    except Exception as exc:  # noqa: BLE001 - serve without a cache rather than not at all
        log.warning("context memory unavailable, serving without it: %s", exc)
        return None


def warm_up(engine: Engine, tokens: int) -> None:
    """Prefill ``tokens`` twice: the first warms the kernels, the second is measured."""
    import random

    from cmx.deploy.prefill import prefill

    if tokens <= 0:
        return
    rng = random.Random(0)
    ids = [rng.randrange(8, 264) for _ in range(tokens)]
    loaded = engine.loaded
    prefill(loaded.model, loaded.config, ids, engine.chunk)
    outcome = prefill(loaded.model, loaded.config, ids, engine.chunk)
    for s, e, seconds in outcome.computed:
        engine.gate.observe_prefill(s, e, seconds)


def _identity() -> tuple[str, str]:
    import ray

    node = ray.get_runtime_context().get_node_id()
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id, node
    except Exception:  # noqa: BLE001 - outside Serve (tests): a name of our own
        return f"local-{node[:8]}", node
