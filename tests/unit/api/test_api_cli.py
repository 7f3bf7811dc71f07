"""`cmx status | lookup | block | evict` against an admin API on loopback (fake service)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from api_fakes import NODE_A, NODE_B, TOKEN, FakeBackend, admin
from typer.testing import CliRunner

from cmx.api.app import create_app
from cmx.api.server import ServerThread
from cmx.cli import app
from cmx.keys import Namespace, chain_keys
from cmx.layout import KVLayout
from cmx.operate.state import ServiceState
from cmx.tiers import Tier

runner = CliRunner()


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeBackend]:
    backend = FakeBackend()
    server = ServerThread(create_app(lambda: backend, admin()), "127.0.0.1", 0).start()
    monkeypatch.setenv("CMX_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("CMX_ADMIN_TOKEN", raising=False)
    ServiceState(admin_url=server.url, token=TOKEN, ray_address="127.0.0.1:1",
                 started_ray=False).save(str(tmp_path / "state.json"))
    yield backend
    server.stop()


def test_status_json_lists_every_tier_of_every_node(served: FakeBackend) -> None:
    result = runner.invoke(app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    view = json.loads(result.output)
    assert {n["node"] for n in view["nodes"]} == {NODE_A, NODE_B}
    assert all([t["tier"] for t in n["tiers"]] == ["hbm", "dram", "nvme"] for n in view["nodes"])
    assert view["pool"]["enabled"] is False


def test_status_table_reads_at_a_glance(served: FakeBackend) -> None:
    served.put(b"k" * 32, NODE_A, Tier.DRAM)
    time.sleep(0.2)  # answers may come from a sample up to sample_s (0.05 s) old
    result = runner.invoke(app, ["status"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"node {NODE_A[:12]}" in out and "agent on host" in out and "nixl-ucx" in out
    for name in ("HBM G1*", "DRAM G2", "NVMe G3"):
        assert name in out
    assert "emulated on host memory" in out and "32 KiB / 512 KiB" in out


def test_lookup_from_a_file_and_evict_with_the_recorded_token(
    served: FakeBackend, tmp_path: Path
) -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16",
                      block_tokens=16)
    tokens = list(range(40))
    keys = chain_keys(Namespace("m", layout, "s").digest, tokens, 16)
    for key in keys:
        served.put(key, NODE_B, Tier.NVME)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(tokens))
    args = ["lookup", "--file", str(ids), "--model", "m", "--salt", "s", "--num-layers", "4",
            "--num-kv-heads", "2", "--head-dim", "64", "--dtype", "float16",
            "--block-tokens", "16"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert found["num_tokens"] == 32 and [b["key"] for b in found["blocks"]] == [
        k.hex() for k in keys]
    table = runner.invoke(app, args)
    assert "32 tokens cached (2 of 2 blocks)" in table.output

    block = runner.invoke(app, ["block", keys[0].hex(), "--json"])
    assert json.loads(block.output)["copies"][0]["tier"] == "nvme"

    evicted = runner.invoke(app, ["evict", keys[1].hex(), "--tier", "nvme", "--json"])
    assert evicted.exit_code == 0, evicted.output
    assert json.loads(evicted.output)["evicted"] == 1
    again = runner.invoke(app, [*args, "--json"])
    assert json.loads(again.output)["num_blocks"] == 1


def test_errors_are_short_and_exit_nonzero(served: FakeBackend, tmp_path: Path) -> None:
    bad = runner.invoke(app, ["block", "xyz"])
    assert bad.exit_code == 1 and "422" in bad.output
    missing = runner.invoke(app, ["block", "00" * 32])
    assert missing.exit_code == 1 and "404" in missing.output
    no_ids = runner.invoke(app, ["lookup", "--model", "m"])
    assert no_ids.exit_code == 2 and "no token ids" in no_ids.output
    wrong = runner.invoke(app, ["evict", "00" * 32], env={"CMX_ADMIN_TOKEN": "x" * 20})
    assert wrong.exit_code == 1 and "401" in wrong.output


def test_a_foreign_url_never_gets_the_recorded_token(
    served: FakeBackend, tmp_path: Path
) -> None:
    url = ServiceState.load(str(tmp_path / "state.json")).admin_url  # type: ignore[union-attr]
    other = url.replace("127.0.0.1", "localhost")
    result = runner.invoke(app, ["evict", "00" * 32, "--url", other])
    assert result.exit_code == 1 and "401" in result.output


def test_commands_without_a_recorded_service_say_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CMX_STATE_DIR", str(tmp_path / "none"))
    result = runner.invoke(app, ["status"])
    assert result.exit_code == 2 and "cmx up" in result.output
    down = runner.invoke(app, ["down"])
    assert down.exit_code == 0 and "nothing recorded" in down.output
