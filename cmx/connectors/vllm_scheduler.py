"""The scheduler side of ``CMXConnector``: which prefix to load, which blocks to store.

Per request, in vLLM's call order:

1. ``matched_tokens`` (vLLM's ``get_num_new_matched_tokens``): the first call starts a lookup
   of the prompt's longest cached prefix on a thread and waits ``lookup_wait_s`` for it; if it
   has not answered, vLLM is told "not known yet" (None) and asks again next step, so a slow
   directory delays one request, never the scheduler. The answer is gated by the break-even
   model: only a prefix faster to load than to compute is offered, and never the prompt's
   last token (vLLM must compute at least one). A request's first lookup also starts moving
   the blocks it found outside this node's memory into it (``look_up``), nobody waiting.
2. ``after_alloc``: vLLM took the offer; the load is remembered for the next step's metadata.
3. ``build_step``: each scheduled request's loads (into its newly allocated blocks) and stores
   (its prompt's blocks completed this step, each stored once) become ``CMXStepMetadata``.
4. ``finished``: the request's state goes; its report is returned to vLLM as
   ``kv_transfer_params["cmx"]``. Its ``stored_tokens`` are those in blocks the service had
   committed by then; ``store_pending_tokens`` those still being stored (stores never hold a
   request), ``store_failed_tokens`` those refused or lost.

A preempted request is resumed with new blocks and asked about again from step 1; what it
already stored stays stored. Lookup failures are misses.

With ``load_mode`` "async" vLLM is told a load is asynchronous: the request waits (vLLM's
WAITING_FOR_REMOTE_KVS, not scheduled) and ``after_alloc`` plans the load into the blocks vLLM
gave it, sent in the next step's ``async_loads``; ``loads_over`` hears when the workers report
it done. With ``save_mode`` "async" ``hold_blocks`` (vLLM's ``request_finished``) keeps the
blocks of a finished request that stored anything until the workers have copied them: the
request goes to them in ``held``, and they name it back when its blocks may be freed.

A request keeps itself out of the cache, or tells of a producer's store to wait for, with its
``kv_transfer_params["cmx"]`` (``vllm_requests``). A request told to expect ``expect_tokens``
(prefill and decode on different engines) whose lookup finds fewer is answered "not known
yet" and looked up again every ``LOOK_AGAIN_S``, up to ``store_wait_s``; its producer's
report names the tokens to expect (``finished``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as LookupPending
from typing import Any

from cmx.client.matches import block_places
from cmx.connectors.settings import ConnectorSettings, Namespaces, namespace_salt
from cmx.connectors.shards import ShardMatch
from cmx.connectors.vllm_events import StoreEvents
from cmx.connectors.vllm_meta import (
    CMXStepMetadata,
    CMXWorkerReport,
    LoadSpec,
    RankReports,
    SaveSpec,
)
from cmx.connectors.vllm_requests import (
    RequestOptions,
    RequestState,
    note_expected,
    note_pending,
)
from cmx.connectors.vllm_stats import CMXConnectorStats, Counters
from cmx.policies.breakeven import BreakEven, source_class

__all__ = ["SchedulerSide", "look_up"]

log = logging.getLogger(__name__)

LOOK_AGAIN_S = 0.02  # a request waiting for a producer's store looks again this often


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, namespaces: Namespaces, block_size: int,
                 load: bool = True, save: bool = True, chunk_tokens: int = 0,
                 ranks: tuple[int, int] = (1, 1)) -> None:
        self.settings = settings
        self.ranks = RankReports(*ranks)  # (loading, storing) ranks' ends, joined
        self.namespaces = namespaces
        self.block_size = block_size
        self.do_load = load
        self.do_save = save
        self.gate = BreakEven(margin=settings.margin, enabled=settings.gate)
        # The engine's forward passes: a prompt is computed in chunks of this many tokens.
        self.gate.prefill.chunk = chunk_tokens or self.gate.prefill.chunk
        self.requests: dict[str, RequestState] = {}
        self._lookups: dict[str, Future[Any]] = {}
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="cmx-lookup")
        self._lock = threading.Lock()
        # Requests finished this step, whose reports vLLM holds. vLLM frees a request that
        # finishes in a step (a one-token completion: its load's step) before it passes the
        # workers' report of that step on (``update_connector_output``), and sends the report
        # it got only after both: what the workers say then still reaches it, through this.
        self._finishing: dict[str, RequestState] = {}
        self._async_loads: list[LoadSpec] = []  # planned, for the next step's metadata
        self._held: list[str] = []  # finished requests whose blocks vLLM keeps for the workers
        self.counters = Counters()
        self.generation = 0  # resets so far: mixed into the salts of requests tracked since
        self.events = StoreEvents(block_size)

    # -- requests ------------------------------------------------------------------------------

    def track(self, req_id: str, prompt: Sequence[int] | None, cache_salt: str | None,
              params: Any = None, hashes: Sequence[Any] = ()) -> None:
        """Start knowing a request; ``params`` is its ``kv_transfer_params``, ``hashes`` its
        block hashes (for the KV events of what it stores)."""
        if req_id not in self.requests:
            salt = generation_salt(namespace_salt(self.settings.salt, cache_salt),
                                   self.generation)
            options = RequestOptions.of(params)
            if options.load or options.store:
                self.namespaces.get(salt)  # opened: ``reset`` drops what this engine used
            self.requests[req_id] = RequestState(salt, tuple(prompt or ()), options,
                                                 hashes=hashes, generation=self.generation)

    def matched_tokens(self, req_id: str, local_tokens: int) -> int | None:
        """Tokens beyond ``local_tokens`` to load; None while the lookup runs."""
        state = self.requests[req_id]
        if state.offer is not None and state.offer[0] == local_tokens:
            return state.offer[1]  # asked again (the request waited for blocks): same answer
        limit = (len(state.prompt) - 1) // self.block_size * self.block_size
        if not (self.do_load and state.options.load) or limit <= local_tokens:
            return 0  # one prompt token is always computed, so nothing is left to offer
        future = self._lookups.get(req_id)
        if future is None and time.monotonic() < state.look_again_at:
            return None  # waiting for a producer's store: not yet time to look again
        if future is None:
            ns = self.namespaces.get(state.salt)
            prefetch = self.settings.prefetch and not state.prefetched
            first = local_tokens // self.block_size if prefetch else None
            state.prefetched = True
            future = self._lookups[req_id] = self._pool.submit(
                look_up, ns, state.prompt[:limit], first)
        try:
            match = future.result(timeout=self.settings.lookup_wait_s)
        except LookupPending:
            return None
        except Exception as exc:  # noqa: BLE001 - an unreachable service is a miss
            log.warning("lookup failed, computing the prompt: %s", exc)
            self.counters.add(lookup_failures=1)
            match = None
        del self._lookups[req_id]
        if self._store_awaited(state, match, limit):
            return None
        tokens = self._offer(state, match, local_tokens)
        state.offer = (local_tokens, tokens)
        state.other_form = tokens > 0 and self._other_form(match)
        hit = 0 if match is None else max(0, match.num_tokens - local_tokens)
        self.counters.add(lookups=1, hit_tokens=hit, offered_tokens=tokens)
        return tokens

    def _store_awaited(self, state: RequestState, match: Any, limit: int) -> bool:
        """True while the request waits for a producer's store it was told of: the lookup
        found less than ``expect_tokens`` and ``store_wait_s`` has not passed since the
        first; it looks again after ``LOOK_AGAIN_S``. Past the wait it takes what is there."""
        want = min(state.options.expect_tokens, limit)
        if not want or (match is not None and match.num_tokens >= want):
            return False
        now = time.monotonic()
        if state.expect_until is None:
            state.expect_until = now + self.settings.store_wait_s
        if now >= state.expect_until:
            log.info("a producer's store of %d tokens was not committed within %.1f s; "
                     "%d found", want, self.settings.store_wait_s,
                     0 if match is None else match.num_tokens)
            return False
        state.look_again_at = now + LOOK_AGAIN_S
        return True

    def _other_form(self, match: Any) -> bool:
        """The match is of blocks stored in the form this engine does not store."""
        if not isinstance(match, ShardMatch):
            return False
        plan = self.namespaces.plan  # a ShardMatch comes only of namespaces with one
        return plan is not None and match.whole != plan.whole

    def _offer(self, state: RequestState, match: Any, local_tokens: int) -> int:
        if match is None or match.num_tokens <= local_tokens:
            state.report.update(lookup_tokens=0 if match is None else match.num_tokens,
                                plan="nothing cached beyond the engine's own cache")
            return 0
        here = self.namespaces.node_id
        nbytes = self.namespaces.layout.block_bytes
        first = local_tokens // self.block_size
        places = block_places(match.blocks[first:])
        classes = {place: source_class(place[0].value, place[1], here) for place in set(places)}
        blocks = [(classes[place], nbytes) for place in places]
        # The engine's own blocks cost nothing to "load": plan over the rest of the prompt.
        plan = self.gate.plan(blocks, self.block_size, len(state.prompt) - local_tokens)
        state.report.update(lookup_tokens=match.num_tokens, plan=plan.reason)
        return plan.load_tokens

    def after_alloc(self, req_id: str, external_tokens: int,
                    block_ids: Sequence[int] = ()) -> None:
        """vLLM took ``external_tokens`` of the offer: load them in the request's next step
        (async loads: into its ``block_ids``, all it holds, while it waits)."""
        state = self.requests.get(req_id)
        if state is None or external_tokens <= 0 or state.offer is None:
            return
        local = state.offer[0]
        state.offer = None  # a preempted request is asked about afresh
        if not self.settings.async_loads:
            state.load = (local, local + external_tokens)
            return
        T, end = self.block_size, local + external_tokens
        state.loading = True
        self._async_loads.append(LoadSpec(req_id, state.salt, state.prompt[:end], local, end,
                                          tuple(block_ids[local // T:end // T])))

    def loads_over(self, req_ids: Iterable[str]) -> None:
        """The workers' receiving set: these requests' asynchronous loads are over."""
        for req_id in req_ids:
            state = self.requests.get(req_id)
            if state is not None:
                state.loading = False

    def hold_blocks(self, req_id: str) -> bool:
        """vLLM's ``request_finished``: True if the request's blocks must wait for the workers'
        copies. Never for a request whose load is under way: vLLM keeps those blocks until
        the load is reported over, and a request is released once, by one of the two."""
        state = self.requests.get(req_id)
        if not self.settings.async_saves or state is None or not state.saved or state.loading:
            return False
        self._held.append(req_id)
        return True

    def finished(self, req_id: str) -> dict[str, Any] | None:
        state = self.requests.pop(req_id, None)
        future = self._lookups.pop(req_id, None)
        if future is not None:
            future.cancel()
        if state is None or not (state.report or (self.do_save and state.options.store)):
            return None
        if self.do_save and state.options.store:
            note_expected(state)
        # The dict vLLM now holds: what the workers report this step is still added to it.
        self._finishing[req_id] = state
        return state.report

    # -- steps ---------------------------------------------------------------------------------

    def build_step(self, new: Sequence[Any], cached: Any, num_scheduled: dict[str, int],
                   finished: Iterable[str], preempted: Iterable[str] = ()) -> CMXStepMetadata:
        meta = CMXStepMetadata(async_loads=self._async_loads, held=self._held,
                               preempted=sorted(preempted))
        self._async_loads, self._held = [], []
        self._finishing.clear()  # vLLM has sent last step's reports
        for req_id in finished:
            self.finished(req_id)
        for req in new:
            state = self.requests.get(req.req_id)
            if state is None:  # not seen by matched_tokens (no prompt ids): nothing to do
                continue
            state.block_ids = list(req.block_ids[0])
            self._schedule(meta, req.req_id, state, req.num_computed_tokens,
                           num_scheduled.get(req.req_id, 0))
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                continue
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(ids[0]) if ids is not None else []
            elif ids is not None:
                state.block_ids.extend(ids[0])
            self._schedule(meta, req_id, state, cached.num_computed_tokens[i],
                           num_scheduled.get(req_id, 0))
        return meta

    def _schedule(self, meta: CMXStepMetadata, req_id: str, state: RequestState,
                  computed: int, scheduled: int) -> None:
        T = self.block_size
        state.offer = None  # asked about again only after a preemption: afresh then
        if state.load is not None:
            start, end = state.load
            state.load = None
            meta.loads.append(LoadSpec(req_id, state.salt, state.prompt[:end], start, end,
                                       tuple(state.block_ids[start // T:end // T])))
        if scheduled > 0:
            meta.computed.append((computed, computed + scheduled))
        if state.stored_upto < 0:
            # Blocks the engine did not compute itself (its own cache, or loaded) are stored,
            # in the form it stores, unless they came from the other (``shards``): each
            # form's keys chain from the prompt's first block, so its blocks are stored again.
            state.stored_upto = 0 if state.other_form else computed // T * T
            state.stored_from = state.stored_upto
        upto = min(computed + scheduled, len(state.prompt)) // T * T
        if self.do_save and state.options.store and upto > state.stored_upto:
            start = state.stored_upto
            meta.saves.append(SaveSpec(req_id, state.salt, state.prompt[:upto], start, upto,
                                       tuple(state.block_ids[start // T:upto // T])))
            if state.generation == self.generation:  # else stored where no new request looks
                self.events.planned(req_id, state.hashes, state.prompt, start, upto)
            state.stored_upto = upto
            state.saved = True

    def take_report(self, report: CMXWorkerReport) -> None:
        """What the workers did last step: per-request figures, and measurements for the gate."""
        for load in self.ranks.loads(report.loads):
            figures = self._report_of(load.req_id)
            if figures is not None:
                figures["loaded_tokens"] = figures.get("loaded_tokens", 0) + load.loaded_tokens
                if load.loaded_tokens < load.asked_tokens:
                    figures["load_failed_tokens"] = load.asked_tokens - load.loaded_tokens
            if load.loaded_tokens and load.seconds > 0:
                self.gate.observe_load(load.sources, load.seconds)
        for req_id, tokens in report.handed.items():
            state = self._state_of(req_id)
            if state is not None:
                state.store_handed += tokens
                note_pending(state)
        for store in self.ranks.stores(report.stores):
            self.events.ended(store.req_id, store.start, store.tokens, store.committed_tokens)
            state = self._state_of(store.req_id)
            if state is None:
                continue  # ended after its request's report was sent: counted in the stats
            state.store_ended += store.tokens
            _add(state.report, "stored_tokens", store.committed_tokens)
            _add(state.report, "store_failed_tokens", store.failed_tokens)
            note_pending(state)
            if store.failed_tokens:
                state.report.pop("expect_tokens", None)
        for req_id, tokens in report.dropped.items():
            figures = self._report_of(req_id)
            if figures is not None:
                _add(figures, "store_dropped_tokens", tokens)
                figures.pop("expect_tokens", None)
        if len(report.computed) == 1 and report.step_s > 0 and not report.loads:
            start, end = report.computed[0]
            if end - start > 1:  # a prefill chunk, alone in its step: a clean measurement
                self.gate.observe_prefill(start, end, report.step_s)

    def _state_of(self, req_id: str) -> RequestState | None:
        """A running request, or one that finished this step."""
        return self.requests.get(req_id) or self._finishing.get(req_id)

    def _report_of(self, req_id: str) -> dict[str, Any] | None:
        """The report of a running request, or of one that finished this step."""
        state = self._state_of(req_id)
        return None if state is None else state.report

    def take_stats(self) -> CMXConnectorStats | None:
        return self.counters.take()

    def reset(self) -> bool:
        """vLLM's ``reset_cache`` (as after a weight update in place): requests tracked from
        now on use namespaces of a new generation, which nothing stored before holds (a store
        still under way commits into the old one, out of their reach); then every block of
        each namespace this engine used is evicted, best effort, other engines sharing them
        losing them too. False if a drop failed."""
        ok = True
        self.generation += 1
        self.events.cleared()
        for ns in self.namespaces.forget():
            try:
                evicted = self.namespaces.cm.drop_namespace(ns.namespace)
                log.info("dropped namespace %s: %d copies evicted", ns.namespace.id, evicted)
            except Exception as exc:  # noqa: BLE001 - vLLM is told, the engine goes on
                log.warning("could not drop namespace %s: %s", ns.namespace.id, exc)
                ok = False
        return ok

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def look_up(ns: Any, tokens: Sequence[int], prefetch_from: int | None) -> Any:
    """``ns.lookup(tokens)``, on a lookup thread. With ``prefetch_from``, the blocks found from
    there on (beyond the engine's own cache) that this node's memory lacks start moving into
    it at once (``NamespaceClient.prefetch_away``: bounded, nobody waits): by the time the
    load runs they are local hits. A prefetch that fails costs a slower load, nothing more."""
    match = ns.lookup(tokens, here_first=True)
    if prefetch_from is not None and match.num_blocks > prefetch_from:
        try:
            if isinstance(match, ShardMatch):
                ns.prefetch(match, prefetch_from)
            else:
                ns.prefetch_away(match.blocks[prefetch_from:])
        except Exception as exc:  # noqa: BLE001 - the load finds the blocks where they are
            log.debug("prefetch not sent: %s", exc)
    return match


def generation_salt(salt: str, generation: int) -> str:
    """The salt of a request tracked after ``generation`` resets: the salt itself before any,
    so engines that never reset share namespaces as before."""
    return salt if not generation else json.dumps([salt, f"reset-{generation}"])


def _add(figures: dict[str, Any], name: str, tokens: int) -> None:
    if tokens:
        figures[name] = figures.get(name, 0) + tokens
