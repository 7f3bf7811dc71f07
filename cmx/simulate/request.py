"""One request as the event loop moves it through its life (``engine``), and as the probe
records it when it finishes (``probe``)."""

from __future__ import annotations

from cmx.simulate.agent import Job
from cmx.simulate.cluster import Replica

__all__ = ["Req"]


class Req:
    __slots__ = ("i", "replica", "keys", "sources", "load_keys", "job", "start",
                 "compute_start", "cut", "late", "context", "gpu_s", "parts", "cpu_io_wait",
                 "in_place", "move_keys", "move_sources")

    def __init__(self, i: int, replica: Replica, context: int) -> None:
        self.i = i
        self.replica = replica
        self.context = context
        self.keys: list[bytes] = []
        self.sources: list[int] = []  # where each loaded block is read from
        self.load_keys: list[bytes] = []
        self.in_place: list[bytes] = []  # of load_keys, those in this node's HBM: used there
        self.move_keys: list[bytes] = []  # of load_keys, those a job moves
        self.move_sources: list[int] = []
        self.job: Job | None = None
        self.start = -1.0
        self.compute_start = -1.0
        self.cut = False  # its load was refused: it recomputed everything
        self.late = False  # its prefetch missed the deadline: its own load overtook it
        self.gpu_s = 0.0  # the prefill's seconds on an idle host
        self.parts = 0  # of the prefill still running: its GPU work, its host work
        # of its wait for KV, the part after the bytes arrived: CPU work issuing the I/Os, or
        # copying and checking what they moved
        self.cpu_io_wait = 0.0
