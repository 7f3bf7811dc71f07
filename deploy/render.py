"""Rich renderings of ``cmx demo``: the requests, the tiers, the summary."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cmx.deploy.demo import LLMDemoResult
from cmx.stats import AgentStats, TierStats

__all__ = ["print_llm_demo", "request_progress"]

MiB = 1 << 20


def request_progress(console: Console) -> tuple[Progress, Callable[[str, int, int], None]]:
    progress = Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("requests"), TimeElapsedColumn(), console=console)
    task: list[Any] = []

    def update(what: str, done: int, total: int) -> None:
        if not task:
            task.append(progress.add_task(what, total=total))
        progress.update(task[0], description=what, completed=done, total=total)

    return progress, update


def _served(row: Any) -> str:
    """How many cached tokens the context memory gave; ``*``: moved here on arrival."""
    if not row.cached_tokens:
        return "-"
    mark = "*" if row.prefetch == "done" else ""
    return f"{row.loaded_tokens:,}{mark}" if row.loaded_tokens else "local"


def requests_table(result: LLMDemoResult) -> Table:
    t = Table(title=f"Requests ({result.model}; "
                    + ", ".join(f"{r} on the {n} node" for r, n in result.replicas.items()) + ")",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
              collapse_padding=True,
              caption="Requests of one wave (w) arrive together. cached: prompt tokens not "
                      "computed; memory: of those, loaded from the context memory (* moved to "
                      "the replica's node on arrival, by prefetch; local: vLLM's own prefix "
                      "cache). Questions are greedy, chats sampled with a seed; same: the same "
                      "output tokens with and without the cache.",
              caption_justify="left")
    for col, justify in (("w", "right"), ("request", "left"), ("rep", "left"),
                         ("prompt", "right"), ("cached", "right"), ("memory", "right"),
                         ("TTFT", "right"), ("no cache", "right"), ("gain", "right"),
                         ("same", "center")):
        t.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]  # rich literals
    for r in result.rows:
        t.add_row(str(r.wave), r.label, r.replica, f"{r.prompt_tokens:,}",
                  f"{r.cached_tokens:,}", _served(r), f"{r.ttft_cached_s:.2f}s",
                  f"{r.ttft_recompute_s:.2f}s", f"{r.speedup:.1f}x",
                  "[green]✓[/]" if r.same_output else "[red]✗[/]")
    return t


def tiers_table(result: LLMDemoResult) -> Table:
    t = Table(title="Tiers after the workload", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("node", "tier", "used", "capacity", "blocks", "hits", "evictions"):
        t.add_column(col, justify="left" if col in ("node", "tier") else "right")
    for node, entry in result.stats.nodes.items():
        name = result.node_names.get(node, node[:8])
        for tier, s in entry.tiers.items():
            if not isinstance(s, TierStats):
                t.add_row(name, tier.value, "-", "-", "-", "-", "-")
                continue
            label = f"{tier.value} (emulated)" if s.emulated else tier.value
            t.add_row(name, label, f"{s.used_bytes / MiB:,.1f} MiB",
                      f"{s.capacity_bytes / MiB:,.0f} MiB", str(s.blocks),
                      str(s.store.hits), str(s.store.evictions))
    return t


def agents_table(result: LLMDemoResult) -> Table:
    t = Table(title="Bytes each node's offload agent moved", title_justify="left",
              box=box.SIMPLE_HEAD)
    for col in ("node", "from -> to", "MiB", "via"):
        t.add_column(col, justify="right" if col == "MiB" else "left")
    for node, entry in result.stats.nodes.items():
        agent = entry.agent
        if not isinstance(agent, AgentStats):
            continue
        name = result.node_names.get(node, node[:8])
        via = ", ".join(f"{k} {v / MiB:,.1f}" for k, v in sorted(agent.moved_via.items()) if v)
        for i, (route, n) in enumerate(sorted(agent.moved_bytes.items())):
            t.add_row(name if i == 0 else "", route, f"{n / MiB:,.1f}", via if i == 0 else "")
    return t


def print_llm_demo(console: Console, result: LLMDemoResult) -> None:
    console.print(requests_table(result))
    console.print(tiers_table(result))
    console.print(agents_table(result))
    rows = result.rows
    prompt = sum(r.prompt_tokens for r in rows)
    cached = sum(r.cached_tokens for r in rows)
    hit = sum(r.ttft_cached_s for r in rows) / len(rows)
    miss = sum(r.ttft_recompute_s for r in rows) / len(rows)
    same = sum(r.same_output for r in rows)
    loaded = sum(r.loaded_tokens for r in rows)
    peers = sum(n for entry in result.stats.nodes.values()
                if isinstance(entry.agent, AgentStats)
                for route, n in entry.agent.moved_bytes.items() if "@peer" in route)
    console.print(f"Model: {result.model} (vLLM, CMXConnector)")
    console.print(
        f"{len(rows)} requests, {prompt:,} prompt tokens, {cached:,} not computed "
        f"({cached / prompt:.0%}), {loaded:,} of them loaded from the context memory; "
        f"{peers / MiB:,.1f} MiB of KV moved between the nodes' agents. "
        f"Mean time to first token {miss:.2f} s without the cache, {hit:.2f} s with it "
        f"({miss / hit:.1f}x). Same output with and without the cache: {same}/{len(rows)}. "
        f"Setup {result.setup_s:.0f} s, workload {result.replay_s:.0f} s.")
