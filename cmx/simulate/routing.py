"""Which replica a request goes to: the choice a serving cluster's router makes.

- ``least-loaded``: the less loaded of two replicas drawn at random (the power of two
  choices: queues stay short without a global view).
- ``prefix``: prefix affinity, as a cache-aware router's: every request of one shared prefix
  goes to that prefix's home replica (a hash of the prefix), where its blocks are likeliest
  in HBM already; unless the home holds more than ``slack`` requests beyond the less loaded
  of the two random replicas, which then takes it (a hot prefix must not pin one replica).

Both draw the same two replicas per arrival, so the runs differ only in the choice.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cmx.simulate.cluster import Replica

__all__ = ["ROUTINGS", "Router", "check_routing"]

ROUTINGS = ("least-loaded", "prefix")
_MIX = 0x9E3779B97F4A7C15  # a prefix id's home: Fibonacci hashing, spread over the replicas


class Router:
    def __init__(self, replicas: Sequence[Replica], routing: str, arrivals: int, seed: int,
                 slack: int = 2) -> None:
        check_routing(routing)
        if slack < 0:
            raise ValueError(f"slack must be >= 0, got {slack}")
        self.replicas = replicas
        self.affinity = routing == "prefix"
        self.slack = slack
        # Each arrival's two replicas, drawn in one call: the same numbers, in the same order,
        # as one draw of two per arrival.
        rng = np.random.default_rng(seed)
        self._pairs = rng.integers(0, len(replicas), (arrivals, 2)).tolist()

    def route(self, i: int, prefix: int) -> Replica:
        """The replica arrival ``i``, of shared prefix ``prefix``, is sent to."""
        a, b = self._pairs[i]
        ra, rb = self.replicas[a], self.replicas[b]
        least = ra if load(ra) <= load(rb) else rb
        if not self.affinity:
            return least
        home = self.replicas[((prefix * _MIX) & (2**64 - 1)) % len(self.replicas)]
        return home if load(home) <= load(least) + self.slack else least


def check_routing(routing: str) -> None:
    """ValueError for a routing not in ``ROUTINGS``."""
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; known: {', '.join(ROUTINGS)}")


def load(replica: Replica) -> int:
    """Requests on ``replica``: the one it computes and those waiting for it."""
    return len(replica.queue) + (replica.busy is not None)
