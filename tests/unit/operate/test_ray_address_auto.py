"""The address "auto", as Ray reads it: RAY_ADDRESS unless that says "auto" too, else the head
Ray's current-cluster file names, which must answer (no Ray is started)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmx.config import AdminConfig, ServiceConfig
from cmx.deploy import launch
from cmx.operate.lifecycle import UpOptions, up
from cmx.operate.local_ray import HeadOptions
from cmx.operate.ray_cluster import ClusterUnreachableError, locate, resolve


@pytest.fixture()
def ray_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Ray's current-cluster file of a Ray temp dir of this test's own, not yet written."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    (tmp_path / "ray").mkdir()
    return tmp_path / "ray" / "ray_current_cluster"


@pytest.fixture()
def head() -> Iterator[str]:
    """An address where something accepts connections, as a running head's GCS does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


def stopped() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_ray_address_auto_reads_the_current_cluster_file(ray_file: Path, head: str) -> None:
    ray_file.write_text(head)
    assert resolve("auto") == head
    assert locate("auto") == head
    assert launch._cluster("auto", str(ray_file.parent), lambda _s: None) == (head, None)


def test_an_address_in_ray_address_wins_over_the_file(
    ray_file: Path, head: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray_file.write_text(stopped())
    monkeypatch.setenv("RAY_ADDRESS", head)
    assert locate("auto") == head


def test_auto_with_no_file_is_a_typed_error(ray_file: Path) -> None:
    with pytest.raises(ClusterUnreachableError, match="current-cluster file .* is absent"):
        resolve("auto")


@pytest.mark.parametrize("recorded", ["stopped", "not an address"])
def test_a_stale_file_is_a_typed_error_naming_it(ray_file: Path, recorded: str) -> None:
    ray_file.write_text(stopped() if recorded == "stopped" else recorded)
    with pytest.raises(ClusterUnreachableError, match="current-cluster file .* no Ray cluster"):
        locate("auto")


def test_cmx_up_on_a_stale_file_starts_nothing_and_records_nothing(
    ray_file: Path, tmp_path: Path
) -> None:
    ray_file.write_text(stopped())
    admin = AdminConfig(state_dir=str(tmp_path / "state"))
    opts = UpOptions(address="auto", head=HeadOptions(), admin=admin,
                     service=ServiceConfig(nvme_dir=str(tmp_path / "nvme")))
    with pytest.raises(ClusterUnreachableError, match="current-cluster file"):
        up(opts)
    assert not Path(admin.state_path).exists()
