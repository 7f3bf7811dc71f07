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


@pytest.fixture
def nothing_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``cmx serve``'s first steps that start something (a Ray head, the service, Serve's
    proxy), each recorded and refused; the state directory is the test's own."""
    started: list[str] = []

    def cluster(*_args: object) -> tuple[str, None]:
        started.append("cluster")
        raise AssertionError("a cluster was looked for with a setting unchecked")

    def deploy(*_args: object) -> object:
        started.append("deploy")
        raise AssertionError("Serve was started with a setting unchecked")

    monkeypatch.setattr(launch, "_cluster", cluster)
    monkeypatch.setattr(launch, "_deploy", deploy)
    monkeypatch.setenv("CMX_STATE_DIR", str(tmp_path / "state"))
    for var in ("CMX_API_KEY_FILE", "CMX_API_ANONYMOUS", "CMX_BLOCK_BYTES"):
        monkeypatch.delenv(var, raising=False)
    return started


def serve(tmp_path: Path, env: dict[str, str], *args: str) -> object:
    from typer.testing import CliRunner

    from cmx.cli import app

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    return CliRunner().invoke(app, ["serve", "--model", _model_dir(model), "--port", "18999",
                                    *args], env=env)


def assert_refused(result: object, *words: str) -> None:
    """Exit 2 with one ``error:`` line naming ``words``, and no traceback."""
    output = result.output  # type: ignore[attr-defined]
    assert result.exit_code == 2, output  # type: ignore[attr-defined]
    assert isinstance(result.exception, SystemExit), result.exception  # type: ignore[attr-defined]
    assert output.count("error:") == 1 and "Traceback" not in output, output
    text = " ".join(output.split())  # as the console wrapped it
    assert all(w in text for w in words), output


def test_a_key_file_open_to_others_is_refused_before_anything_starts(
    tmp_path: Path, nothing_starts: list[str],
) -> None:
    from cmx.deploy.apikeys import add_key

    keys = tmp_path / "keys"
    add_key(str(keys), "alice")
    keys.chmod(0o644)
    result = serve(tmp_path, {"CMX_API_KEY_FILE": str(keys)})
    assert_refused(result, "mode 0644", "chmod 600")
    assert nothing_starts == [] and not (tmp_path / "state" / "serve.json").exists()


@pytest.mark.parametrize(("var", "value"), [
    ("CMX_API_ANONYMOUS", "maybe"),  # was a traceback and exit 1
    ("CMX_BLOCK_BYTES", "lots"),  # the service's settings
    ("CMX_ADMIN_TOKEN", "short"),  # the state directory's settings
])
def test_a_bad_setting_is_one_error_line_and_exit_2(
    tmp_path: Path, nothing_starts: list[str], var: str, value: str,
) -> None:
    assert_refused(serve(tmp_path, {var: value}), "error:")
    assert nothing_starts == []
    if var == "CMX_ADMIN_TOKEN":  # `--stop` reads it too
        assert_refused(serve(tmp_path, {var: value}, "--stop"), "admin token")
