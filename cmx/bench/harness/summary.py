"""The summary at the top of BENCHMARKS.md, counted from the page's own suite sections.

Each section that a tool writes between ``<!-- cmx-TOOL:NAME:begin -->`` and ``:end`` markers
(``cmx bench``'s suites, ``cmx simulate --calibrate``) holds tables whose last column is the
result of a goal. The summary counts those cells per section, PASS, MISS and inconclusive (a
MISS on a figure that could not be judged, ``Figure.inconclusive``), and names each section's
run, so that no sentence about how many goals pass is written by hand. It lives between
``SUMMARY_BEGIN`` and ``SUMMARY_END``; ``update_docs`` rewrites it after every run, and

    python -m cmx.bench.harness.summary docs/BENCHMARKS.md

rewrites it from the sections already on the page.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SUMMARY_BEGIN", "SUMMARY_END", "SectionCount", "count_sections", "refresh_summary",
           "render_summary"]

SUMMARY_BEGIN = "<!-- cmx-bench-summary:begin -->"
SUMMARY_END = "<!-- cmx-bench-summary:end -->"
INCONCLUSIVE = "inconclusive"  # the Result cell of a MISS that could not be judged says so

_SECTION = re.compile(r"<!-- (cmx-[\w-]+):([\w-]+):begin -->\n(.*?)<!-- \1:\2:end -->", re.S)
_HEADING = re.compile(r"^#+ (.+)$", re.M)
_RUN = re.compile(r"^Run: (\d{4}-\d\d-\d\d)T(\d\d:\d\d).*?(?:, code ([^\n]+))?$", re.M)


@dataclass(frozen=True)
class SectionCount:
    """One marked section's judged rows."""

    title: str  # the section's heading, e.g. "`nvme`"
    run: str  # when its run started, "2026-11-29 15:48", or "" if the section does not say
    code: str  # the commit it ran, as its Run line names it, or "" if it does not
    passed: int
    missed: int
    inconclusive: int

    @property
    def judged(self) -> int:
        return self.passed + self.missed + self.inconclusive


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _results(section: str) -> list[str]:
    """The last cell of every row of every table whose last header is "Result"."""
    found: list[str] = []
    lines = section.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|") or i + 1 >= len(lines) or "---" not in lines[i + 1]:
            continue
        if (i > 0 and lines[i - 1].startswith("|")) or _cells(line)[-1].lower() != "result":
            continue
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            found.append(_cells(row)[-1])
    return found


def _verdict(cell: str) -> str | None:
    """"PASS", "MISS", INCONCLUSIVE, or None for a row with no goal."""
    if INCONCLUSIVE in cell.lower():
        return INCONCLUSIVE
    for word in ("PASS", "MISS"):
        if f"**{word}**" in cell:
            return word
    return None


def _commit(named: str | None) -> str:
    """The commit a Run line names; "" where it names none ("not stated", "not a git
    checkout"): two such sections are not known to share a commit."""
    named = (named or "").strip()
    return "" if not named or named.startswith("not ") else named


def count_sections(text: str) -> list[SectionCount]:
    """Every marked section of ``text``, in page order, with its rows counted by result."""
    counts = []
    for match in _SECTION.finditer(text):
        body = match.group(3)
        heading = _HEADING.search(body)
        run = _RUN.search(body)
        got = [_verdict(c) for c in _results(body)]
        counts.append(SectionCount(
            title=heading.group(1).strip() if heading else f"`{match.group(2)}`",
            run=f"{run.group(1)} {run.group(2)}" if run else "",
            code=_commit(run.group(3) if run else None),
            passed=got.count("PASS"), missed=got.count("MISS"),
            inconclusive=got.count(INCONCLUSIVE)))
    return counts


def _provenance(counts: list[SectionCount]) -> str:
    """Whether the sections come from one run of one commit, or which they come from."""
    runs = {c.run for c in counts}
    codes = {c.code for c in counts}
    if len(runs) == 1 and "" not in runs and len(codes) == 1 and "" not in codes:
        return f"Every section comes from one run, {counts[0].run}, of code {counts[0].code}"
    return ("The sections come from runs of different times or code, each named in its row "
            "(\"not stated\": a section written before runs named their code)")


def render_summary(counts: list[SectionCount]) -> str:
    """The summary block, markers included."""
    judged = [c for c in counts if c.judged]
    passed, missed, unjudged = (sum(getattr(c, k) for c in counts)
                                for k in ("passed", "missed", "inconclusive"))
    n = passed + missed + unjudged
    silent = [c.title for c in counts if not c.judged]
    lines = [
        SUMMARY_BEGIN,
        f"Counted from the tables of the {len(counts)} suite sections below by "
        f"`cmx.bench.harness.summary`, rewritten with them: {n} "
        f"figure{'' if n == 1 else 's'} judged against a goal, {passed} PASS, {missed} MISS, "
        f"{unjudged} {INCONCLUSIVE} (a MISS on a figure that could not be judged). "
        + _provenance(counts)
        + (f"; {', '.join(silent)} judge no figure." if silent else "."),
        "",
        "| Section | Run (UTC) | Code | PASS | MISS | inconclusive |",
        "| --- | --- | --- | --- | --- | --- |",
        *(f"| {c.title} | {c.run or 'not stated'} | {c.code or 'not stated'} | {c.passed} | "
          f"{c.missed} | {c.inconclusive} |" for c in judged),
        SUMMARY_END,
    ]
    return "\n".join(lines)


def refresh_summary(text: str) -> str:
    """``text`` with its summary block rewritten from its sections; unchanged without one."""
    begin, end = text.find(SUMMARY_BEGIN), text.find(SUMMARY_END)
    if begin < 0 or end < begin:
        return text
    block = render_summary(count_sections(text))
    return text[:begin] + block + text[end + len(SUMMARY_END):]


def main(argv: list[str]) -> int:
    path = Path(argv[1] if len(argv) > 1 else "docs/BENCHMARKS.md")
    text = path.read_text()
    if SUMMARY_BEGIN not in text:
        print(f"{path} has no {SUMMARY_BEGIN} marker", file=sys.stderr)
        return 1
    path.write_text(refresh_summary(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
