"""``cmx serve --stop`` unlinks the shared memory that stopped engines of ours left in /dev/shm
(``EngineSegments``' records beside the CLI's state), and only that. No Ray runs here: with no
application recorded, the stop has nothing else to do."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cmx.deploy.cli import app as deploy_cli


def gone_process() -> tuple[int, int]:
    """The pid and start time of a process that has exited."""
    proc = subprocess.Popen(["sleep", "60"])
    stat = Path(f"/proc/{proc.pid}/stat").read_text()
    start = int(stat.rsplit(")", 1)[1].split()[19])
    proc.kill()
    proc.wait(timeout=30)
    return proc.pid, start


@pytest.fixture
def left_behind() -> Iterator[tuple[Path, Path]]:
    """A segment a stopped engine left, and one nobody recorded (both 4 KiB, in /dev/shm)."""
    tag = uuid.uuid4().hex[:8]
    paths = (Path(f"/dev/shm/psm_test{tag}"), Path(f"/dev/shm/psm_other{tag}"))
    for path in paths:
        path.write_bytes(b"\0" * 4096)
    yield paths
    for path in paths:
        path.unlink(missing_ok=True)


def test_serve_stop_unlinks_what_stopped_engines_left(
    left_behind: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    left, unrecorded = left_behind
    state = tmp_path / "state"
    records = state / "engine-shm"
    records.mkdir(parents=True)
    pid, start = gone_process()
    (records / f"{pid}-{start}.json").write_text(
        json.dumps({"processes": [[pid, start]], "segments": [left.name]}))
    monkeypatch.setenv("CMX_STATE_DIR", str(state))

    result = CliRunner().invoke(deploy_cli, ["serve", "--stop"])
    assert result.exit_code == 0, result.output
    assert "unlinked 1 shared-memory segment(s)" in " ".join(result.output.split())
    assert not left.exists() and unrecorded.exists()
    assert os.listdir(records) == []
