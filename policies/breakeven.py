"""Break-even gating: load a cached prefix only where loading it beats recomputing it.

A hit is worth loading when moving its bytes takes less time than the forward pass that would
recompute them. SGLang saw an L3 hit slower than recompute (#26305); here each decision is made
from two models measured on the replica that decides, and refitted as requests run:

- ``LinkCost``, one per *source class* (where a block's copy is, seen from the loading node:
  a tier's name on this node, ``hbm``, ``dram``, ``nvme``; ``dram@peer``, ``nvme@peer`` ... on
  another): ``seconds = latency + bytes / bandwidth``, fitted to the last loads' (bytes,
  seconds), from the priors of the tier's spec (``prior``).
- ``PrefillCost``: the seconds to compute positions ``[start, end)`` of a prompt,
  ``a * n + b * n * (start + end) / 2 + c * passes`` with ``n = end - start``: a per-token cost
  (the linear layers), a per-token-pair cost (attention over the context so far) and a cost per
  forward pass. Fitted to the last forward passes' (start, end, seconds).

``BreakEven.plan`` scans the cut points of a match (multiples of ``align`` tokens, since an
engine resumes only on chunk boundaries) and picks the one with the lowest estimated time to
first token; it loads nothing unless that beats recomputing by ``margin``. The plan carries a
``patience_s``: how long the engine should wait for the load before it starts computing anyway
(a bound the caller applies), so a model that is wrong costs a bounded amount and the measurement
that follows corrects it.

Time never comes from a clock here: callers pass measured seconds, so tests drive the models
with made-up measurements.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cmx.tiers import tier_spec, tier_specs

__all__ = ["DEFAULT_LINKS", "BreakEven", "LinkCost", "Plan", "PrefillCost", "prior",
           "source_class"]

GB = 1e9


def source_class(tier: str, node: str, here: str) -> str:
    """``"dram"`` for this node's DRAM, ``"dram@peer"`` for another node's, and so on."""
    return tier if node == here else f"{tier}@peer"


@dataclass
class LinkCost:
    """``seconds = latency_s + nbytes / bandwidth`` for one source class, refitted as loads run."""

    latency_s: float  # the prior, until measurements say otherwise
    bandwidth: float  # bytes per second; the prior
    window: int = 32  # measurements kept
    samples: deque[tuple[int, float]] = field(default_factory=deque)

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        self.samples.append((nbytes, seconds))
        while len(self.samples) > self.window:
            self.samples.popleft()
        self._fit()

    def _fit(self) -> None:
        xs = [float(b) for b, _ in self.samples]
        ys = [s for _, s in self.samples]
        if len(xs) >= 3 and max(xs) >= 1.5 * min(xs):
            fitted = _line(xs, ys)
            if fitted is not None and fitted[0] >= 0 and fitted[1] > 0:
                self.latency_s, self.bandwidth = fitted[0], 1.0 / fitted[1]
                return
        # Too few or too alike to separate latency from bandwidth: keep the latency, fit the
        # bandwidth to the time beyond it.
        per_byte = sorted(max(s - self.latency_s, 1e-6) / b for b, s in self.samples)
        self.bandwidth = 1.0 / per_byte[len(per_byte) // 2]

    def snapshot(self) -> tuple[float, float]:
        return (self.latency_s, self.bandwidth)


UNKNOWN_LINK = (0.02, 0.3 * GB)  # the prior of a source class of no registered tier


def prior(source: str) -> tuple[float, float]:
    """(latency s, bytes/s) to assume for ``source`` until loads are measured: its tier's, read
    here or from a peer (``cmx.tiers``: each spec carries its priors); a guess for a class of
    no registered tier."""
    tier, _, peer = source.partition("@")
    try:
        spec = tier_spec(tier)
    except ValueError:
        return UNKNOWN_LINK
    return spec.link_peer if peer else spec.link_here


# The priors of the tiers registered when this module is imported (the four built in); a
# tier registered later gets its own the first time it is a source (``BreakEven.link``).
DEFAULT_LINKS: Mapping[str, tuple[float, float]] = {
    **{s.name: s.link_here for s in tier_specs()},
    **{f"{s.name}@peer": s.link_peer for s in tier_specs()},
}


@dataclass
class PrefillCost:
    """Seconds to compute positions ``[start, end)``: ``a*n + b*n*(start+end)/2 + c*passes``.

    ``passes``: forward passes on the grid of ``chunk`` tokens; each has a fixed cost (Python,
    kernel launches, the cache's bookkeeping) that dominates small models and short chunks.
    """

    per_token_s: float = 1e-3  # a: the prior, ~1,000 tokens/s
    per_pair_s: float = 2e-8  # b: attention cost per (query, key) pair
    per_pass_s: float = 2e-3  # c: fixed cost of one forward pass
    chunk: int = 256  # tokens per forward pass (the engine's grid)
    window: int = 64
    samples: deque[tuple[int, int, float]] = field(default_factory=deque)

    def passes(self, start: int, end: int) -> int:
        if end <= start:
            return 0
        return (end - 1) // self.chunk - start // self.chunk + 1

    def seconds(self, start: int, end: int) -> float:
        n = max(0, end - start)
        return (self.per_token_s * n + self.per_pair_s * n * (start + end) / 2
                + self.per_pass_s * self.passes(start, end))

    def tokens_per_s(self, tokens: int = 1024) -> float:
        return tokens / self.seconds(0, tokens)

    def observe(self, start: int, end: int, seconds: float) -> None:
        if end <= start or seconds <= 0:
            return
        self.samples.append((start, end, seconds))
        while len(self.samples) > self.window:
            self.samples.popleft()
        self._fit()

    def _fit(self) -> None:
        rows = [((e - s), (e - s) * (s + e) / 2.0, self.passes(s, e), t)
                for s, e, t in self.samples]
        fitted = _nonneg_lstsq(rows) if len(rows) >= 4 else None
        if fitted is not None:
            self.per_token_s, self.per_pair_s, self.per_pass_s = fitted
            return
        # Too few shapes so far: keep the prior's proportions, scale all terms.
        predicted = sum(self.seconds(s, e) for s, e, _ in self.samples)
        scale = sum(t for _, _, t in self.samples) / predicted
        self.per_token_s *= scale
        self.per_pair_s *= scale
        self.per_pass_s *= scale

    def snapshot(self) -> tuple[float, float, float]:
        return (self.per_token_s, self.per_pair_s, self.per_pass_s)


@dataclass(frozen=True)
class Plan:
    """What to do with a match: load ``load_tokens`` (0: recompute everything)."""

    load_tokens: int
    est_load_s: float  # moving those tokens' blocks
    est_prefill_s: float  # computing the rest of the prompt
    est_recompute_s: float  # computing the whole prompt: the time a hit must beat
    patience_s: float  # wait this long for the load before computing anyway
    reason: str  # why, in words, for logs and responses

    @property
    def est_ttft_s(self) -> float:
        return self.est_load_s + self.est_prefill_s


class BreakEven:
    """The decision, and the measurements it is made from."""

    def __init__(
        self, prefill: PrefillCost | None = None,
        links: Mapping[str, tuple[float, float]] | None = None,
        margin: float = 0.05, slack: float = 2.0, enabled: bool = True,
    ) -> None:
        self.prefill = prefill or PrefillCost()
        self.links = {name: LinkCost(lat, bw) for name, (lat, bw) in
                      (links or DEFAULT_LINKS).items()}
        self.margin = margin  # a load must beat recompute by this fraction
        self.slack = slack  # patience = slack x the estimated load time
        self.enabled = enabled  # False: load every hit (tests and benchmarks of the load path)
        # Plans are made on the compute thread, measurements arrive from load threads.
        self.lock = threading.RLock()

    def link(self, source: str) -> LinkCost:
        if source not in self.links:
            lat, bw = prior(source)
            self.links[source] = LinkCost(lat, bw)
        return self.links[source]

    def load_seconds(self, blocks: Iterable[tuple[str, int]]) -> float:
        """Estimated seconds to load ``(source class, bytes)`` blocks: one move per class."""
        by_class: dict[str, int] = {}
        for source, nbytes in blocks:
            by_class[source] = by_class.get(source, 0) + nbytes
        return sum(self.link(c).seconds(n) for c, n in by_class.items())

    def plan(
        self, blocks: Sequence[tuple[str, int]], block_tokens: int, prompt_tokens: int,
        align: int | None = None,
    ) -> Plan:
        """The best prefix of ``blocks`` (each ``(source class, bytes)``, in prompt order) to load.

        Cut points are multiples of ``align`` tokens (default: one block) that leave at least
        one prompt token to compute.
        """
        align = align or block_tokens
        if align % block_tokens:
            raise ValueError(f"align {align} is not a multiple of block_tokens {block_tokens}")
        with self.lock:
            return self._plan(blocks, block_tokens, prompt_tokens, align)

    def _plan(
        self, blocks: Sequence[tuple[str, int]], block_tokens: int, prompt_tokens: int,
        align: int,
    ) -> Plan:
        recompute = self.prefill.seconds(0, prompt_tokens)
        best = Plan(0, 0.0, recompute, recompute, 0.0, "no cached prefix")
        by_class: dict[str, int] = {}
        for i, (source, nbytes) in enumerate(blocks):
            by_class[source] = by_class.get(source, 0) + nbytes
            tokens = (i + 1) * block_tokens
            if tokens >= prompt_tokens:
                break
            if tokens % align:
                continue
            load = sum(self.link(c).seconds(n) for c, n in by_class.items())
            rest = self.prefill.seconds(tokens, prompt_tokens)
            if load + rest < best.est_ttft_s or not self.enabled:
                best = Plan(tokens, load, rest, recompute, 0.0, "")
        if best.load_tokens == 0:
            reason = best.reason if not blocks else "recompute is faster than any load"
            return Plan(0, 0.0, recompute, recompute, 0.0, reason)
        if not self.enabled:
            return Plan(best.load_tokens, best.est_load_s, best.est_prefill_s, recompute,
                        float("inf"), f"load {best.load_tokens} tokens: gating off")
        if best.est_ttft_s > (1 - self.margin) * recompute:
            return Plan(0, 0.0, recompute, recompute, 0.0,
                        f"a load saves under {self.margin:.0%} of {recompute:.3f} s")
        # Waiting costs at most one chunk more than computing: a chunk started before the load
        # lands is thrown away when it does. A load that never lands costs the patience.
        patience = self.slack * best.est_load_s + self.prefill.seconds(0, self.prefill.chunk)
        return Plan(best.load_tokens, best.est_load_s, best.est_prefill_s, recompute, patience,
                    f"load {best.load_tokens} tokens: est {best.est_ttft_s:.3f} s "
                    f"< recompute {recompute:.3f} s")

    def observe_load(self, blocks: Iterable[tuple[str, int]], seconds: float) -> None:
        """One measured load; its time is shared among classes in proportion to their estimate."""
        by_class: dict[str, int] = {}
        for source, nbytes in blocks:
            by_class[source] = by_class.get(source, 0) + nbytes
        with self.lock:
            estimates = {c: self.link(c).seconds(n) for c, n in by_class.items()}
            total = sum(estimates.values())
            if total <= 0:
                return
            for c, n in by_class.items():
                self.link(c).observe(n, seconds * estimates[c] / total)

    def observe_prefill(self, start: int, end: int, seconds: float) -> None:
        with self.lock:
            self.prefill.observe(start, end, seconds)

    def snapshot(self) -> dict[str, object]:
        """The fitted figures, for routing stats and responses."""
        with self.lock:
            return self._snapshot()

    def _snapshot(self) -> dict[str, object]:
        a, b, c = self.prefill.snapshot()
        return {
            "prefill": {"per_token_s": a, "per_pair_s": b, "per_pass_s": c,
                        "tokens_per_s_at_4k": round(self.prefill.tokens_per_s(4096), 1)},
            "links": {c: {"latency_s": lc.latency_s, "bandwidth_gbps": lc.bandwidth / GB,
                          "samples": len(lc.samples)} for c, lc in self.links.items()},
        }


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least-squares ``y = c0 + c1 * x``; None if x does not vary."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    c1 = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - c1 * mx, c1


def _nonneg_lstsq(rows: Sequence[Sequence[float]]) -> tuple[float, ...] | None:
    """Least squares ``t = sum(c_i * x_i)`` with every ``c_i >= 0`` (rows: ``x..., t``).

    Tries every subset of terms (there are three) and keeps the best fit whose coefficients are
    all non-negative; None if no subset fits (all-zero columns).
    """
    import itertools

    import numpy as np

    data = np.asarray(rows, dtype=float)
    x, t = data[:, :-1], data[:, -1]
    k = x.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            sub = x[:, cols]
            scale = np.abs(sub).max(axis=0)
            if np.any(scale == 0):
                continue
            coef, *_ = np.linalg.lstsq(sub / scale, t, rcond=None)
            coef = coef / scale
            if np.any(coef < 0):
                continue
            err = float(np.sum((sub @ coef - t) ** 2))
            if best is None or err < best[0] * (1 - 1e-12):
                full = np.zeros(k)
                full[list(cols)] = coef
                best = (err, full)
    return None if best is None else tuple(float(c) for c in best[1])
