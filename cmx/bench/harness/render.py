"""A bench suite's figures as a rich table for the command line (``cmx bench``)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cmx.bench.harness.core import SuiteResult, Verdict
from cmx.bench.harness.report import FIGURE_HEADERS, figure_rows

__all__ = ["print_suite"]


def print_suite(console: Console, suite: SuiteResult) -> None:
    table = Table(title=f"cmx bench {suite.name}", title_justify="left")
    for header in FIGURE_HEADERS:
        table.add_column(header, justify="left" if header == "Figure" else "right")
    styles = {Verdict.PASS: "green", Verdict.MISS: "red", Verdict.INFO: ""}
    for fig, row in zip(suite.figures, figure_rows(suite.figures), strict=True):
        verdict = fig.verdict.value
        table.add_row(*map(escape, row[:-1]),
                      f"[{styles[fig.verdict]}]{verdict}[/]" if styles[fig.verdict] else "—")
    console.print(table)
    for t in suite.tables:
        detail = Table(title=escape(t.title), title_justify="left")
        for h in t.headers:
            detail.add_column(escape(h))
        for r in t.rows:
            detail.add_row(*map(escape, r))
        console.print(detail)
    for note in suite.notes:
        console.print(f"[dim]- {escape(note)}[/]")
    console.print(f"[dim]reproduce: {escape(suite.command)}[/]")
