"""Ray's current-cluster file and addresses, as the lifecycle reads and forgets them (no Ray)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmx.operate.local_ray import is_local, split_address
from cmx.operate.ray_cluster import (
    ClusterUnreachableError,
    current_cluster,
    forget_head,
    resolve,
    start_own,
    wait_for_gcs,
)


@pytest.fixture(autouse=True)
def own_log_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warnings these tests provoke stay off the root logger: an earlier test in this
    process may have left Ray's logging filter on its handlers, which reads the runtime
    context the tests replace."""
    for module in ("cmx.operate.ray_cluster", "cmx.operate.local_ray"):
        monkeypatch.setattr(logging.getLogger(module), "propagate", False)


@pytest.fixture()
def ray_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "ray").mkdir()
    return tmp_path / "ray" / "ray_current_cluster"


@pytest.fixture()
def listening() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_stopped_head_is_forgotten_under_any_local_name(ray_tmp: Path) -> None:
    port = dead_port()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.254", 9))  # no packet is sent: the interface Ray records is chosen
        own_ip = s.getsockname()[0]
    ray_tmp.write_text(f"{own_ip}:{port}")
    assert current_cluster() == f"{own_ip}:{port}"
    assert forget_head(f"127.0.0.1:{port}")
    assert not ray_tmp.exists() and current_cluster() is None
    assert not forget_head(f"127.0.0.1:{port}")  # nothing left to forget


def test_another_clusters_entry_and_a_live_head_are_left_alone(
    ray_tmp: Path, listening: int
) -> None:
    ray_tmp.write_text(f"127.0.0.1:{dead_port()}")
    assert not forget_head(f"127.0.0.1:{listening}")  # another port: not ours
    ray_tmp.write_text(f"127.0.0.1:{listening}")
    assert not forget_head(f"127.0.0.1:{listening}")  # still answers: not stopped
    assert ray_tmp.read_text() == f"127.0.0.1:{listening}"


def test_auto_resolves_from_the_environment_then_the_file(
    ray_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ClusterUnreachableError, match="auto"):
        resolve("auto")
    ray_tmp.write_text("10.0.0.5:6379")
    assert resolve("auto") == "10.0.0.5:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.6:6380")
    assert resolve("auto") == "10.0.0.6:6380"
    assert resolve("h:1") == "h:1"


def test_waiting_for_a_dead_address_ends_in_a_typed_error(listening: int) -> None:
    wait_for_gcs(f"127.0.0.1:{listening}", timeout_s=1.0)
    with pytest.raises(ClusterUnreachableError, match="no Ray cluster answers"):
        wait_for_gcs(f"127.0.0.1:{dead_port()}", timeout_s=0.5)


def test_addresses_split_and_local_hosts() -> None:
    assert split_address("ray://10.1.2.3:10001") == ("10.1.2.3", 10001)
    assert split_address("[::1]:6379") == ("::1", 6379)
    with pytest.raises(ValueError):
        split_address("no-port")
    assert is_local("127.0.0.1") and is_local(socket.gethostname())
    assert not is_local("192.0.2.254")  # TEST-NET: no interface here has it


def test_an_embedded_start_that_misses_the_raylet_deadline_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    calls: list[str] = []

    def init(address: str, **_: object) -> None:
        calls.append(address)
        if calls.count("local") < 3:
            raise Exception("The current node timed out during startup. This could happen ...")

    class Context:
        gcs_address = "127.0.0.1:6380"

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    assert start_own() == "127.0.0.1:6380"
    assert calls == ["local", "shutdown", "local", "shutdown", "local"]
    calls.clear()
    with pytest.raises(Exception, match="timed out during startup"):
        start_own(attempts=2)
    assert calls == ["local", "shutdown", "local"]


def test_an_embedded_start_that_fails_otherwise_is_not_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    calls: list[str] = []

    def init(address: str, **_: object) -> None:
        calls.append(address)
        raise ValueError("bad argument")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ValueError, match="bad argument"):
        start_own()
    assert calls == ["local"]


def test_a_head_start_that_misses_the_raylet_deadline_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cmx.operate import local_ray

    tries: list[int] = []

    def once(*_: object) -> int:
        tries.append(1)
        if len(tries) < 3:
            raise local_ray.HeadError("`ray start` exited with 1:\nException: The current node "
                                      "timed out during startup.")
        return 4242

    monkeypatch.setattr(local_ray, "_start_head_once", once)
    opts = local_ray.HeadOptions(port=1)
    assert local_ray.start_head(opts, str(tmp_path / "head.log")) == 4242 and len(tries) == 3
    tries.clear()
    with pytest.raises(local_ray.HeadError, match="timed out"):
        local_ray.start_head(opts, str(tmp_path / "head.log"), attempts=2)
    assert len(tries) == 2
