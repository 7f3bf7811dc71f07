"""The address "auto", as Ray reads it: RAY_ADDRESS unless that says "auto" too, else the head
Ray's current-cluster file names, which must answer (no Ray is started)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmx.config import AdminConfig, ServiceConfig
from cmx.deploy import launch
from cmx.operate.lifecycle import UpOptions, up
from cmx.operate.local_ray import HeadOptions
from cmx.operate.ray_cluster import (
    ClusterUnreachableError,
    current_cluster,
    forget_head,
    locate,
    resolve,
)


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


def _someone_elses(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``path`` as another user's file: chowned where this is root, else this process seen as
    another user."""
    if os.geteuid() == 0:
        os.chown(path, 54321, -1)
    else:
        other = os.geteuid() + 1
        monkeypatch.setattr(os, "geteuid", lambda: other)


@pytest.mark.parametrize("how", ["another user's", "writable by all", "a symlink"])
def test_a_file_another_user_could_have_written_is_not_followed(
    ray_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Ray's temp folder is writable by every user (``/tmp/ray`` is 0777): the file there may
    name a cluster of someone else's, which would be sent this process's blocks. Nor is the
    file this user's to remove."""
    address = stopped()
    if how == "a symlink":
        real = tmp_path / "elsewhere"
        real.write_text(address)
        ray_file.symlink_to(real)
    else:
        ray_file.write_text(address)
        if how == "writable by all":
            os.chmod(ray_file, 0o666)
        else:
            _someone_elses(ray_file, monkeypatch)
    with pytest.raises(ClusterUnreachableError, match="current-cluster file .* refusing"):
        locate("auto")
    assert not forget_head(address)
    assert os.path.lexists(ray_file)


def test_the_users_own_file_is_followed(ray_file: Path, head: str) -> None:
    ray_file.write_text(head)
    os.chmod(ray_file, 0o644)  # as ``ray start`` writes it under the usual umask
    assert current_cluster() == head == locate("auto")
