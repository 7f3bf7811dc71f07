"""Python's cyclic garbage collector, run in larger batches while the event loop runs.

The loop allocates millions of short-lived objects (jobs, their closures, requests) beside a
large live set (the directory, the tiers' and the policies' books). At the default thresholds
an object still alive at a young collection is promoted, and promotions bring the next full
collection, a scan of the whole live set, nearer: on 1,000 nodes those scans were half of a
run's CPU time. Young collections every 100,000 allocations let most of those objects die
young. Collection only frees memory: what a run computes does not depend on it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["LOOP_THRESHOLDS", "collect_in_batches"]

LOOP_THRESHOLDS = (100_000, 50, 100)  # gc.set_threshold's three, while the loop runs


@contextmanager
def collect_in_batches() -> Iterator[None]:
    """Run the body at ``LOOP_THRESHOLDS``; the thresholds before are restored on the way out,
    whatever the body raises."""
    before = gc.get_threshold()
    gc.set_threshold(*LOOP_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)
