"""What ``cmx simulate`` shows: a table of the strategies side by side, JSON, PNG plots; with
``--capacity``, a table of each strategy's capacity and its JSON.

Plots need matplotlib (the ``bench`` extra); without it the table and the JSON are still
written and the command says the plots were skipped.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cmx.simulate.capacity import Capacity, Outcome
from cmx.simulate.config import SimConfig
from cmx.simulate.probe import SimResult

__all__ = [
    "capacity_seed_table",
    "capacity_table",
    "comparison_table",
    "write_capacity_json",
    "write_json",
    "write_plots",
]

TB = 1e12


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _rows(r: SimResult) -> list[tuple[str, str]]:
    rows = [
        ("requests (completed)", f"{r.requests:,} ({r.completed:,})"),
        ("TTFT p50 / p90 / p99 s", f"{r.ttft_s.p50:.2f} / {r.ttft_s.p90:.2f} / {r.ttft_s.p99:.2f}"),
        ("TTFT mean s", f"{r.ttft_s.mean:.2f}"),
        ("queueing p50 / p99 s", f"{r.queue_s.p50:.2f} / {r.queue_s.p99:.2f}"),
        ("GPU waiting on KV I/O", _pct(r.io_wait_fraction)),
        ("of which on the CPU work of its I/Os", _pct(r.io_cpu_wait_fraction)),
        ("GPU waiting on its host's CPU", _pct(r.cpu_wait_fraction)),
        ("host cores busy (GPU nodes)", _pct(r.host_cpu_utilization)),
        ("serving processes' threads busy", _pct(r.process_cpu_utilization)),
        ("wait p50 / p99 s", f"{r.io_wait_s.p50:.3f} / {r.io_wait_s.p99:.3f}"),
        ("context found cached", _pct(r.cached_fraction)),
        ("context loaded", _pct(r.loaded_fraction)),
        ("prefetches late: the request's own load overtook", f"{r.late:,}"),
        ("loads refused: recomputed", f"{r.cut:,}"),
    ]
    for cls, nbytes in r.loaded_bytes.items():
        rows.append((f"loaded from {cls} TB", f"{nbytes / TB:.2f}"))
    rows += [
        (
            "stored to DRAM / NVMe / pool TB",
            f"{r.stored_bytes / TB:.2f} / {r.demoted_bytes / TB:.2f} / {r.pooled_bytes / TB:.2f}",
        ),
        ("network TB", f"{r.network_bytes / TB:.2f}"),
    ]
    for t in r.tiers:
        rows.append(
            (
                f"{t.tier} peak / capacity",
                f"{_pct(t.peak_bytes / t.capacity_bytes) if t.capacity_bytes else '-'}"
                f" of {t.capacity_bytes / TB:.1f} TB",
            )
        )
    rows += [
        ("agent queue depth max / mean", f"{r.queue_depth_max} / {r.queue_depth_mean:.2f}"),
        ("jobs refused (class full past the submit timeout)", f"{r.dropped_jobs:,}"),
        ("events / wall s / CPU s", f"{r.events:,} / {r.wall_s:.1f} / {r.cpu_s:.1f}"),
    ]
    return rows


def comparison_table(results: Sequence[SimResult], title: str) -> Table:
    table = Table(title=title)
    table.add_column("figure")
    for r in results:
        table.add_column(r.strategy, justify="right")
    columns = [dict(_rows(r)) for r in results]
    names: list[str] = []
    for r in results:
        names += [name for name, _ in _rows(r) if name not in names]
    for name in names:
        table.add_row(name, *(c.get(name, "-") for c in columns))
    return table


def print_results(console: Console, results: Sequence[SimResult], title: str) -> None:
    console.print(comparison_table(results, title))


def write_json(
    path: Path, config: SimConfig, results: Sequence[SimResult], extra: dict[str, Any] | None = None
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"config": asdict(config), "results": [r.to_dict() for r in results], **(extra or {})}
    path.write_text(json.dumps(doc, indent=1, default=str))


def capacity_table(capacities: Sequence[Capacity], title: str) -> Table:
    """One row per strategy: median capacity over seeds, its interval, the p99 there."""
    table = Table(title=title)
    for name in (
        "strategy",
        "capacity req/s",
        "offered load",
        "interval req/s (load)",
        "p99 at capacity s",
        "seeds at a bound",
        "simulations",
    ):
        table.add_column(name, justify="left" if name == "strategy" else "right")
    for c in capacities:
        (rlo, rhi), (llo, lhi) = c.rate_interval, c.load_interval
        bounded = [s for s in c.seeds if s.outcome is not Outcome.RESOLVED]
        table.add_row(
            c.strategy,
            f"{c.rate_per_s:.2f}",
            f"{c.load:.2f}",
            f"{rlo:.2f}-{rhi:.2f} ({llo:.2f}-{lhi:.2f}) {c.interval.value}",
            "-" if c.p99_s is None else f"{c.p99_s:.2f}",
            ", ".join(f"{s.seed}: {s.outcome.value}" for s in bounded) or "none",
            f"{c.simulations:,}",
        )
    return table


def capacity_seed_table(capacities: Sequence[Capacity]) -> Table:
    """Each seed's answer: the load that met the target and the step above that missed."""
    table = Table(title="per seed: highest load meeting the target, and the next step")
    for name in ("strategy", "seed", "load (p99 s)", "next load (p99 s)", "outcome", "runs"):
        table.add_column(name, justify="left" if name in ("strategy", "outcome") else "right")
    for c in capacities:
        for s in c.seeds:
            table.add_row(
                c.strategy,
                str(s.seed),
                f"{s.met.load:.2f} ({s.met.p99_s:.2f})" if s.met else "-",
                f"{s.missed.load:.2f} ({s.missed.p99_s:.2f})" if s.missed else "-",
                s.outcome.value,
                str(s.simulations),
            )
    return table


def write_capacity_json(
    path: Path,
    config: SimConfig,
    capacities: Sequence[Capacity],
    extra: dict[str, Any] | None = None,
) -> None:
    """``config``: the scenario at load 1 (a capacity's rate is its load times that rate)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"config": asdict(config), "capacity": [c.to_dict() for c in capacities], **(extra or {})}
    path.write_text(json.dumps(doc, indent=1, default=str))


def write_plots(path: Path, results: Sequence[SimResult], title: str) -> bool:
    """TTFT distribution, tier occupancy and agent queue depth; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in results:
        x = np.sort(np.asarray(r.ttft_samples))
        axes[0].plot(x, np.arange(1, len(x) + 1) / max(1, len(x)), label=r.strategy)
        t = np.asarray(r.series["t_s"])
        for tier in ("hbm", "dram", "nvme", "pool"):
            cap = next((s.capacity_bytes for s in r.tiers if s.tier == tier), 0)
            if cap:
                used = np.asarray(r.series[f"{tier}_bytes"]) / cap
                axes[1].plot(t, 100 * used, label=f"{r.strategy} {tier}")
        axes[2].plot(t, r.series["queued"], label=f"{r.strategy} queued")
    axes[0].set(
        xlabel="time to first token (s)", ylabel="share of requests", title="TTFT distribution"
    )
    axes[1].set(xlabel="simulated time (s)", ylabel="% of capacity", title="tier occupancy")
    axes[2].set(
        xlabel="simulated time (s)", ylabel="jobs queued, all agents", title="agent queue depth"
    )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
