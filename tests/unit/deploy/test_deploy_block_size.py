"""Slots too small for the model are refused before anything is deployed: ``check_block_size``
raises ``CmxError`` naming the ``CMX_BLOCK_BYTES`` to set, and ``cmx serve`` prints it and exits
2 before it looks for a Ray cluster. The model is a Hugging Face directory holding only its
``config.json`` (the layout is all the check reads); no Ray runs here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cmx.config import ServiceConfig
from cmx.deploy.app import check_block_size
from cmx.deploy.cli import app as deploy_cli
from cmx.deploy.config import EngineOptions, ModelOptions, ServeOptions
from cmx.errors import CmxError

# 2 layers x (K, V) x 2 KV heads x 128 tokens x 16 dims x 2 bytes (bfloat16)
BLOCK_BYTES = 2 * 2 * 2 * 128 * 16 * 2
UNREACHABLE = "192.0.2.1:6379"  # TEST-NET-1: no Ray answers there, and it is not this host


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    path = tmp_path / "tiny-llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 128,
        "vocab_size": 100}))
    return str(path)


def options(model_dir: str, **service: int) -> ServeOptions:
    config = ServiceConfig(**service) if service else None  # type: ignore[arg-type]
    return ServeOptions(model=ModelOptions(path=model_dir), service=config)


def test_slots_smaller_than_a_block_are_refused_with_the_number_to_set(model_dir: str) -> None:
    with pytest.raises(CmxError) as refused:
        check_block_size(options(model_dir, block_bytes=BLOCK_BYTES // 2))
    message = str(refused.value)
    assert f"the context memory's slots hold {BLOCK_BYTES // 2} bytes" in message
    assert f"CMX_BLOCK_BYTES={BLOCK_BYTES}" in message
    check_block_size(options(model_dir, block_bytes=BLOCK_BYTES))  # exactly one block fits
    small = options(model_dir, block_bytes=4096)
    check_block_size(small.replace(engine=EngineOptions(connector="none")))  # no slots used


def test_the_environments_block_bytes_is_checked_where_no_service_is_given(
    model_dir: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_block_size(options(model_dir))  # unset: the service would get slots of one block
    monkeypatch.setenv("CMX_BLOCK_BYTES", str(BLOCK_BYTES - 4096))
    with pytest.raises(CmxError, match=f"CMX_BLOCK_BYTES={BLOCK_BYTES}"):
        check_block_size(options(model_dir))


def test_cmx_serve_exits_2_with_the_message_before_it_starts_anything(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = tmp_path / "state"
    monkeypatch.setenv("CMX_STATE_DIR", str(state))
    monkeypatch.setenv("CMX_BLOCK_BYTES", "4096")
    result = CliRunner().invoke(deploy_cli, ["serve", "--model", model_dir,
                                             "--address", UNREACHABLE])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())  # rich wraps long lines
    assert f"CMX_BLOCK_BYTES={BLOCK_BYTES}" in text and "Traceback" not in text
    assert "no Ray cluster answers" not in text  # refused before any cluster was sought
    assert not (state / "serve.json").exists()


def test_prefill_replicas_need_the_context_memory(model_dir: str) -> None:
    from cmx.deploy.app import check_options

    split = options(model_dir).replace(prefill_replicas=1)
    check_options(split)
    assert ServeOptions.from_args(split.to_args()).prefill_replicas == 1
    with pytest.raises(CmxError, match="need engine.connector 'cmx'"):
        check_options(split.replace(engine=EngineOptions(connector="none")))
    with pytest.raises(CmxError, match="prefill_replicas must be >= 0"):
        check_options(split.replace(prefill_replicas=-1))


def test_the_hosts_cores_are_shared_by_every_engine_prefill_replicas_included(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert ServeOptions(replicas=2).threads == 2
    assert ServeOptions(replicas=1, prefill_replicas=1).threads == 2  # two engines, not one
    assert ServeOptions(replicas=2, prefill_replicas=2).threads == 1
    assert ServeOptions(replicas=2, prefill_replicas=6).threads == 1  # never below one
    assert ServeOptions(replicas=1, prefill_replicas=1,
                        engine=EngineOptions(threads=3)).threads == 3  # as set
