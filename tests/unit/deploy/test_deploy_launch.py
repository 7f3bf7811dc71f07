"""``cmx serve``'s state file, beside ``cmx up``'s, and a stop with nothing started."""

from __future__ import annotations

from pathlib import Path

import pytest

from cmx.deploy import launch


def test_state_round_trips_next_to_cmx_ups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CMX_STATE_DIR", str(tmp_path))
    path = launch.serve_state_path()
    assert path == str(tmp_path / "serve.json")
    state = launch.ServeState("http://127.0.0.1:8000/v1", "cmx-llm", "127.0.0.1:6379", True, 42,
                              True, True, 2, "cmx-llama-random", 1.0)
    state.save(path)
    assert launch.ServeState.load(path) == state
    (tmp_path / "serve.json").write_text("{not json")
    assert launch.ServeState.load(path) is None


def test_stop_without_state_does_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CMX_STATE_DIR", str(tmp_path))
    result = launch.stop()
    assert not result.had_state and not result.ray_stopped


def test_blocks_fit_the_service_slots() -> None:
    from cmx.config import ServiceConfig
    from cmx.deploy.config import ModelOptions, ServeOptions

    options = ServeOptions(model=ModelOptions(), service=ServiceConfig(block_bytes=1 << 20))
    config, fresh = launch._fit(options, joining=False)
    assert config.block_bytes == 256 * 6 * 1024  # its own service: slots of the model's block
    config, joined = launch._fit(options, joining=True)
    assert config.block_bytes == 1 << 20
    assert joined.engine.block_tokens == 128 and joined.engine.chunk_tokens == 256
    tiny = options.replace(service=ServiceConfig(block_bytes=64 << 10))
    with pytest.raises(launch.CmxError, match="CMX_BLOCK_BYTES"):
        launch._fit(tiny, joining=True)
