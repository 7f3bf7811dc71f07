"""A node's cores: every piece of CPU work on a node shares them, as the kernel shares cores."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

import pytest

from cmx.simulate.cores import Cores


class Clock:
    """The engine's event loop, reduced to what the cores use."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self.seq = 0
        self.now = 0.0

    def at(self, t: float, handler: Callable[[Any], None], arg: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, handler, arg))

    def run(self) -> None:
        while self.events:
            self.now, _, handler, arg = heapq.heappop(self.events)
            handler(arg)


def _ends(count: int, pieces: list[tuple[float, float]]) -> list[float]:
    """When each (start, seconds) piece of work ends on ``count`` cores."""
    clock, cores = Clock(), Cores("test.cpu", count)
    cores.bind(clock.at)
    ends = [float("nan")] * len(pieces)
    for i, (start, _) in enumerate(pieces):
        clock.at(start, lambda i: cores.add(clock.now, pieces[i][1],
                                            lambda t, i=i: ends.__setitem__(i, t)), i)
    clock.run()
    return ends


def test_a_piece_alone_takes_its_work_and_never_more_than_one_core() -> None:
    assert _ends(2, [(0.5, 2.0)]) == [pytest.approx(2.5)]


def test_four_equal_pieces_on_two_cores_share_them_and_end_together() -> None:
    assert _ends(2, [(0.0, 1.0)] * 4) == pytest.approx([2.0] * 4)


def test_a_late_piece_slows_the_ones_running() -> None:
    # One core: the first runs alone for 1 s (1 of its 2 s done), then both at half speed:
    # the first's last second takes 2 s, then the second's last second runs alone.
    assert _ends(1, [(0.0, 2.0), (1.0, 2.0)]) == pytest.approx([3.0, 4.0])


def test_a_short_piece_leaves_and_the_rest_speed_up() -> None:
    # Three pieces on one core: 0.5 s, 2 s and 2 s of work. All at a third of a core until
    # the short one ends at 1.5 s, then the two at half until 1.5 + 2 * 1.5 = 4.5 s.
    assert _ends(1, [(0.0, 0.5), (0.0, 2.0), (0.0, 2.0)]) == pytest.approx([1.5, 4.5, 4.5])


def test_work_of_no_seconds_ends_at_once_and_the_busy_time_is_what_ran() -> None:
    clock, cores = Clock(), Cores("test.cpu", 4)
    cores.bind(clock.at)
    ended: list[float] = []
    cores.add(0.0, 0.0, ended.append)
    assert ended == [0.0]
    cores.add(0.0, 1.0, ended.append)
    cores.add(0.0, 3.0, ended.append)
    clock.run()
    assert ended == [0.0, pytest.approx(1.0), pytest.approx(3.0)]
    assert cores.busy_s == pytest.approx(4.0) and cores.running == 0


def test_no_cores_and_an_unbound_node_are_refused() -> None:
    with pytest.raises(ValueError, match="cores must be >= 1"):
        Cores("test.cpu", 0)
    with pytest.raises(RuntimeError, match="not bound"):
        Cores("test.cpu", 1).add(0.0, 1.0, lambda t: None)


def _process_ends(count: int, threads: dict[str, int],
                  pieces: list[tuple[str | None, float]]) -> list[float]:
    """When each (process, seconds) piece, all started at 0, ends on ``count`` cores whose
    processes run on ``threads`` threads each (None: the agent's, no process's)."""
    clock, cores = Clock(), Cores("test.cpu", count)
    cores.bind(clock.at)
    for process, n in threads.items():
        cores.limit(process, n)
    ends = [float("nan")] * len(pieces)
    for i, (process, seconds) in enumerate(pieces):
        cores.add(0.0, seconds, lambda t, i=i: ends.__setitem__(i, t), process)
    clock.run()
    return ends


def test_a_process_of_one_thread_runs_its_pieces_in_turn_whatever_cores_are_free() -> None:
    # Two pieces of one interpreter on 112 cores: one core between them, so both end at 2 s;
    # the same pieces in two processes, or the agent's, run side by side.
    assert _process_ends(112, {"r0": 1}, [("r0", 1.0), ("r0", 1.0)]) == pytest.approx([2.0, 2.0])
    assert _process_ends(112, {"r0": 1, "r1": 1}, [("r0", 1.0), ("r1", 1.0)]) == pytest.approx(
        [1.0, 1.0])
    assert _process_ends(112, {}, [(None, 1.0), (None, 1.0)]) == pytest.approx([1.0, 1.0])


def test_processes_share_the_nodes_cores_by_what_each_can_use() -> None:
    # One core; a process of one thread with two pieces asks for one core, the agent's one
    # piece for one: each gets half, the process's pieces a quarter each. The agent's piece
    # (0.5 s) ends at 1 s; then the process has the core: its pieces' 0.75 s left each take
    # 1.5 s more.
    ends = _process_ends(1, {"r0": 1}, [("r0", 1.0), ("r0", 1.0), (None, 0.5)])
    assert ends == pytest.approx([2.5, 2.5, 1.0])


def test_a_process_never_limited_is_refused_and_a_limit_below_one_thread_too() -> None:
    cores = Cores("test.cpu", 2)
    cores.bind(Clock().at)
    with pytest.raises(KeyError):
        cores.add(0.0, 1.0, lambda t: None, "nobody")
    with pytest.raises(ValueError):
        cores.limit("r0", 0)
    assert cores.running == 0
