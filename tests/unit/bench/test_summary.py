"""The summary at the top of BENCHMARKS.md is counted from the page's own suite sections, never
written by hand: a page that says "every goal passes but one" above fourteen MISS rows is a
defect the page itself can catch."""

from __future__ import annotations

from pathlib import Path

from cmx.bench.harness.core import Figure, Goal, SuiteResult
from cmx.bench.harness.report import DOCS_HEADER, BenchReport, update_docs
from cmx.bench.harness.summary import (
    SUMMARY_BEGIN,
    SUMMARY_END,
    SectionCount,
    count_sections,
    refresh_summary,
)

ROOT = Path(__file__).resolve().parents[3]
MACHINE = {"cpu": "Test CPU", "cores": 2, "memory_gib": 4.0, "disk": "vda", "filesystem": "ext4",
           "kernel": "6.0"}

PAGE = f"""# Benchmarks

Every goal passes but one.

{SUMMARY_BEGIN}
{SUMMARY_END}

<!-- cmx-bench:nvme:begin -->
### `nvme`

Run: 2026-11-29T15:48:46+00:00, 20 s, medians of 3 repetitions

| Figure | Median | Baseline (same run) | Ratio | Goal | Result |
| --- | --- | --- | --- | --- | --- |
| put | 1 GB/s | 2 GB/s (fio) | 0.50 | ≥ 0.8 | **MISS** |
| get | 2 GB/s | 2 GB/s (fio) | 1.00 | ≥ 0.8 | **PASS** |
| get one by one | 1 GB/s | 2 GB/s (fio) | 0.50 |  | — |
| cost | -1 ms | 9 ms (load) | -0.1 | ≤ 0.1 | **MISS** (inconclusive) |

Detail:

| op | size | count |
| --- | --- | --- |
| read | 1 MiB | 3 |
<!-- cmx-bench:nvme:end -->

Hand text with a table of its own, not counted:

| Figure | Result |
| --- | --- |
| pressure | **MISS** |

<!-- cmx-simulate:calibration:begin -->
### `simulate --calibrate`

Run: 2026-11-30T18:41:16+00:00 to 18:47:30

| source | error | result |
| --- | --- | --- |
| dram | -3.5% | **PASS** |
<!-- cmx-simulate:calibration:end -->

<!-- cmx-bench:dpu:begin -->
### `dpu`

| Figure | Median | Baseline (same run) | Ratio | Goal | Result |
| --- | --- | --- | --- | --- | --- |
| load | 1 GB/s | 1 GB/s | 1.00 |  | — |
<!-- cmx-bench:dpu:end -->
"""


def test_rows_are_counted_per_marked_section_by_their_result() -> None:
    assert count_sections(PAGE) == [
        SectionCount("`nvme`", "2026-11-29 15:48", "", passed=1, missed=1, inconclusive=1),
        SectionCount("`simulate --calibrate`", "2026-11-30 18:41", "", 1, 0, 0),
        SectionCount("`dpu`", "", "", 0, 0, 0),
    ]


def test_the_summary_is_rewritten_from_the_sections_and_nothing_else() -> None:
    text = refresh_summary(PAGE)
    block = text[text.index(SUMMARY_BEGIN):text.index(SUMMARY_END)]
    assert "4 figures judged against a goal, 2 PASS, 1 MISS, 1 inconclusive" in block
    assert "| `nvme` | 2026-11-29 15:48 | not stated | 1 | 1 | 1 |" in block
    assert "runs of different times or code" in block
    assert "`dpu` judge no figure" in block
    assert text.replace(block, "") == PAGE.replace(f"{SUMMARY_BEGIN}\n", "")
    assert refresh_summary(text) == text  # counting again changes nothing
    assert refresh_summary("no markers here") == "no markers here"


def test_a_run_rewrites_the_summary_with_its_section(tmp_path: Path) -> None:
    docs = tmp_path / "BENCHMARKS.md"
    miss = Figure("dram", "put", "GB/s", (1.0,) * 3, "memcpy", (2.0,) * 3, Goal(">=", 0.8))
    update_docs(docs, BenchReport(MACHINE, "2026-01-01T00:00:00+00:00", {"reps": 1},
                                  [SuiteResult("dram", "cmx bench dram", [miss])],
                                  code="abc1234"))
    text = docs.read_text()
    assert text.startswith(DOCS_HEADER.split(SUMMARY_BEGIN)[0])
    assert "1 figure judged against a goal, 0 PASS, 1 MISS, 0 inconclusive" in text
    assert "| `dram` | 2026-01-01 00:00 | abc1234 | 0 | 1 | 0 |" in text
    assert "Every section comes from one run, 2026-01-01 00:00, of code abc1234" in text


def _two_sections(tmp_path: Path, dram_code: str, nvme_code: str) -> str:
    """The page after two suites of one run, each naming the code it gives."""
    docs = tmp_path / "BENCHMARKS.md"
    miss = Figure("dram", "put", "GB/s", (1.0,) * 3, "memcpy", (2.0,) * 3, Goal(">=", 0.8))
    for suite, code in (("dram", dram_code), ("nvme", nvme_code)):
        update_docs(docs, BenchReport(MACHINE, "2026-01-01T00:00:00+00:00", {"reps": 3},
                                      [SuiteResult(suite, f"cmx bench {suite}", [miss])],
                                      code=code))
    return docs.read_text()


def test_sections_that_name_no_commit_are_not_called_one_run(tmp_path: Path) -> None:
    text = _two_sections(tmp_path, "not a git checkout", "not a git checkout")
    assert "| `nvme` | 2026-01-01 00:00 | not stated | 0 | 1 | 0 |" in text
    assert "Every section comes from one run" not in text


def test_sections_of_one_run_on_two_commits_are_not_called_one_run(tmp_path: Path) -> None:
    text = _two_sections(tmp_path, "abc1234", "abc1234 with uncommitted changes")
    assert "| `nvme` | 2026-01-01 00:00 | abc1234 with uncommitted changes | 0 | 1 | 0 |" in text
    assert "Every section comes from one run" not in text


def test_the_projects_page_carries_its_summary_as_counted() -> None:
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert SUMMARY_BEGIN in text and SUMMARY_END in text
    assert refresh_summary(text) == text, (
        "docs/BENCHMARKS.md's summary is stale: "
        "python -m cmx.bench.harness.summary docs/BENCHMARKS.md")
