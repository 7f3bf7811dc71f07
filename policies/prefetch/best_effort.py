"""best_effort: never hold a free replica; use whatever has moved by the time it starts."""

from __future__ import annotations

from cmx.policies.prefetch.base import PendingPrefetch, PrefetchPolicy

__all__ = ["BestEffort"]


class BestEffort(PrefetchPolicy):
    name = "best_effort"

    def _deadline(self, prefetch: PendingPrefetch, now: float) -> float:
        return now
