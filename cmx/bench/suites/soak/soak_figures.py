"""The soak's figures, from what it recorded: each request's outcome, the greedy outputs against
their cache-off reference, memory at the start and the end, and p99 TTFT per window of time.

Pure: no Ray, no HTTP. ``cmx.bench.suites.soak.soak`` records; this module counts and judges.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cmx.bench.harness.core import Figure, Goal, MiB, Table

__all__ = [
    "FLAT",
    "KillRecord",
    "Outcome",
    "RequestRecord",
    "Snapshot",
    "Window",
    "greedy_mismatches",
    "percentile",
    "soak_figures",
    "soak_tables",
    "windows",
]

SUITE = "soak"
FLAT = 1.2  # end over start of resident memory and of /dev/shm that still counts as flat


class Outcome(str, enum.Enum):
    COMPLETED = "completed"  # the whole answer, within the bound
    FAILED = "failed"  # an HTTP error status, or an error the client was told
    CUT = "cut"  # the stream ended without a finish reason
    HUNG = "hung"  # no whole answer within the bound


@dataclass(frozen=True)
class RequestRecord:
    """One request of the soak, as its client saw it."""

    sent_s: float  # when it was sent, seconds after the traffic started
    tenant: str
    greedy: bool  # temperature 0: its text is compared with the cache-off reference
    prompt: int  # which prompt (for a greedy one, its index into the reference)
    outcome: Outcome
    ttft_s: float | None  # time to the first streamed token; None without one
    total_s: float  # time to the last byte, or to the error
    text: str = ""  # the completion
    error: str = ""  # what the client was told, for one that did not complete


@dataclass(frozen=True)
class Snapshot:
    """Memory of the application's processes at one moment."""

    at_s: float  # seconds after the traffic started (negative: before it)
    rss_bytes: int  # resident memory summed over the Ray cluster's processes
    processes: int
    shm_bytes: int  # /dev/shm used by the application (its arenas, its engines' segments)
    shm_machine_bytes: int  # /dev/shm used on the whole machine, other work included


@dataclass(frozen=True)
class KillRecord:
    at_s: float  # seconds after the traffic started
    kind: str  # "tier", "agent", "directory shard", "replica"
    name: str  # the actor killed
    killed: bool  # False: it was between lives, or not found


@dataclass(frozen=True)
class Window:
    start_s: float
    end_s: float
    counts: Mapping[Outcome, int]
    ttft_p99_s: float | None  # over the requests sent in it that got a first token


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100): the least value at or above ``q``%
    of the values. ValueError on no values."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 < q <= 100:
        raise ValueError(f"q must be in (0, 100], got {q}")
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def windows(records: Sequence[RequestRecord], window_s: float, duration_s: float) -> list[Window]:
    """Requests by the window they were sent in; the last window may be shorter."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    count = max(1, math.ceil(duration_s / window_s - 1e-9))
    out = []
    for i in range(count):
        lo, hi = i * window_s, min((i + 1) * window_s, duration_s)
        last = i == count - 1
        mine = [r for r in records if lo <= r.sent_s < hi or (last and r.sent_s >= hi)]
        ttfts = [r.ttft_s for r in mine if r.ttft_s is not None]
        out.append(Window(lo, hi, {o: sum(r.outcome is o for r in mine) for o in Outcome},
                          percentile(ttfts, 99) if ttfts else None))
    return out


def greedy_mismatches(records: Sequence[RequestRecord],
                      reference: Sequence[str]) -> list[RequestRecord]:
    """Completed greedy requests whose text differs from the cache-off text of their prompt."""
    return [r for r in records if r.greedy and r.outcome is Outcome.COMPLETED
            and r.text != reference[r.prompt]]


def soak_figures(records: Sequence[RequestRecord], reference: Sequence[str], start: Snapshot,
                 end: Snapshot) -> list[Figure]:
    """The judged figures: none hung, every greedy output the reference's (counts of every
    request, judged as counted), memory flat (one reading at each end: a single repetition,
    so never a PASS, ``Figure.inconclusive``)."""
    sent = len(records)
    n = {o: sum(r.outcome is o for r in records) for o in Outcome}
    greedy = [r for r in records if r.greedy and r.outcome is Outcome.COMPLETED]
    same = len(greedy) - len(greedy_mismatches(records, reference))

    def share(name: str, value: int, of: int, base: str, goal: Goal | None, note: str) -> Figure:
        return Figure.count(SUITE, name, "requests", value, of, base, goal, note)

    return [
        share("requests completed", n[Outcome.COMPLETED], sent, "requests sent", None, ""),
        share("requests failed cleanly (an error status or a clean error)",
              n[Outcome.FAILED], sent, "requests sent", None, ""),
        share("streams cut (ended without a finish reason)", n[Outcome.CUT], sent,
              "requests sent", None, ""),
        share("requests hung (no whole answer within the bound)", n[Outcome.HUNG], sent,
              "requests sent", Goal("<=", 0.0), "goal: none hung"),
        share("greedy outputs identical to the cache-off reference", same, len(greedy),
              "greedy requests completed", Goal(">=", 1.0), "goal: all identical"),
        Figure(SUITE, "resident memory of the cluster's processes at the end", "MiB",
               (end.rss_bytes / MiB,), "the same at the start", (start.rss_bytes / MiB,),
               Goal("<=", FLAT), f"flat: within {FLAT:g}x of the start"),
        Figure(SUITE, "/dev/shm of the application at the end", "MiB",
               (end.shm_bytes / MiB,), "the same at the start", (start.shm_bytes / MiB,),
               Goal("<=", FLAT), f"flat: within {FLAT:g}x of the start"),
    ]


def soak_tables(records: Sequence[RequestRecord], window_s: float, duration_s: float,
                kills: Sequence[KillRecord], samples: Sequence[Snapshot]) -> list[Table]:
    """Requests and p99 TTFT per window, memory over time, and every kill."""
    def mib(x: int) -> str:
        return f"{x / MiB:,.0f}"

    rows = []
    for w in windows(records, window_s, duration_s):
        rows.append((f"{w.start_s / 60:.1f}-{w.end_s / 60:.1f}",
                     *(str(w.counts[o]) for o in Outcome),
                     "—" if w.ttft_p99_s is None else f"{w.ttft_p99_s:.2f}"))
    return [
        Table("Requests and TTFT per window (by the time each was sent)",
              ("minutes", *(o.value for o in Outcome), "TTFT p99 (s)"), tuple(rows)),
        Table("Memory over time", ("minute", "processes", "resident MiB",
                                   "application /dev/shm MiB", "machine /dev/shm MiB"),
              tuple((f"{s.at_s / 60:.1f}", str(s.processes), mib(s.rss_bytes),
                     mib(s.shm_bytes), mib(s.shm_machine_bytes)) for s in samples)),
        Table("Kills", ("minute", "kind", "actor", "killed"),
              tuple((f"{k.at_s / 60:.1f}", k.kind, k.name, "yes" if k.killed else "no")
                    for k in kills)),
    ]
