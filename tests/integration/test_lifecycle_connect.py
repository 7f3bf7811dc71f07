"""Joining and starting Ray as a user does, on a machine where a Ray token exists.

`cmx up` starts a head (token authentication on, as `ray start` decides); a client in another
process joins it by address with no extra setting and leaves the service running; an embedded
client starts a cluster of its own beside it; after `cmx down` Ray's current-cluster file no
longer names the dead head and an embedded client starts at once; a dead address is a typed
error within its bound, never a hang.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from lifecycle_support import client_code, free_port, new_machine

from cmx.operate.local_ray import port_open


@pytest.mark.timeout(900)
def test_join_by_address_embedded_beside_and_after_down_with_a_token(tmp_path: Path) -> None:
    m = new_machine(tmp_path)
    gcs, api, client_port = free_port(), free_port(), free_port()
    address = f"127.0.0.1:{gcs}"
    m.env["RAY_ADDRESS"] = address  # what `cmx up` uses; clients below run without it
    try:
        up = m.cmx("up", "--num-cpus", "1", "--port", str(api), "--no-dashboard",
                   f"--ray-arg=--ray-client-server-port={client_port}", "--json")
        assert up["started_ray"] is True
        assert m.current_cluster_file.read_text().strip().endswith(f":{gcs}")

        joined = m.python(client_code(address), RAY_ADDRESS="")
        assert (joined["stored"], joined["found"]) == (4, 64)
        assert joined["gcs"].endswith(f":{gcs}")
        assert m.cmx("status", "--json")["nodes"], "a client that joined stopped the service"

        # Ray's current-cluster file names the live head; an embedded client still starts a
        # cluster of its own, and stopping it leaves the service it did not start alone.
        own = m.python(client_code(None), RAY_ADDRESS="")
        assert (own["stored"], own["found"]) == (4, 64)
        assert not own["gcs"].endswith(f":{gcs}") and own["ray_after"] is False
        view = m.cmx("status", "--json")
        assert view["nodes"], "an embedded client stopped the service"
        nvme = view["nodes"][0]["tiers"][2]
        assert nvme["tier"] == "nvme" and nvme["extra"]["store_id"]

        # The embedded cluster's store, and one of the old layout (named by a Ray node id),
        # are claimed by no running node: orphans.
        old = tmp_path / "nvme" / "0123456789abcdef"
        old.mkdir()
        listed = {o["name"] for dirs in m.cmx("orphans", "--json").values() for o in dirs}
        live = f"node-{nvme['extra']['store_id']}"
        assert old.name in listed and len(listed) == 2 and live not in listed
        collected = m.cmx("orphans", "--collect", "--json")
        assert {o["name"] for dirs in collected.values() for o in dirs} == listed
        assert {p.name for p in (tmp_path / "nvme").iterdir()} == {live, f"{live}.claim"}
    finally:
        down = m.cmx("down", "--json")
    assert down["ray_stopped"] is True and not port_open("127.0.0.1", gcs)
    assert not m.current_cluster_file.exists(), "a stopped head is still Ray's current cluster"

    again = m.python(client_code(None), timeout_s=180, RAY_ADDRESS="")
    assert (again["stored"], again["found"]) == (4, 64)
    shutil.rmtree(m.ray_tmp, ignore_errors=True)


@pytest.mark.timeout(300)
def test_connect_to_a_dead_address_is_a_typed_error_within_its_bound(tmp_path: Path) -> None:
    m = new_machine(tmp_path, with_token=False)
    dead = f"127.0.0.1:{free_port()}"
    result = m.python(f"""
import json
from cmx import ContextMemory
from cmx.errors import UnavailableError
try:
    ContextMemory.connect(address={dead!r})  # the default bound
    print(json.dumps({{"error": None}}))
except UnavailableError as exc:
    print(json.dumps({{"error": type(exc).__name__, "message": str(exc)}}))
""", timeout_s=150)
    assert result["error"] == "ClusterUnreachableError"
    assert dead in result["message"]
    shutil.rmtree(m.ray_tmp, ignore_errors=True)
