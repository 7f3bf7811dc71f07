"""``LLMServer``: one replica, vLLM's ``AsyncLLM`` with the context memory as its KV connector.

A request that arrives starts moving its cached prefix to this node at once (prefetch on
arrival, on an I/O thread), waits for that move as the prefetch policy says (bounded), then
goes to vLLM, whose scheduler asks the connector for the longest cached prefix (gated by
break-even) while the request waits in vLLM's queue. The replica streams ``Delta`` lists as
vLLM makes tokens, then a ``Summary``. ``record_routing_stats`` reports what the router prices
replicas with: the node and the time per request.

Startup is deployable as shipped: the replica starts the context memory service if it is not
running (or joins it), checks that the service's slots hold one of the model's blocks (else it
fails with the number to set), and only then builds the engine.

Shutdown (Serve calls ``__del__``) stops the engine, waits a bounded while for its processes to
exit, and unlinks the shared memory they left (``EngineSegments``, recorded when the engine came
up); a replica killed instead leaves that to the sentinel it started when it recorded
(``EngineSegments.watch``); a replica starting unlinks what engines of earlier replicas on this
host left.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cmx.deploy.config import ServeOptions
from cmx.deploy.errors import BadRequest
from cmx.deploy.messages import Delta, GenerateRequest, ReplicaInfo, Summary
from cmx.deploy.model import ModelInfo, model_info
from cmx.deploy.service import MemoryLink, join_service
from cmx.operate.orphans import EngineSegments
from cmx.policies.prefetch import PrefetchOutcome, make_prefetch

__all__ = ["LLMServer"]

log = logging.getLogger(__name__)

ENGINE_EXIT_S = 8.0  # how long a stopping replica waits for its engine's processes to exit


class LLMServer:
    def __init__(self, args: dict[str, Any], kv_role: str = "kv_both") -> None:
        from cmx.deploy.vllm_engine import build_engine, transfer_config

        self.options = ServeOptions.from_args(args)
        self.replica_id, self.node = _identity()
        self.model: ModelInfo = model_info(self.options.model, self.options.engine)
        eng = self.options.engine
        self.memory: MemoryLink | None = None
        kv = None
        if eng.connector == "cmx":
            self.memory = join_service(self.options, self.model)
            kv = transfer_config(self.options, self.model, self.memory.config,
                                 self.memory.ray_address, self.node, kv_role)
        elif eng.connector != "none":
            kv = transfer_config(self.options, self.model, self.options.service or _default())
        self._segments = EngineSegments.default()
        self._segments.reap()  # of engines on this host gone before this one
        self.engine = build_engine(self.options, self.model, kv)
        self._record: str | None = None
        try:
            self._record = self._segments.record(_engine_processes())
        except OSError as exc:  # no record: what the engine leaves is not reaped
            log.warning("the engine's shared memory was not recorded: %s", exc)
        if self._record is not None:  # killed with its engine, this replica reaps nothing
            self._segments.watch(self._record)
        options = {"timeout_s": eng.prefetch_timeout_s} if eng.prefetch == "timeout" else {}
        self.policy = make_prefetch(eng.prefetch, **options)
        self._io = ThreadPoolExecutor(4, thread_name_prefix="cmx-io")
        self._per_request_s = 1.0
        self.served = 0

    async def generate(self, req: GenerateRequest) -> AsyncIterator[list[Delta] | Summary]:
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        arrived = time.monotonic()
        prefetch = await self._prefetch(req)
        s = req.sampling
        kv_params: dict[str, Any] = {"cmx": {"load": req.use_cache, "store": req.use_cache}}
        if req.expect_tokens:  # the prefill's store to wait for (cmx.connectors.vllm_requests)
            kv_params["cmx"]["expect_tokens"] = req.expect_tokens
        try:
            params = SamplingParams(
                n=s.n, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                max_tokens=s.max_tokens, stop=list(s.stop) or None, ignore_eos=s.ignore_eos,
                output_kind=RequestOutputKind.DELTA,
                extra_args={"kv_transfer_params": kv_params})
        except Exception as exc:
            raise _client_error(exc) from exc
        # A request with the cache off gets a salt of its own, so that vLLM's local prefix cache
        # does not serve it either: it is computed from scratch.
        salt = req.salt if req.use_cache else f"nocache-{uuid.uuid4().hex}"
        prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt_ids)}
        if salt:
            prompt["cache_salt"] = salt
        first: float | None = None
        last: Any = None
        try:
            async for out in self.engine.generate(prompt, params, req.request_id):
                deltas = [Delta(o.index, tuple(o.token_ids), o.text, o.finish_reason)
                          for o in out.outputs]
                if first is None and any(d.token_ids for d in deltas):
                    first = time.monotonic()
                last = out
                if deltas:
                    yield deltas
        except Exception as exc:
            raise _client_error(exc) from exc
        yield self._summary(req, last, arrived, first, prefetch)

    def _summary(self, req: GenerateRequest, out: Any, arrived: float, first: float | None,
                 prefetch: str) -> Summary:
        end = time.monotonic()
        cached = int(getattr(out, "num_cached_tokens", 0) or 0)
        report = _report(getattr(out, "kv_transfer_params", None))
        ttft = (first or end) - arrived
        self._per_request_s = 0.8 * self._per_request_s + 0.2 * (end - arrived)
        self.served += 1
        return Summary(
            prompt_tokens=len(req.prompt_ids), cached_tokens=cached,
            loaded_tokens=int(report.get("loaded_tokens", 0) or 0), ttft_s=ttft,
            total_s=end - arrived, prefetch=prefetch, replica=self.replica_id, node=self.node,
            memory=report)

    async def _prefetch(self, req: GenerateRequest) -> str:
        """Move the request's cached prefix here, and wait as the policy says; the outcome."""
        if not req.use_cache or self.memory is None:
            return PrefetchOutcome.NONE.value
        loop = asyncio.get_running_loop()
        try:
            pending = await loop.run_in_executor(
                self._io, self.memory.prefetch, req.salt, req.prompt_ids)
            cap = self.options.engine.prefetch_timeout_s * 4
            waited = await loop.run_in_executor(
                self._io, self.policy.wait, pending, time.monotonic, cap)
            return str(waited.outcome.value)
        except Exception as exc:  # noqa: BLE001 - a prefetch that fails is no prefetch
            log.warning("prefetch failed: %s", exc)
            return "failed"

    async def info(self) -> ReplicaInfo:
        m = self.model
        return ReplicaInfo(
            replica=self.replica_id, node=self.node, model=m.name, namespace=m.namespace(),
            block_tokens=m.layout.block_tokens, max_model_len=m.max_model_len,
            vocab_size=m.vocab_size, cache=self.memory is not None)

    def stats(self) -> dict[str, Any]:
        return {"replica": self.replica_id, "node": self.node, "served": self.served,
                "per_request_s": self._per_request_s}

    def record_routing_stats(self) -> dict[str, Any]:
        # No prefill figures: what a replica sees (time to first token, queueing and Ray's
        # calls included) is too noisy to price one replica's prefill against another's, and
        # the replicas run one model on like hosts. The router prices them with one prior, so
        # where the prefix is and how long the queues are decide.
        return {"node": self.node, "per_request_s": self._per_request_s, "links": {},
                "gating": self.options.engine.gate}

    def __del__(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is None:
            return
        engine.shutdown()
        # vLLM's processes unlink their shared memory as they exit; one killed before it could
        # (its parent gone first, then Ray's reaping of the actor's children) leaves it behind.
        try:
            wait_s = ENGINE_EXIT_S if self._record is not None else 0.0
            self._segments.reap(wait_s=wait_s, wait_for=self._record)
        except OSError as exc:
            log.warning("the engine's shared memory was not reaped: %s", exc)


def _engine_processes() -> list[int]:
    """The pids of this replica's descendants: vLLM's engine core and its workers."""
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True)]


def _client_error(exc: Exception) -> Exception:
    """vLLM's refusal of a request as ``BadRequest`` (a 400); anything else as it is."""
    from vllm.exceptions import VLLMClientError

    if isinstance(exc, (ValueError, VLLMClientError)):
        return BadRequest(str(exc))
    return exc


def _report(params: Any) -> dict[str, Any]:
    """The connector's report of one request (its ``kv_transfer_params``), plain data only."""
    if isinstance(params, list):
        params = params[0] if params else None
    if not isinstance(params, dict):
        return {}
    report = params.get("cmx", params)
    return {k: v for k, v in report.items() if isinstance(v, (int, float, str, bool, dict))}


def _default() -> Any:
    from cmx.config import ServiceConfig

    return ServiceConfig.from_env()


def _identity() -> tuple[str, str]:
    import ray

    node = ray.get_runtime_context().get_node_id()
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id, node
    except Exception:  # noqa: BLE001 - outside Serve (tests): a name of our own
        return f"local-{node[:8]}", node
