"""Rich tables of the admin API's answers: tiers per node, a prefix lookup, an eviction."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from cmx.api.models import AgentInfo, NodeView, PoolStatus, TiersView

__all__ = ["copies_table", "human_bytes", "lookup_table", "status_tables"]

_TIER_NAMES = {"hbm": "HBM G1", "dram": "DRAM G2", "nvme": "NVMe G3", "pool": "Pool G4"}


def human_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or abs(n) >= 10 else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"


def _rate(n: float | None) -> str:
    """Compact: 0, 512B/s, 12K/s, 1.5G/s."""
    if n is None:
        return "—"
    if n < 0.5:
        return "0"
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1000 or unit == "T":
            return f"{n:.0f}{unit}/s" if n >= 10 or unit == "B" else f"{n:.1f}{unit}/s"
        n /= 1024
    return "—"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def _bar(share: float, width: int = 8) -> Text:
    share = min(max(share, 0.0), 1.0)
    style = "red" if share >= 0.9 else "yellow" if share >= 0.7 else "green"
    filled = round(share * width)
    bar = Text("█" * filled, style=style)
    bar.append("░" * (width - filled), style="grey50")
    bar.append(f" {_pct(share):>4}")
    return bar


def _agent_line(node: NodeView) -> str:
    agent = node.agent
    head = f"node {node.node[:12]}"
    if not agent.available:
        return f"{head} · agent not answering"
    return f"{head} · agent on {'DPU' if agent.dpu else 'host'} · {agent.transport}"


def _queues(agent: AgentInfo) -> str:
    q = agent.queues
    return f"queued moves: {q.load} load, {q.prefetch} prefetch, {q.demote} demote"


def _extra_notes(name: str, extra: dict[str, int | float | str]) -> list[str]:
    """What a tier's extra figures say that needs an operator: its store, orphans, fallbacks."""
    notes = []
    if extra.get("store_id"):
        notes.append(f"{name}: store node-{extra['store_id']}")
    if extra.get("degraded"):
        notes.append(f"{name}: DEGRADED, {extra['degraded']}")
    if extra.get("orphan_dirs"):
        notes.append(f"{name}: {extra['orphan_dirs']} orphaned store dir(s), "
                     f"{human_bytes(float(extra.get('orphan_bytes', 0)))} "
                     f"(`cmx orphans --collect`)")
    return notes


def _table(title: str) -> Table:
    table = Table(title=escape(title), title_justify="left", box=box.SIMPLE_HEAD,
                  padding=(0, 1), title_style="bold")
    for col in ("tier", "occupancy", "used / capacity", "blocks", "hits", "in", "out"):
        right = col not in ("tier", "occupancy")
        table.add_column(col, justify="right" if right else "left", no_wrap=True)
    return table


def status_tables(view: TiersView, pool: PoolStatus | None = None) -> list[Table]:
    """One table per node (its tiers; the agent in the title), and one for the pool."""
    tables = []
    for node in view.nodes:
        table = _table(_agent_line(node))
        notes: list[str] = [_queues(node.agent)] if node.agent.available else []
        if node.agent.degraded:
            notes.append(f"agent: DEGRADED, {node.agent.degraded}")
        for tier in node.tiers:
            name = _TIER_NAMES.get(tier.tier, tier.tier)
            if not tier.available:
                table.add_row(name, Text("not answering", style="red"), "", "", "", "", "")
                notes.append(f"{name}: {tier.error}")
                continue
            if tier.emulated:
                name += "*"
                notes.append("* emulated on host memory (no GPU)")
            if tier.pinned:
                notes.append(f"{name}: {tier.pinned} block(s) pinned")
            notes += _extra_notes(name, tier.extra)
            cap = tier.capacity_bytes
            table.add_row(
                name, _bar(tier.used_bytes / cap if cap else 0.0),
                f"{human_bytes(tier.used_bytes)} / {human_bytes(cap)}", str(tier.blocks),
                _pct(tier.hit_ratio), _rate(tier.bandwidth.in_bytes_per_s),
                _rate(tier.bandwidth.out_bytes_per_s))
        if notes:
            table.caption = escape("\n".join(dict.fromkeys(notes)))
            table.caption_justify = "left"
        tables.append(table)
    if pool is not None and pool.enabled:
        table = _table(f"pool (G4) · {len(pool.nodes)} pool node(s) · "
                       f"{pool.replication or 1} cop(ies) per block")
        for member in pool.nodes:
            used, cap = member.used_bytes, member.capacity_bytes
            row: list[Text | str] = (
                [_bar(used / cap if cap else 0.0), f"{human_bytes(used)} / {human_bytes(cap)}",
                 str(member.blocks)] if member.available
                else [Text("not answering", style="red"), "", ""])
            table.add_row(member.node[:8], *row, "", "", "")
        tables.append(table)
    return tables


def lookup_table(result: dict[str, Any]) -> Table:
    table = Table(title=(f"namespace {result['namespace_id']}: {result['num_tokens']} tokens "
                         f"cached ({result['num_blocks']} of {result['full_blocks']} blocks)"),
                  title_justify="left")
    for col in ("block", "key", "fastest copy", "copies"):
        table.add_column(col)
    for b in result.get("blocks", []):
        copies = ", ".join(f"{c['tier']}@{c['node'][:8]}" for c in b["copies"])
        table.add_row(str(b["index"]), b["key"][:16] + "…",
                      f"{_TIER_NAMES.get(b['tier'], b['tier'])} on {b['node'][:12]}", copies)
    return table


def copies_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"block {result['key'][:16]}…", title_justify="left",
                  box=box.SIMPLE_HEAD)
    for col in ("tier", "node", "size", "checksum"):
        table.add_column(col, justify="right" if col == "size" else "left")
    for c in result["copies"]:
        table.add_row(_TIER_NAMES.get(c["tier"], c["tier"]), c["node"][:16],
                      human_bytes(c["size"]), f"{c['checksum']:016x}")
    return table
