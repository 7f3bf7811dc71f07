"""wait_complete: the request starts once its prefix has arrived (bounded by ``max_wait_s``).

Waiting costs nothing a load would not: the prefetch *is* the load, started earlier. It is the
default, because a request that starts with its move half done loads the rest in the background
while it computes, and may end up computing tokens whose blocks were about to land.
"""

from __future__ import annotations

from cmx.policies.prefetch.base import PendingPrefetch, PrefetchPolicy

__all__ = ["WaitComplete"]


class WaitComplete(PrefetchPolicy):
    name = "wait_complete"

    def __init__(self, max_wait_s: float = 30.0) -> None:
        if max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be positive, got {max_wait_s}")
        self.max_wait_s = max_wait_s  # a move that never completes must not hold a replica

    def _deadline(self, prefetch: PendingPrefetch, now: float) -> float:
        return now + self.max_wait_s
