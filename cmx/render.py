"""Rich renderings of the demo for the command line: its progress and its tiers (a bench suite's
figures: ``cmx.bench.harness.render``)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from cmx.storage_demo import DemoResult, TierReport
from cmx.storage_demo import Progress as DemoProgress

__all__ = ["byte_progress", "demo_table", "print_demo"]

GIB = 1 << 30


def byte_progress(console: Console) -> tuple[Progress, DemoProgress]:
    """A rich progress display and the ``(phase, done, total)`` callback that drives it."""
    progress = Progress(
        TextColumn("{task.description:<6}"), BarColumn(), DownloadColumn(binary_units=True),
        TransferSpeedColumn(), TimeElapsedColumn(), console=console,
    )
    tasks: dict[str, TaskID] = {}

    def update(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = progress.add_task(phase, total=total)
        progress.update(tasks[phase], completed=done)

    return progress, update


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}" if seconds > 0 and nbytes else "—"


def _row(tier: TierReport, block_bytes: int, role: str) -> tuple[str, ...]:
    stored = tier.stored_blocks * block_bytes
    loaded = tier.loaded_blocks * block_bytes
    return (
        f"{tier.name} {role}",
        f"{tier.capacity_bytes / GIB:.2f}",
        str(tier.stored_blocks),
        str(tier.evictions),
        str(tier.loaded_blocks),
        f"{loaded / GIB:.2f}",
        _rate(stored, tier.store_seconds),
        _rate(loaded, tier.load_seconds),
    )


def demo_table(r: DemoResult) -> Table:
    table = Table(title=f"{r.tokens:,} tokens -> {r.blocks} blocks of "
                        f"{r.block_bytes >> 20} MiB ({r.blocks * r.block_bytes / GIB:.2f} GiB)")
    for header in ("tier", "GiB cap", "stored", "evicted", "loaded", "GiB loaded", "GB/s store",
                   "GB/s load"):
        table.add_column(header, justify="left" if header == "tier" else "right")
    table.add_row(*_row(r.dram, r.block_bytes, "G2"))
    table.add_row(*_row(r.nvme, r.block_bytes, "G3"))
    return table


def print_demo(console: Console, r: DemoResult) -> None:
    console.print(demo_table(r))
    console.print(f"DRAM held blocks {_ranges(r.from_dram)} at load time (its {r.dram.policy} "
                  f"policy evicted the rest); NVMe served the others.")
    loaded = r.dram.loaded_blocks + r.nvme.loaded_blocks
    ok, bad = "[green]✓[/]", "[red]✗[/]"
    same = not r.mismatched and not r.missing
    console.print(f"{ok if same else bad} loaded {loaded}/{r.blocks} blocks, "
                  f"{loaded - len(r.mismatched)} byte-identical to what was stored"
                  + (f"; missing {r.missing}" if r.missing else "")
                  + (f"; differing {r.mismatched}" if r.mismatched else ""))
    reopened = r.reopened_found == r.blocks and r.reopened_verified
    console.print(f"{ok if reopened else bad} reopened the NVMe store: "
                  f"{r.reopened_found}/{r.blocks} blocks found, first and last read back "
                  f"{'identical' if r.reopened_verified else 'DIFFERENT'}")
    where = f"kept in {r.store_dir}" if r.kept else "removed"
    console.print(f"Blocks: stored, evicted, loaded from that tier. GB/s = 10^9 bytes/s over "
                  f"the time inside the stores' calls; NVMe store includes flush (durable); "
                  f"NVMe I/O engine: {r.io_engine}. Store files {where}. {r.seconds:.1f} s in all.")


def _ranges(indexes: list[int]) -> str:
    """[0, 1, 2, 5] as "0-2, 5"."""
    spans: list[list[int]] = []
    for i in indexes:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans) or "none"
