"""What the calibration finds: this machine's speeds, the control costs of a load, each cell
measured and predicted, and the result that the table, the JSON and docs/BENCHMARKS.md show.

Plain figures, imported by every step of the calibration (``machine``, ``predict``, ``run``,
``docs``) and importing none of them."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["COMMAND", "GOAL", "CalibrationResult", "ControlCosts", "MachineSpeeds", "Row"]

MiB = 1 << 20
GB = 1e9
GOAL = 0.25  # the largest relative error of a prediction
COMMAND = "cmx simulate --calibrate --docs docs/BENCHMARKS.md"


@dataclass(frozen=True)
class MachineSpeeds:
    """Bytes/s of this machine's moves, each the median of a few runs."""

    copy: float  # copy_bytes between two faulted-in buffers: the agent's arena-to-arena copy
    copy_out: float  # the client's checked copy of blocks into a new tensor, on a thread
    odirect_read: float  # O_DIRECT, 4 MiB reads, 8 in flight, page cache bypassed
    checksum: float  # XXH3-64 over a buffer
    nixl: float  # NIXL UCX reads between two processes; ``copy`` where NIXL cannot run
    nixl_note: str  # how ``nixl`` was measured
    # ``copy_out`` of each thread while every core runs one (they share the memory's
    # bandwidth and the kernel's page faults); ``copy_out`` where not measured
    copy_out_shared: float | None = None

    def copy_out_at(self, threads: int) -> float:
        """The copy out's speed per thread with ``threads`` copying at once."""
        return self.copy_out if threads < 2 or not self.copy_out_shared else self.copy_out_shared


@dataclass(frozen=True)
class ControlCosts:
    """The control path of one load from one kind of source: ``fixed + per_block * n``."""

    fixed_s: float
    per_block_s: float


@dataclass(frozen=True)
class Row:
    """One cell: ``clients`` loads at once from ``source``, measured and predicted.

    Both sides are medians over every load of every repetition: each repetition's loads
    against the simulator's durations of the same loads from that repetition's own speeds and
    control costs. The machine is shared; its neighbours slow both sides, and a median keeps
    them in the comparison rather than choosing a machine state that never existed."""

    source: str
    clients: int
    blocks: int  # per load
    nbytes: int  # per load
    measured_s: tuple[float, ...]  # the service: every load's wall time
    predicted_s: tuple[float, ...]  # the simulator: every load's duration

    @property
    def measured(self) -> float:
        return statistics.median(self.measured_s)

    @property
    def predicted(self) -> float:
        return statistics.median(self.predicted_s)

    @property
    def error(self) -> float:
        """Signed: the prediction's median over the measured median, less one."""
        return self.predicted / self.measured - 1.0

    @property
    def ok(self) -> bool:
        return abs(self.error) <= GOAL


@dataclass(frozen=True)
class CalibrationResult:
    speeds: MachineSpeeds  # the median of each speed over the repetitions
    control: dict[str, ControlCosts]  # the median of each cost over the repetitions
    rows: tuple[Row, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    raw: dict[str, Any] = field(default_factory=dict)  # every measurement, for the JSON

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def goal(self) -> float:
        """The largest relative error a row is allowed (``Row.ok``)."""
        return GOAL

    @property
    def command(self) -> str:
        """The command that measures it again and writes its section of the docs."""
        return COMMAND

    def table(self) -> Any:
        from rich.table import Table

        t = Table(title="cmx simulate --calibrate: the service's loads, measured and predicted")
        for col in ("source", "clients", "bytes/load", "loads", "measured s (median)",
                    "predicted s (median)", "error", "goal"):
            t.add_column(col, justify="left" if col == "source" else "right")
        for r in self.rows:
            t.add_row(r.source, str(r.clients), f"{r.nbytes / MiB:.0f} MiB",
                      str(len(r.measured_s)), f"{r.measured:.3f}", f"{r.predicted:.3f}",
                      f"{100 * r.error:+.1f}%", "PASS" if r.ok else "MISS")
        return t

    def to_dict(self) -> dict[str, Any]:
        return {"speeds": asdict(self.speeds),
                "control": {k: asdict(v) for k, v in self.control.items()},
                "rows": [{**asdict(r), "measured_median_s": r.measured,
                          "predicted_median_s": r.predicted, "error": r.error, "ok": r.ok}
                         for r in self.rows],
                "ok": self.ok, "goal": self.goal, "notes": list(self.notes),
                "command": self.command, "raw": self.raw}
