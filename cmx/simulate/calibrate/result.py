"""What the calibration finds: this machine's speeds, the control costs of a load, each cell
measured and predicted (beside the CPU floor, for information), the cluster scenarios'
parameters against this machine, and the result that the tables, the JSON and
docs/BENCHMARKS.md show.

Plain figures, imported by every step of the calibration (``machine``, ``predict``, ``run``,
``docs``) and importing none of them."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

__all__ = ["COMMAND", "GOAL", "CalibrationResult", "ControlCosts", "Kind", "MachineSpeeds",
           "Parameter", "Row", "Spread", "Unit"]

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
    # one 4 KiB O_DIRECT read at a time, at random offsets of the same file: seconds each
    odirect_latency_s: float | None = None
    nixl_measured: bool = True  # False: NIXL could not run and ``nixl`` is ``copy``

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
    them in the comparison rather than choosing a machine state that never existed.

    Beside them, for information and never in place of the prediction, the CPU floor: the
    time the cores take to supply ``clients`` times one load's own CPU-seconds, measured with
    one client (``predict.cpu_floor``). A prediction below it misses CPU the model does not
    charge."""

    source: str
    clients: int
    blocks: int  # per load
    nbytes: int  # per load
    measured_s: tuple[float, ...]  # the service: every load's wall time
    predicted_s: tuple[float, ...]  # the simulator: every load's duration
    # the CPU floor of each repetition whose one load's CPU was measured; not judged
    floor_s: tuple[float, ...] = ()

    @property
    def measured(self) -> float:
        return statistics.median(self.measured_s)

    @property
    def predicted(self) -> float:
        return statistics.median(self.predicted_s)

    @property
    def floor(self) -> float | None:
        """The median CPU floor over the repetitions; None where not measured."""
        return statistics.median(self.floor_s) if self.floor_s else None

    @property
    def error(self) -> float:
        """Signed: the prediction's median over the measured median, less one."""
        return self.predicted / self.measured - 1.0

    @property
    def ok(self) -> bool:
        return abs(self.error) <= GOAL


class Kind(Enum):
    """Where a figure comes from, as docs/SIMULATE.md's table of inputs names it."""

    SEED = "seed"  # the article the project started from
    ASSUMED = "assumed"  # a choice, to be replaced by a measurement where one is made
    MEASURED = "measured"  # on this machine, in this run


class Unit(Enum):
    """How a parameter is shown: (its name, the SI value of one, the SI unit it is kept in)."""

    MS = ("ms", 1e-3, "s")
    US = ("µs", 1e-6, "s")
    GBS = ("GB/s", 1e9, "bytes/s")

    def show(self, value: float) -> str:
        x = value / self.value[1]
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"

    @property
    def label(self) -> str:
        return str(self.value[0])

    @property
    def si(self) -> str:
        return str(self.value[2])


@dataclass(frozen=True)
class Spread:
    """A figure measured several times: the median, the least and the most of ``values``."""

    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError("a spread needs at least one value")

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(tuple(float(v) for v in values))

    @property
    def median(self) -> float:
        return float(statistics.median(self.values))

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)


@dataclass(frozen=True)
class Parameter:
    """One parameter the cluster scenarios take, against what this machine measured for it.

    ``scenarios`` is read from the simulator's own objects (``origin`` names which), never
    copied; ``measured`` is None where the parameter cannot be measured here, and ``how``
    then says why."""

    name: str
    unit: Unit
    scenarios: float  # the scenarios' value, in the unit's SI unit
    kind: Kind  # the scenarios' value's kind: seed or assumed
    origin: str  # the simulator object the scenarios take it from
    measured: Spread | None  # over the run's repetitions, in the same SI unit
    how: str  # how it was measured, or why it cannot be here

    @property
    def measured_kind(self) -> Kind | None:
        return Kind.MEASURED if self.measured is not None else None

    @property
    def ratio(self) -> float | None:
        """The measured median over the scenarios' value."""
        if self.measured is None or not self.scenarios:
            return None
        return self.measured.median / self.scenarios

    def scenarios_text(self) -> str:
        return f"{self.unit.show(self.scenarios)} {self.unit.label}"

    def measured_text(self) -> str:
        m, u = self.measured, self.unit
        if m is None:
            return "not measurable here"
        return f"{u.show(m.median)} {u.label} ({u.show(m.low)} to {u.show(m.high)})"

    def ratio_text(self) -> str:
        r = self.ratio
        return "" if r is None else f"{r:.3g}x"

    def to_dict(self) -> dict[str, Any]:
        m = self.measured
        return {"name": self.name, "unit": self.unit.si, "scenarios": self.scenarios,
                "scenarios_kind": self.kind.value, "origin": self.origin,
                "measured": None if m is None else {
                    "median": m.median, "min": m.low, "max": m.high, "values": list(m.values)},
                "measured_kind": None if m is None else Kind.MEASURED.value,
                "ratio": self.ratio, "how": self.how}


@dataclass(frozen=True)
class CalibrationResult:
    speeds: MachineSpeeds  # the median of each speed over the repetitions
    control: dict[str, ControlCosts]  # the median of each cost over the repetitions
    rows: tuple[Row, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    raw: dict[str, Any] = field(default_factory=dict)  # every measurement, for the JSON
    parameters: tuple[Parameter, ...] = ()  # the cluster scenarios' parameters, this machine
    code: str = ""  # the commit that ran (``cmx.bench.harness.machine.code_version``)

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
                    "predicted s (median)", "error", "goal", "CPU floor s (median)"):
            t.add_column(col, justify="left" if col == "source" else "right")
        for r in self.rows:
            t.add_row(r.source, str(r.clients), f"{r.nbytes / MiB:.0f} MiB",
                      str(len(r.measured_s)), f"{r.measured:.3f}", f"{r.predicted:.3f}",
                      f"{100 * r.error:+.1f}%", "PASS" if r.ok else "MISS",
                      "" if r.floor is None else f"{r.floor:.3f}")
        return t

    def parameter_table(self) -> Any:
        from rich.table import Table

        t = Table(title="the cluster scenarios' parameters against this machine")
        for col in ("parameter", "scenarios", "kind", "measured: median (min-max)", "kind",
                    "measured / scenarios"):
            t.add_column(col, justify="left" if col in ("parameter", "kind") else "right")
        for p in self.parameters:
            t.add_row(p.name, p.scenarios_text(), p.kind.value, p.measured_text(),
                      p.measured_kind.value if p.measured_kind else "", p.ratio_text())
        return t

    def to_dict(self) -> dict[str, Any]:
        return {"speeds": asdict(self.speeds),
                "control": {k: asdict(v) for k, v in self.control.items()},
                "rows": [{**asdict(r), "measured_median_s": r.measured,
                          "predicted_median_s": r.predicted, "error": r.error, "ok": r.ok,
                          "floor_median_s": r.floor}
                         for r in self.rows],
                "parameters": [p.to_dict() for p in self.parameters],
                "ok": self.ok, "goal": self.goal, "notes": list(self.notes),
                "command": self.command, "raw": self.raw}
