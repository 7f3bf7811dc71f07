"""Chunked prefill on a fixed grid, adopting a cached prefix whenever its load lands.

Exactness. A restored prefix must give the same logits, to the bit, as recomputing it. The KV
of a token depends on floating-point sums whose order the matrix kernels choose by the shapes
they are given, and those shapes change with how many tokens one forward pass computes: on a
2-core CPU a 1-token or 33-token pass over a cached prefix differs in the last bits from the
same rows inside a 1,000-token pass. So every prefill here runs on one absolute grid of
``chunk`` tokens: positions ``[k*chunk, (k+1)*chunk)`` are computed by one pass whose shape
depends on nothing but the prompt's length. A cached prefix is resumed only at a grid line and
only KV from whole chunks is stored, so every stored block holds the bits a from-scratch
prefill computes, and a prompt with its prefix loaded computes exactly the passes that a
prompt without it computes last. (Measured: equal logits and equal KV for every tested length.)

The race. The load of the prefix runs in the background. The engine waits for it up to the
plan's patience; after that it computes chunks itself, and takes the load's KV at the next
grid line if the load has landed by then with tokens beyond where it got. Because the bits are
the same, the switch needs no care: the loaded KV simply continues the cache.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from cmx.deploy.kvcache import append_kv, cache_tokens, new_cache

__all__ = ["PrefillOutcome", "chunk_ends", "prefill"]


@dataclass
class PrefillOutcome:
    cache: Any  # DynamicCache holding the whole prompt
    logits: Any  # the last position's logits (1-D)
    loaded_range: tuple[int, int]  # [start, end) of the tokens whose KV came from the load
    computed: list[tuple[int, int, float]]  # (start, end, seconds) of each forward pass
    waited_s: float  # time spent waiting for the load, not computing

    @property
    def loaded_tokens(self) -> int:
        return self.loaded_range[1] - self.loaded_range[0]


def chunk_ends(start: int, end: int, chunk: int) -> list[int]:
    """Grid lines after ``start`` up to ``end``: where each forward pass stops."""
    out = []
    pos = start
    while pos < end:
        pos = min(end, (pos // chunk + 1) * chunk)
        out.append(pos)
    return out


def prefill(
    model: Any, config: Any, prompt: Sequence[int], chunk: int,
    load: Future[Any] | None = None, patience_s: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
) -> PrefillOutcome:
    """Prefill ``prompt``; ``load`` (if any) yields KV of a grid-aligned prefix to adopt."""
    import torch

    ids = torch.tensor([list(prompt)], dtype=torch.long)
    cache = new_cache(config)
    computed: list[tuple[int, int, float]] = []
    waited = 0.0
    loaded = (0, 0)
    if load is not None:
        t0 = clock()
        try:
            kv = load.result(timeout=None if math.isinf(patience_s) else patience_s)
            load = None
            loaded = (0, _adopt(cache, kv, chunk, len(prompt)))
        except FutureTimeout:
            pass
        waited = clock() - t0
    logits = None
    pos = cache_tokens(cache)
    while pos < len(prompt):
        end = min(len(prompt), (pos // chunk + 1) * chunk)
        t0 = clock()
        with torch.inference_mode():
            out = model(input_ids=ids[:, pos:end], cache=cache, use_cache=True, logits_to_keep=1)
        computed.append((pos, end, clock() - t0))
        logits = out.logits[0, -1]
        pos = end
        if load is not None and load.done() and pos < len(prompt):
            kv = load.result()
            load = None
            if _aligned(kv, chunk, len(prompt)) > pos:
                loaded = (pos, _adopt(cache, kv, chunk, len(prompt), start=pos))
                pos = loaded[1]
    return PrefillOutcome(cache, logits, loaded, computed, waited)


def _aligned(kv: Any, chunk: int, prompt_len: int) -> int:
    """Tokens of ``kv`` usable: whole chunks, leaving at least one prompt token to compute."""
    if kv is None:
        return 0
    return min(int(kv.shape[3]), prompt_len - 1) // chunk * chunk


def _adopt(cache: Any, kv: Any, chunk: int, prompt_len: int, start: int = 0) -> int:
    """Append ``kv``'s tokens ``[start, aligned)`` to ``cache``; returns the aligned end."""
    end = _aligned(kv, chunk, prompt_len)
    if end > start:
        append_kv(cache, kv[:, :, :, start:end])
    return max(end, start)
