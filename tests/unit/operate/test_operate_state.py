"""What `cmx up` records, the admin configuration, and the local head's command (no Ray)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cmx.config import AdminConfig
from cmx.operate.local_ray import HeadOptions, is_local, split_address, stop_head
from cmx.operate.state import ServiceState


def test_state_round_trips_owner_only_and_never_prints_the_token(tmp_path: Path) -> None:
    path = str(tmp_path / "deep" / "state.json")
    state = ServiceState(admin_url="http://127.0.0.1:1", token="secret-token-123456",
                         ray_address="127.0.0.1:2", started_ray=True, ray_pid=42)
    state.save(path)
    assert ServiceState.load(path) == state
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert "secret" not in repr(state) and "secret" not in str(state)
    assert ServiceState.clear(path) and not ServiceState.clear(path)
    assert ServiceState.load(path) is None


def test_a_damaged_state_file_reads_as_none(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("{not json")
    assert ServiceState.load(str(path)) is None
    path.write_text('{"admin_url": "x"}')
    assert ServiceState.load(str(path)) is None


def test_admin_config_reads_its_environment() -> None:
    env = {"CMX_ADMIN_TOKEN": "t" * 20, "CMX_ADMIN_TOKEN_ALL": "1", "CMX_ADMIN_PORT": "0",
           "CMX_STATE_DIR": "/srv/cmx", "CMX_ADMIN_SAMPLE_S": "0.5"}
    c = AdminConfig.from_env(env)
    assert (c.token, c.token_all, c.port, c.sample_s) == ("t" * 20, True, 0, 0.5)
    assert c.state_path == "/srv/cmx/state.json" and "t" * 20 not in repr(c)
    default = AdminConfig.from_env({})
    assert default.host == "127.0.0.1" and default.token is None and not default.token_all
    assert default.state_path.endswith(os.path.join(".cache", "cmx", "state.json"))
    with pytest.raises(ValueError, match="CMX_ADMIN_TOKEN_ALL"):
        AdminConfig.from_env({"CMX_ADMIN_TOKEN_ALL": "maybe"})
    with pytest.raises(ValueError, match="at least 16"):
        AdminConfig.from_env({"CMX_ADMIN_TOKEN": "short"})
    with pytest.raises(ValueError, match="port"):
        AdminConfig(port=70000)


def test_head_command_and_addresses() -> None:
    cmd = HeadOptions(port=7000, num_cpus=1, dashboard=False,
                      extra_args=("--ray-client-server-port=7001",)).command()
    assert cmd[1:5] == ["start", "--head", "--block", "--port"] and "7000" in cmd
    assert "--include-dashboard=false" in cmd and cmd[-1] == "--ray-client-server-port=7001"
    assert cmd[cmd.index("--dashboard-host") + 1] == "127.0.0.1"
    assert split_address("127.0.0.1:6379") == ("127.0.0.1", 6379)
    assert split_address("[::1]:6379") == ("::1", 6379)
    with pytest.raises(ValueError):
        split_address("nohost")
    assert is_local("localhost") and is_local("127.0.0.1")


def test_stop_head_leaves_a_process_that_is_not_a_ray_head_alone() -> None:
    assert stop_head(os.getpid())  # this pytest process: not `ray start --block`, untouched
