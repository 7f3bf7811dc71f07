"""One replica's engine: a request in, tokens out, the context memory used where it pays.

For a request, in order:

1. On arrival (``start_prefetch``, while the request still waits for the replica): look up the
   prompt's cached prefix, plan (break-even), and ask the agent to move the planned prefix to
   this node.
2. When the replica is free (``run``): the prefetch policy decides how long to wait for that
   move; then look up again, plan again, and start the load in the background.
3. Prefill on the chunk grid, adopting the load when it lands (``prefill``); the first token.
4. Hand the KV of the prompt's new whole chunks to the agent, without waiting; decode.

The break-even models learn from every pass and every load, so the next plan is made from what
this replica measured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cmx.deploy.kvcache import kv_slice, snapshot
from cmx.deploy.memory import Found, KVMemory
from cmx.deploy.messages import GenerateRequest, GenerateResult, Timings
from cmx.deploy.model import LoadedModel
from cmx.deploy.prefill import prefill
from cmx.deploy.sampling import Sampler
from cmx.policies.breakeven import BreakEven, Plan
from cmx.policies.prefetch import PrefetchOutcome, PrefetchPolicy, Waited, make_prefetch

__all__ = ["Engine"]

log = logging.getLogger(__name__)

NO_PLAN = Plan(0, 0.0, 0.0, 0.0, 0.0, "cache off")


class Engine:
    def __init__(
        self, loaded: LoadedModel, memory: KVMemory | None, chunk_tokens: int,
        gate: BreakEven | None = None, prefetch: PrefetchPolicy | str = "wait_complete",
        replica: str = "", clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.loaded = loaded
        self.memory = memory
        self.chunk = chunk_tokens
        self.gate = gate or BreakEven()
        self.gate.prefill.chunk = chunk_tokens  # its pass count follows this engine's grid
        self.policy = make_prefetch(prefetch)
        self.replica = replica
        self.clock = clock
        self.node = memory.node if memory is not None else ""
        # Loads wait on prefetches and Ray; stores build payloads: neither on the compute thread.
        self._loads = ThreadPoolExecutor(2, thread_name_prefix="cmx-load")
        self._stores = ThreadPoolExecutor(1, thread_name_prefix="cmx-store")
        self.pending_stores: list[Future[Any]] = []

    # -- on arrival ----------------------------------------------------------------------------

    def start_prefetch(self, req: GenerateRequest) -> Any:
        """Start moving the request's planned prefix here; the ``PendingPrefetch`` or None."""
        if not req.use_cache or self.memory is None:
            return None
        try:
            found = self.memory.lookup(req.prompt_ids)
            plan = self._plan(found, len(req.prompt_ids))
            if plan.load_tokens == 0:
                return None
            pending = self.memory.prefetch(req.prompt_ids[: plan.load_tokens])
            if pending is None:
                return None
            # A prefetch is a load started early: its time measures the links it used.
            blocks = found.blocks(plan.load_tokens)
            pending.patience_s = plan.patience_s
            pending.sources = found.served_from(0, plan.load_tokens)
            pending.on_done(lambda seconds: self.gate.observe_load(blocks, seconds))
            return pending
        except Exception as exc:  # noqa: BLE001 - a prefetch that cannot start is no prefetch
            log.warning("prefetch failed: %s", exc)
            return None

    # -- when the replica is free --------------------------------------------------------------

    def run(self, req: GenerateRequest, prefetch: Any = None,
            arrived: float | None = None) -> GenerateResult:
        if not req.prompt_ids:
            raise ValueError("the prompt is empty")
        start = self.clock()
        arrived = start if arrived is None else arrived
        use_cache = req.use_cache and self.memory is not None
        waited = Waited(PrefetchOutcome.NONE, 0.0)
        if use_cache:
            cap = getattr(prefetch, "patience_s", float("inf"))
            waited = self.policy.wait(prefetch, self.clock, cap)
        t_plan = self.clock()
        found, plan, load = self._start_load(req, prefetch) if use_cache else (None, NO_PLAN, None)
        lookup_s = self.clock() - t_plan
        outcome = prefill(self.loaded.model, self.loaded.config, req.prompt_ids, self.chunk,
                          load, plan.patience_s)
        for s, e, seconds in outcome.computed:
            self.gate.observe_prefill(s, e, seconds)
        sampler = Sampler(req.sampling, self.loaded.output_ids)
        first = sampler(outcome.logits)
        t_first = self.clock()
        stored = self._store(req, found, outcome.cache) if use_cache else 0
        tokens, reason = self._decode(req, outcome.cache, sampler, first)
        t_end = self.clock()
        timings = Timings(
            queue_s=start - arrived, prefetch_wait_s=waited.waited_s,
            load_s=lookup_s + outcome.waited_s,
            prefill_s=sum(seconds for _, _, seconds in outcome.computed),
            ttft_s=t_first - arrived, decode_s=t_end - t_first, total_s=t_end - arrived,
        )
        return GenerateResult(
            request_id=req.request_id, token_ids=tuple(tokens),
            text=self._text(tokens, req.stop), finish_reason=reason,
            prompt_tokens=len(req.prompt_ids), cached_tokens=outcome.loaded_tokens,
            matched_tokens=found.tokens if found else 0,
            served_from=found.served_from(*outcome.loaded_range) if found else {},
            prefetched_from=dict(getattr(prefetch, "sources", {})) if use_cache else {},
            timings=timings, plan=plan.reason, prefetch=waited.outcome.value,
            stored_tokens=stored, replica=self.replica, node=self.node,
        )

    def _plan(self, found: Found, prompt_tokens: int) -> Plan:
        return self.gate.plan(found.blocks(), found.block_tokens, prompt_tokens, align=self.chunk)

    def _start_load(
        self, req: GenerateRequest, prefetch: Any
    ) -> tuple[Found | None, Plan, Future[Any] | None]:
        assert self.memory is not None
        try:
            found = self.memory.lookup(req.prompt_ids)
        except Exception as exc:  # noqa: BLE001 - an unreachable memory is a miss
            log.warning("lookup failed: %s", exc)
            return None, Plan(0, 0.0, 0.0, 0.0, 0.0, f"lookup failed: {exc}"), None
        plan = self._plan(found, len(req.prompt_ids))
        if plan.load_tokens == 0:
            return found, plan, None
        in_flight = prefetch is not None and not prefetch.done()
        return found, plan, self._loads.submit(
            self._load, req.prompt_ids, found, plan.load_tokens, prefetch if in_flight else None)

    def _load(self, prompt: tuple[int, ...], found: Found, n_tokens: int, prefetch: Any) -> Any:
        """The KV of the planned prefix; after the prefetch still moving it, if there is one."""
        assert self.memory is not None
        if prefetch is not None:
            prefetch.wait(60.0)
        t0 = time.perf_counter()
        try:
            kv = self.memory.load(prompt, found, n_tokens)
        except Exception as exc:  # noqa: BLE001 - a failed load is a miss
            log.warning("load failed: %s", exc)
            return None
        seconds = time.perf_counter() - t0
        got = int(kv.shape[3]) if kv is not None else 0
        if prefetch is None and got:
            self.gate.observe_load(found.blocks(got), seconds)
        return kv

    def _store(self, req: GenerateRequest, found: Found | None, cache: Any) -> int:
        """Store the prompt's whole chunks the memory lacks; returns tokens handed over."""
        assert self.memory is not None
        end = len(req.prompt_ids) // self.chunk * self.chunk
        start = min(found.tokens if found else 0, end)
        if end <= start:
            return 0
        layers = snapshot(cache)
        memory = self.memory

        def store() -> None:
            memory.store(req.prompt_ids[:end], kv_slice(layers, start, end), start)

        fut = self._stores.submit(store)
        fut.add_done_callback(_log_failure)
        self.pending_stores = [f for f in self.pending_stores if not f.done()] + [fut]
        return end - start

    def _decode(self, req: GenerateRequest, cache: Any, sampler: Sampler,
                first: int) -> tuple[list[int], str]:
        import torch

        eos = None if req.ignore_eos else self.loaded.tokenizer.eos_token_id
        tokens = [first]
        while True:
            if tokens[-1] == eos:
                return tokens[:-1], "stop"
            if req.stop and self._stopped(tokens, req.stop):
                return tokens, "stop"
            if len(tokens) >= req.max_tokens:
                return tokens, "length"
            with torch.inference_mode():
                out = self.loaded.model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache,
                                        use_cache=True, logits_to_keep=1)
            tokens.append(sampler(out.logits[0, -1]))

    def _stopped(self, tokens: list[int], stop: tuple[str, ...]) -> bool:
        text = self.loaded.tokenizer.decode(tokens)
        return any(s in text for s in stop)

    def _text(self, tokens: list[int], stop: tuple[str, ...]) -> str:
        text = self.loaded.tokenizer.decode(tokens)
        cut = min((text.find(s) for s in stop if s in text), default=-1)
        return text if cut < 0 else text[:cut]

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait for the stores handed out so far (tests and benchmarks)."""
        for fut in list(self.pending_stores):
            fut.result(timeout=timeout_s)

    def close(self) -> None:
        self._loads.shutdown(wait=False, cancel_futures=True)
        self._stores.shutdown(wait=True)


def _log_failure(fut: Future[Any]) -> None:
    exc = fut.exception()
    if exc is not None:
        log.warning("store failed: %s", exc)
