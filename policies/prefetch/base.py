"""The prefetch policy interface. The base class owns the waiting; a policy names the deadline.

Protocol, in call order:

1. A request arrives at a replica; the replica asks the node's agent to move the request's
   cached prefix toward it (``NamespaceClient.prefetch``) and wraps the answer in a
   ``PendingPrefetch``: started at, and a way to wait on it.
2. The replica calls ``policy.wait(prefetch, clock)``: the Serve application at once, at the
   request's arrival, before the request goes to vLLM (``deploy.server``); the simulator when
   the request's replica is free (``cmx.simulate.engine``). The base asks the policy for a
   deadline (``_deadline``), waits until the move completes or the deadline passes, and
   returns ``Waited``: the outcome and the seconds spent waiting.
3. The request goes on, and its engine loads what is cached by then. A move still in flight is
   not cancelled (the agent finishes it), so stopping the wait early costs nothing but the
   bytes not yet moved.

The clock is injected (a callable returning seconds), so tests drive a fake one.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

__all__ = ["PendingPrefetch", "PrefetchOutcome", "PrefetchPolicy", "Waited"]


class PendingPrefetch(Protocol):
    """A move in flight. ``wait`` returns True once it has completed (successfully or not)."""

    started_s: float  # clock time the move was asked for

    def done(self) -> bool: ...

    def wait(self, timeout_s: float) -> bool: ...


class PrefetchOutcome(str, enum.Enum):
    NONE = "none"  # nothing was prefetched (no cached prefix, or cache off)
    DONE = "done"  # the move completed before the request started
    CUT = "cut"  # the request started with the move still in flight


@dataclass(frozen=True)
class Waited:
    outcome: PrefetchOutcome
    waited_s: float  # time the request spent waiting for the move


class PrefetchPolicy(ABC):
    name: ClassVar[str]

    def wait(
        self, prefetch: PendingPrefetch | None, clock: Callable[[], float],
        cap_s: float = float("inf"),
    ) -> Waited:
        """Wait for ``prefetch`` until the policy's deadline, and never more than ``cap_s``.

        The caller's cap is what the move is worth: a replica that waits longer than the load
        was estimated to take (break-even's patience) would rather start computing.
        """
        if prefetch is None:
            return Waited(PrefetchOutcome.NONE, 0.0)
        if prefetch.done():
            return Waited(PrefetchOutcome.DONE, 0.0)
        start = clock()
        budget = self.deadline(prefetch, start, cap_s) - start
        if not budget > 0:
            return Waited(PrefetchOutcome.CUT, 0.0)
        done = prefetch.wait(budget)
        return Waited(PrefetchOutcome.DONE if done else PrefetchOutcome.CUT, clock() - start)

    def deadline(self, prefetch: PendingPrefetch, now: float,
                 cap_s: float = float("inf")) -> float:
        """Clock time until which ``wait`` would wait, for callers that cannot block (an
        event-driven simulation): the policy's deadline, at most ``cap_s`` (and an hour) on."""
        return now + max(0.0, min(self._deadline(prefetch, now) - now, cap_s, 3600.0))

    @abstractmethod
    def _deadline(self, prefetch: PendingPrefetch, now: float) -> float:
        """Clock time until which the request waits for ``prefetch`` (``now``: not at all)."""
