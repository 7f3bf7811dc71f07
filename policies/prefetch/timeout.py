"""timeout: a prefetch may run ``timeout_s`` from its start; then the request goes regardless.

The budget counts from when the move was asked for (the request's arrival), not from when the
replica became free: a request that queued long enough has already had its time.
"""

from __future__ import annotations

from cmx.policies.prefetch.base import PendingPrefetch, PrefetchPolicy

__all__ = ["Timeout"]


class Timeout(PrefetchPolicy):
    name = "timeout"

    def __init__(self, timeout_s: float = 0.5) -> None:
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        self.timeout_s = timeout_s

    def _deadline(self, prefetch: PendingPrefetch, now: float) -> float:
        return prefetch.started_s + self.timeout_s
