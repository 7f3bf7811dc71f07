"""The cross-host transfer suite's own parts: its measuring process's arguments, the bytes it
moves, the figure its samples become, and the TCP copy it is held to, on loopback."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from cmx.bench import SUITES
from cmx.bench.harness.core import BenchConfig, BenchContext, GiB, MiB, Verdict
from cmx.bench.suites.xhost.tcp_copy import TcpSource
from cmx.bench.suites.xhost.xhost import (
    SUITE,
    blocks_for,
    child_command,
    figure,
    rep_table,
    run_transfer_hosts,
)
from cmx.bench.suites.xhost.xhost_run import RunArgs, Samples, parse_args

SAMPLES = Samples(nbytes=8 * 32 * MiB, load=[0.27, 0.25, 0.28], tcp=[0.99, 1.20, 0.99],
                  via="nixl-ucx", hosts=["vm", "b"])


def test_the_suite_is_registered_beside_transfer() -> None:
    names = list(SUITES)
    assert SUITES[SUITE] == "cmx.bench.suites.xhost.xhost:run_transfer_hosts"
    assert names.index(SUITE) == names.index("transfer") + 1


def test_the_measuring_process_reads_blocks_reps_and_its_directory() -> None:
    args = parse_args(["--blocks", "8", "--reps", "3", "--dir", "/var/tmp/x"])
    assert args == RunArgs(blocks=8, reps=3, dir="/var/tmp/x")


@pytest.mark.parametrize("argv", [
    ["--blocks", "0", "--reps", "3", "--dir", "d"],
    ["--blocks", "8", "--reps", "0", "--dir", "d"],
    ["--blocks", "8", "--reps", "3"],
    ["--blocks", "eight", "--reps", "3", "--dir", "d"],
])
def test_the_measuring_process_refuses_what_it_cannot_run(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_the_command_runs_after_the_namespace_prefix_and_parses_back() -> None:
    cmd = child_command(["ip", "netns", "exec", "ns1"], blocks=8, reps=3, nvme_dir="/d")
    assert cmd[:4] == ["ip", "netns", "exec", "ns1"]
    assert cmd[5:7] == ["-m", "cmx.bench.suites.xhost.xhost_run"]
    assert parse_args(cmd[7:]) == RunArgs(8, 3, "/d")


def test_the_bytes_asked_for_become_whole_32_mib_blocks() -> None:
    assert blocks_for(GiB // 4) == 8
    assert blocks_for(GiB) == 32
    assert blocks_for(1) == 1  # never none
    assert blocks_for(int(1.5 * 32 * MiB) + 1) == 2
    with pytest.raises(ValueError):
        blocks_for(0)


def test_the_figure_is_the_load_against_tcp_with_the_interval_in_its_note() -> None:
    f = figure(SAMPLES)
    assert f.suite == SUITE and f.unit == "GB/s" and f.verdict is Verdict.INFO
    assert f.samples == (0.27, 0.25, 0.28) and f.baseline_samples == (0.99, 1.20, 0.99)
    assert f.ratio == pytest.approx(statistics.median(SAMPLES.load) / 0.99)
    assert "256 MiB" in f.name and "nixl-ucx" in f.name
    low, high = (float(x) for x in f.note.split("[")[1].split("]")[0].split(", "))
    assert low <= round(f.ratio, 3) <= high
    assert "3 alternated pairs" in f.note


def test_a_figure_needs_one_copy_per_load() -> None:
    with pytest.raises(ValueError):
        figure(Samples(SAMPLES.nbytes, [0.3, 0.3], [1.0], "nixl-ucx", ["a", "b"]))
    with pytest.raises(ValueError):
        figure(Samples(SAMPLES.nbytes, [], [], "nixl-ucx", ["a", "b"]))


def test_each_repetition_is_a_row_with_its_own_ratio() -> None:
    table = rep_table(SAMPLES)
    assert [row[0] for row in table.rows] == ["1", "2", "3"]
    assert [row[3] for row in table.rows] == ["0.27", "0.21", "0.28"]


def test_samples_travel_as_one_json_line() -> None:
    assert Samples.from_json(json.dumps(asdict(SAMPLES))) == SAMPLES


def test_without_hosts_the_suite_says_why_and_gives_no_figures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CMX_HOSTS", "0")
    ctx = BenchContext(BenchConfig(dir=tmp_path, reps=1, gib=0.25), tmp_path)
    result = run_transfer_hosts(ctx)
    assert result.figures == [] and result.error is None
    assert any("CMX_HOSTS=1" in note for note in result.notes)


def test_the_tcp_copy_brings_every_byte_in_order() -> None:
    source = TcpSource([], "127.0.0.1")
    try:
        into = np.zeros(3 * MiB + 5, np.uint8)
        for _ in range(2):  # one connection per copy
            into[:] = 0
            assert source.copy(into.data) > 0
            assert np.array_equal(into, np.arange(into.size) % 256)
    finally:
        source.close()
    assert source.process.poll() is not None
