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
                              True, True, 2, "SmolLM2-135M-Instruct", 1.0)
    state.save(path)
    assert launch.ServeState.load(path) == state
    (tmp_path / "serve.json").write_text("{not json")
    assert launch.ServeState.load(path) is None


def test_stop_without_state_does_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CMX_STATE_DIR", str(tmp_path))
    result = launch.stop()
    assert not result.had_state and not result.ray_stopped


def _model_dir(tmp_path: Path) -> str:
    """A model directory with a config alone: 30 layers, 3 KV heads of 64 (SmolLM2's shape)."""
    import json

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
              "num_hidden_layers": 30, "intermediate_size": 1536, "vocab_size": 49152}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_service_started_for_the_model_gets_slots_of_one_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cmx.config import ServiceConfig
    from cmx.deploy.config import EngineOptions, ModelOptions, ServeOptions
    from cmx.deploy.model import model_info
    from cmx.deploy.service import service_config

    monkeypatch.delenv("CMX_BLOCK_BYTES", raising=False)
    options = ServeOptions(model=ModelOptions(path=_model_dir(tmp_path)),
                           engine=EngineOptions(block_size=64))
    model = model_info(options.model, options.engine)
    assert model.layout.block_bytes == 30 * 2 * 3 * 64 * 64 * 2  # bf16, 64-token blocks
    assert service_config(options, model).block_bytes == model.layout.block_bytes
    monkeypatch.setenv("CMX_BLOCK_BYTES", str(4 << 20))  # the operator's choice stands
    assert service_config(options, model).block_bytes == 4 << 20
    explicit = options.replace(service=ServiceConfig(block_bytes=1 << 20))
    assert service_config(explicit, model).block_bytes == 1 << 20
    config, fitted = launch._fit(options, joining=False)
    assert config.block_bytes == 4 << 20 and fitted.service == config


def test_slots_too_small_for_a_block_fail_startup_with_the_number_to_set(
    tmp_path: Path,
) -> None:
    from cmx.deploy.config import EngineOptions, ModelOptions
    from cmx.deploy.model import model_info
    from cmx.deploy.service import check_slots

    model = model_info(ModelOptions(path=_model_dir(tmp_path)), EngineOptions(block_size=128))
    check_slots(model.layout.block_bytes, model)  # exactly one block: fine
    with pytest.raises(launch.CmxError) as err:
        check_slots(2 << 20, model)  # the service's default 2 MiB
    text = str(err.value)
    assert f"CMX_BLOCK_BYTES={model.layout.block_bytes}" in text
    assert "engine.block_size <= 64" in text  # 2 MiB / 23,040 bytes a token = 91 -> 64
