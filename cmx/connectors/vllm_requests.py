"""What the scheduler side of ``CMXConnector`` knows of each request, and what a request asks
of it in its ``kv_transfer_params["cmx"]``.

A request keeps itself out of the cache with ``{"cmx": {"skip": true}}`` (neither loads nor
stores), ``{"cmx": {"load": false}}`` or ``{"cmx": {"store": false}}`` (one of the two).

Prefill and decode on different engines: the producer (``kv_role`` "kv_producer") answers
each request with its report in ``kv_transfer_params["cmx"]``, which says ``expect_tokens``:
the prompt's tokens it stored, or handed to a store that had not failed when the request
ended. A proxy passes those ``kv_transfer_params`` on with the request to a consumer (as
vLLM's disaggregated proxies do), whose lookup then waits, up to ``store_wait_s``, for that
many tokens to be committed instead of missing the store still under way. The rest of the
producer's report rides along and is ignored. Anything else in the entry is a warning, and
the request is kept out of the cache (what was meant to stay out never goes in).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["REPORT_KEYS", "RequestOptions", "RequestState", "note_expected", "note_pending"]

log = logging.getLogger(__name__)

# What a request's report (``kv_transfer_params["cmx"]`` of its answer) may hold.
REPORT_KEYS = frozenset({
    "lookup_tokens", "plan", "loaded_tokens", "load_failed_tokens", "stored_tokens",
    "store_failed_tokens", "store_pending_tokens", "store_dropped_tokens", "expect_tokens",
})
_SWITCHES = ("skip", "load", "store")


@dataclass(frozen=True)
class RequestOptions:
    """What one request lets the connector do, from its ``kv_transfer_params``."""

    load: bool = True
    store: bool = True
    expect_tokens: int = 0  # a producer stored this many of the prompt's tokens: wait for them

    @classmethod
    def of(cls, params: Any) -> RequestOptions:
        entry = params.get("cmx") if isinstance(params, dict) else None
        if entry is None:
            return cls()
        if _valid(entry):
            skip = entry.get("skip", False)
            return cls(load=not skip and entry.get("load", True),
                       store=not skip and entry.get("store", True),
                       expect_tokens=entry.get("expect_tokens", 0))
        log.warning("kv_transfer_params['cmx'] must be a dict of booleans 'skip', 'load', "
                    "'store' (and a producer's report), not %.200r: the request is kept out "
                    "of the cache", entry)
        return cls(load=False, store=False)


def _valid(entry: Any) -> bool:
    if not isinstance(entry, dict) or not set(entry) <= REPORT_KEYS.union(_SWITCHES):
        return False
    if not all(isinstance(entry[k], bool) for k in _SWITCHES if k in entry):
        return False
    expect = entry.get("expect_tokens", 0)
    return isinstance(expect, int) and not isinstance(expect, bool) and expect >= 0


@dataclass
class RequestState:
    """What the scheduler side knows of one unfinished request."""

    salt: str
    prompt: tuple[int, ...]
    options: RequestOptions = field(default_factory=RequestOptions)
    block_ids: list[int] = field(default_factory=list)
    stored_upto: int = -1  # tokens handed to the store; -1: not scheduled yet
    offer: tuple[int, int] | None = None  # (local tokens asked about, tokens offered beyond)
    load: tuple[int, int] | None = None  # [start, end) to load in the next step
    prefetched: bool = False  # its first lookup may start a prefetch; no later one does
    report: dict[str, Any] = field(default_factory=dict)
    store_handed: int = 0  # tokens the workers handed to their store threads
    store_ended: int = 0  # of those, in stores that ended (committed, failed or not needed)
    loading: bool = False  # an asynchronous load into its blocks is under way
    saved: bool = False  # a save of its blocks went to the workers
    hashes: Sequence[Any] = ()  # vLLM's block hashes of the request (its own list, growing)
    generation: int = 0  # resets before it was tracked: its salt's
    stored_from: int = 0  # the first token its stores took (those before: held already)
    other_form: bool = False  # its prefix came from blocks stored in the form this engine
    #                           does not store (``shards``): its stores start at block 0
    expect_until: float | None = None  # waiting for a producer's store: until then
    look_again_at: float = 0.0  # the next lookup of a request waiting for a store


def note_expected(state: RequestState) -> None:
    """``expect_tokens``: the prompt's tokens a consumer may wait for; absent when none, and
    once any of the request's stores failed or was dropped."""
    report = state.report
    lost = report.get("store_failed_tokens", 0) or report.get("store_dropped_tokens", 0)
    # The tokens before its first store were the engine's own or loaded: in the service only
    # as far as its lookup found them (the engine's own cache may hold what the service lost).
    unknown = state.stored_from > report.get("lookup_tokens", 0)
    if lost or unknown or state.stored_upto <= 0:
        report.pop("expect_tokens", None)
    else:
        report["expect_tokens"] = state.stored_upto


def note_pending(state: RequestState) -> None:
    """``store_pending_tokens``: handed to a store that has not ended; absent when none."""
    pending = state.store_handed - state.store_ended
    if pending > 0:
        state.report["store_pending_tokens"] = pending
    else:
        state.report.pop("store_pending_tokens", None)
