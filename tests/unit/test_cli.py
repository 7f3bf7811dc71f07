"""The ``cmx`` command line: the storage demo end to end (small), and bench's argument checks."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from cmx.cli import app

runner = CliRunner()


def test_demo_stores_loads_and_verifies_a_small_prefix(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    result = runner.invoke(app, ["demo-storage", "--tokens", "2048", "--dir", str(workdir)])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())  # undo the console's line wrapping
    assert "loaded 8/8 blocks, 8 byte-identical" in out
    assert "8/8 blocks found, first and last read back identical" in out
    assert "DRAM G2" in out and "NVMe G3" in out
    assert not workdir.exists()  # the demo made it, so the demo removed it


def test_demo_keeps_its_store_when_asked_and_refuses_to_overwrite_it(tmp_path: Path) -> None:
    args = ["demo-storage", "--tokens", "256", "--dram-mib", "32", "--dir", str(tmp_path), "--keep"]
    assert runner.invoke(app, args).exit_code == 0
    assert any((tmp_path / "cmx-demo-nvme").iterdir())
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "exists" in again.output


def test_demo_needs_a_full_block(tmp_path: Path) -> None:
    result = runner.invoke(app, ["demo-storage", "--tokens", "100", "--dir", str(tmp_path)])
    assert result.exit_code == 2 and "at least one block" in result.output


def test_bench_rejects_unknown_suites_before_touching_the_disk(tmp_path: Path) -> None:
    result = runner.invoke(app, ["bench", "warp", "--dir", str(tmp_path / "b")])
    assert result.exit_code == 2
    assert "limits, nvme, dram, slices" in " ".join(result.output.split())
    assert not (tmp_path / "b").exists()


def test_demo_and_serve_are_commands_and_serve_rejects_an_unknown_policy() -> None:
    assert "two vLLM replicas" in " ".join(runner.invoke(app, ["demo", "--help"]).output.split())
    result = runner.invoke(app, ["serve", "--prefetch", "eager"])
    assert result.exit_code == 2 and "best_effort" in result.output
