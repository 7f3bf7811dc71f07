"""S3-FIFO: a small probation FIFO, a main FIFO and a ghost queue of recently evicted keys.

New blocks enter the small queue (about 10% of the resident blocks). When the eviction hand
reaches a block there, a block hit since it entered moves to the main queue; one that was never
hit is the victim, so one-hit wonders (a scan, a prompt seen once) leave first and never push
reused blocks out. A key evicted from the small queue is remembered in the ghost queue; if it
comes back it goes straight to the main queue. In the main queue each hit buys one more pass
(frequency capped at 3): the hand moves a block with frequency > 0 to the back and lowers its
frequency instead of evicting it.

The reorganization happens lazily in ``_order()``, only as far as the store reads victims. A
block the store passes over (pinned, or deferred by the base class because it has children)
moves to the back of its queue, as a clock hand moves past it. A scan that runs to its end
without the store evicting any block it offered is undone, move by move, so a failed eviction
(every block pinned) leaves the queues and frequencies as they were.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from typing import NamedTuple

from cmx.policies.eviction.base import EvictionPolicy, Key

__all__ = ["S3FIFOPolicy"]

MAX_FREQ = 3


class _Move(NamedTuple):
    key: Key
    from_small: bool
    to_small: bool
    freq: int  # before the move


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(self, small_ratio: float = 0.1) -> None:
        super().__init__()
        if not 0.0 < small_ratio < 1.0:
            raise ValueError(f"small_ratio must lie in (0, 1), got {small_ratio}")
        self.small_ratio = small_ratio
        self._small: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self._freq: dict[Key, int] = {}  # resident key -> hits, capped at MAX_FREQ
        self._ghost: OrderedDict[Key, None] = OrderedDict()  # evicted from small, oldest first
        self._ghost_cap = 0  # most blocks ever resident: the ghost remembers as many keys

    # -- hooks ---------------------------------------------------------------------------------

    def _on_insert(self, key: Key) -> None:
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._ghost_cap = max(self._ghost_cap, len(self._freq))

    def _on_touch(self, key: Key) -> None:
        self._freq[key] = min(self._freq[key] + 1, MAX_FREQ)

    def _on_remove(self, key: Key) -> None:
        del self._freq[key]
        if key in self._small:
            del self._small[key]
            self._ghost[key] = None
            while len(self._ghost) > self._ghost_cap:
                self._ghost.popitem(last=False)
        else:
            del self._main[key]

    def _order(self) -> Iterator[Key]:
        seen: set[Key] = set()
        moves: list[_Move] = []  # every move of the hand, to undo a scan that found no victim
        evicted = False
        main_passed = 0  # consecutive already-seen blocks the hand moved past in main
        while True:
            small_open = bool(self._small) and next(iter(self._small)) not in seen
            main_open = bool(self._main) and main_passed < len(self._main)
            if small_open and (len(self._small) >= self._small_target() or not main_open):
                key = next(iter(self._small))
                if self._freq[key] > 0:  # reused while on probation: promote
                    self._move(moves, key, self._small, self._main, 0)
                    main_passed = 0
                    continue
                queue = self._small
            elif main_open:
                key = next(iter(self._main))
                if key in seen:
                    self._move(moves, key, self._main, self._main, self._freq[key])
                    main_passed += 1
                    continue
                if self._freq[key] > 0:  # one more pass for each hit
                    self._move(moves, key, self._main, self._main, self._freq[key] - 1)
                    main_passed = 0
                    continue
                queue = self._main
            else:
                break
            seen.add(key)
            yield key
            if key in queue:  # passed over: the hand moves past it
                self._move(moves, key, queue, queue, self._freq[key])
            else:
                evicted = True
        if not evicted:
            self._undo(moves)  # a scan that evicted nothing changes nothing

    def _move(self, moves: list[_Move], key: Key, src: OrderedDict[Key, None],
              dst: OrderedDict[Key, None], freq: int) -> None:
        """Take ``key`` from the front of ``src`` to the back of ``dst`` with ``freq``."""
        moves.append(_Move(key, src is self._small, dst is self._small, self._freq[key]))
        del src[key]
        dst[key] = None
        self._freq[key] = freq

    def _undo(self, moves: list[_Move]) -> None:
        for move in reversed(moves):
            src = self._small if move.from_small else self._main
            dst = self._small if move.to_small else self._main
            del dst[move.key]
            src[move.key] = None
            src.move_to_end(move.key, last=False)
            self._freq[move.key] = move.freq

    def _small_target(self) -> int:
        return max(1, math.ceil(self.small_ratio * len(self._freq)))

    def _check_policy(self) -> None:
        small, main, resident = len(self._small), len(self._main), len(self._parent)
        if small + main != resident or self._freq.keys() != self._parent.keys():
            raise AssertionError(
                f"small {small} + main {main} != resident {resident} "
                f"(frequencies for {len(self._freq)})"
            )
        if self._small.keys() & self._main.keys():
            raise AssertionError(f"{len(self._small.keys() & self._main.keys())} keys in both")
        ghosts = len(self._ghost.keys() & self._freq.keys())
        if ghosts or len(self._ghost) > self._ghost_cap:
            raise AssertionError(
                f"ghost holds {len(self._ghost)} keys (cap {self._ghost_cap}), {ghosts} resident"
            )
        bad = [f for f in self._freq.values() if not 0 <= f <= MAX_FREQ]
        if bad:
            raise AssertionError(f"{len(bad)} frequencies outside 0..{MAX_FREQ}: {bad[:5]}")
