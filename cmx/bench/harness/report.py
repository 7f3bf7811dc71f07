"""Benchmark reports: JSON, a markdown table, PNG plots, and the suites' sections of BENCHMARKS.md.

``docs/BENCHMARKS.md`` is updated in place: each suite owns the text between its two markers
(``<!-- cmx-bench:NAME:begin -->`` / ``:end``), so running one suite rewrites only its section
and everything written by hand around the markers stays. The summary between the page's
``cmx-bench-summary`` markers is then counted again from every section (``summary``).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cmx.bench.harness.core import Figure, SuiteResult, Verdict
from cmx.bench.harness.machine import machine_line
from cmx.bench.harness.summary import INCONCLUSIVE, SUMMARY_BEGIN, SUMMARY_END, refresh_summary

__all__ = [
    "BenchReport",
    "Written",
    "figure_rows",
    "render_markdown",
    "update_docs",
    "write_outputs",
    "write_plots",
]

PLOT_HINT = "plots skipped: matplotlib is not installed (pip install 'cmx-ray[bench]')"
# A page started by ``cmx bench`` itself; the project's docs/BENCHMARKS.md adds the goals.
DOCS_HEADER = f"""# Benchmarks

Written by `cmx bench`: each suite's section holds its latest figures, every one a ratio to a
baseline measured in the same run. Text outside the `cmx-bench` markers is kept.

{SUMMARY_BEGIN}
{SUMMARY_END}
"""


@dataclass
class BenchReport:
    machine: dict[str, object]
    started: str  # ISO time the run started
    config: dict[str, object]
    suites: list[SuiteResult] = field(default_factory=list)
    code: str = ""  # the commit that ran (``machine.code_version``)

    @property
    def figures(self) -> list[Figure]:
        return [f for s in self.suites for f in s.figures]

    def to_dict(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "started": self.started,
            "code": self.code,
            "config": self.config,
            "suites": [s.to_dict() for s in self.suites],
        }


def _num(x: float) -> str:
    if math.isnan(x):
        return "n/a"
    if x == 0 or abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 0.1:
        return f"{x:.2f}"
    return f"{x:.3g}"


FIGURE_HEADERS = ("Figure", "Median", "Baseline (same run)", "Ratio", "Goal", "Result")


def figure_rows(figures: Sequence[Figure]) -> list[tuple[str, ...]]:
    """One row per figure, in FIGURE_HEADERS order."""
    rows: list[tuple[str, ...]] = []
    for f in figures:
        verdict = "—" if f.verdict is Verdict.INFO else f"**{f.verdict.value}**"
        if f.goal is not None and f.inconclusive is not None:
            verdict += f" ({INCONCLUSIVE})"
        rows.append((
            f.name,
            f"{_num(f.value)} {f.unit}",
            f"{_num(f.baseline)} {f.unit} ({f.baseline_name})",
            _num(f.ratio),
            str(f.goal) if f.goal else "",
            verdict,
        ))
    return rows


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers)), *map(line, rows)])


def _suite_markdown(suite: SuiteResult, report: BenchReport, level: str = "###") -> str:
    parts = [
        f"{level} `{suite.name}`",
        "",
        f"Command: `{suite.command}`  ",
        f"Machine: {machine_line(report.machine)}  ",
        f"Run: {report.started}, {suite.seconds:.0f} s, medians of {report.config['reps']} "
        f"repetitions, code {report.code or 'not stated'}",
        *(["", f"**The suite failed:** {suite.error}"] if suite.error else []),
        "",
        _md_table(FIGURE_HEADERS, figure_rows(suite.figures)),
    ]
    notes: dict[str, list[str]] = {}  # note -> the figures it explains
    for f in suite.figures:
        if f.note:
            notes.setdefault(f.note, []).append(f.name)
        if f.interval is not None:
            notes.setdefault(f"ratio {f.interval}, bootstrap over {len(f.samples)} pairs",
                             []).append(f.name)
        elif f.judged_interval is not None:
            notes.setdefault(f"ratio {f.judged_interval}, bootstrap over {len(f.samples)} and "
                             f"{len(f.baseline_samples)} repetitions, each side resampled on "
                             "its own", []).append(f.name)
        if f.goal is not None and f.inconclusive is not None:
            notes.setdefault(f"{INCONCLUSIVE}, not judged: {f.inconclusive}", []).append(f.name)
    for table in suite.tables:
        parts += ["", f"{table.title}:", "", _md_table(table.headers, table.rows)]
    lines = [*suite.notes, *(f"{'; '.join(names)}: {note}" for note, names in notes.items())]
    if lines:
        parts += ["", *[f"- {line}" for line in lines]]
    return "\n".join(parts)


def render_markdown(report: BenchReport) -> str:
    """The whole run as markdown: machine, then each suite's table, details and notes."""
    parts = [
        "# cmx bench results",
        "",
        f"Machine: {machine_line(report.machine)}",
        f"Started: {report.started}",
    ]
    for suite in report.suites:
        parts += ["", _suite_markdown(suite, report, level="##")]
    return "\n".join(parts) + "\n"


def update_docs(path: Path, report: BenchReport, plots: Sequence[Path] = ()) -> None:
    """Rewrite each run suite's marked section of ``path``; add sections and the file as needed.

    A suite's plot among ``plots`` is copied next to the page, into ``bench/``, and shown in
    its section.
    """
    text = path.read_text() if path.exists() else DOCS_HEADER
    shown = {p.stem: p for p in plots}
    for suite in report.suites:
        if suite.error:
            continue  # the page keeps the suite's last figures, with their own date
        begin = f"<!-- cmx-bench:{suite.name}:begin -->"
        end = f"<!-- cmx-bench:{suite.name}:end -->"
        section = _suite_markdown(suite, report)
        if suite.name in shown:
            copy = path.parent / "bench" / f"{suite.name}.png"
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shown[suite.name], copy)
            section += f"\n\n![cmx bench {suite.name}: ratios and goals](bench/{suite.name}.png)"
        block = f"{begin}\n{section}\n{end}"
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
        found = pattern.search(text)
        if found:
            text = text[: found.start()] + block + text[found.end():]
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(refresh_summary(text))


def write_plots(out: Path, report: BenchReport) -> list[Path] | str:
    """One PNG per suite: each figure's ratio a bar, its goal a tick; a hint without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return PLOT_HINT
    colors = {Verdict.PASS: "#2a9d4b", Verdict.MISS: "#d1495b", Verdict.INFO: "#8d99ae"}
    paths = []
    for suite in report.suites:
        if not suite.figures:
            continue
        figs = suite.figures
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(figs) + 1.4))
        y = range(len(figs))
        ax.barh(y, [f.ratio for f in figs], color=[colors[f.verdict] for f in figs])
        for i, f in enumerate(figs):
            if f.goal:
                ax.plot([f.goal.target] * 2, [i - 0.4, i + 0.4], color="black", lw=2)
        ax.set_yticks(list(y), [f.name for f in figs], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ratio to the baseline measured in the same run (black tick: goal)")
        ax.set_title(f"cmx bench {suite.name}")
        fig.tight_layout()
        path = out / f"{suite.name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


@dataclass(frozen=True)
class Written:
    """Where ``write_outputs`` put the report."""

    json: Path
    markdown: Path
    plots: list[Path]
    plot_note: str | None  # why there are no plots, if there are none
    docs: Path | None

    def describe(self) -> str:
        paths = [self.json, self.markdown, *self.plots, *([self.docs] if self.docs else [])]
        return ", ".join(map(str, paths)) + (f" ({self.plot_note})" if self.plot_note else "")


def write_outputs(report: BenchReport, out: Path, json_out: Path | None,
                  docs: Path | None) -> Written:
    """Write JSON, markdown and plots into ``out``, and the docs page if given."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = json_out or out / "results.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    md_path = out / "results.md"
    md_path.write_text(render_markdown(report))
    plots = write_plots(out, report)
    if docs is not None:
        update_docs(docs, report, [] if isinstance(plots, str) else plots)
    if isinstance(plots, str):
        return Written(json_path, md_path, [], plots, docs)
    return Written(json_path, md_path, plots, None, docs)
