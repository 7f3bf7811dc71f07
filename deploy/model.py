"""The model a replica serves: a seeded random Llama, or a local Hugging Face directory.

Also what the context memory needs to know about it: the KV layout (layers, KV heads, head
dim, float32) and the namespace: blocks are shared only between replicas whose KV bytes are the
same, so the namespace names the model, a fingerprint of its weights' bytes, and what else
decides the KV's bits (attention implementation, prefill chunk, torch and transformers).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from cmx.deploy.config import EngineOptions, ModelOptions
from cmx.deploy.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from cmx.layout import KVLayout

__all__ = ["LoadedModel", "NamespaceSpec", "layout_of", "llama_config", "load_model",
           "make_tokenizer", "model_config"]


@dataclass(frozen=True)
class NamespaceSpec:
    """Everything that names a namespace: ``ContextMemory.namespace(**spec.kwargs())``."""

    model: str
    weights: str  # fingerprint of the weights' bytes and the numerics around them
    layout: KVLayout
    salt: str = ""

    def kwargs(self) -> dict[str, Any]:
        return {"model": self.model, "layout": self.layout, "salt": self.salt,
                "weights": self.weights}

    @property
    def digest(self) -> bytes:
        from cmx.keys import Namespace

        return Namespace(self.model, self.layout, self.salt, self.weights).digest


@dataclass
class LoadedModel:
    model: Any  # a transformers causal LM, eval mode, float32
    config: Any  # its (text) config
    tokenizer: Tokenizer
    spec: NamespaceSpec
    output_ids: Any = None  # token ids the sampler may choose (None: the whole vocabulary)


def llama_config(opts: ModelOptions) -> Any:
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(
        vocab_size=opts.vocab_size, hidden_size=opts.hidden_size,
        intermediate_size=opts.intermediate_size, num_hidden_layers=opts.num_layers,
        num_attention_heads=opts.num_heads, num_key_value_heads=opts.num_kv_heads,
        max_position_embeddings=opts.max_positions, bos_token_id=ByteTokenizer().bos_token_id,
        eos_token_id=ByteTokenizer().eos_token_id, pad_token_id=0,
        attn_implementation=opts.attn,
    )
    return LlamaConfig(**fields)


def model_config(opts: ModelOptions) -> Any:
    """The model's config without its weights (what the layout needs)."""
    if opts.path is None:
        return llama_config(opts)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(opts.path)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def layout_of(config: Any, engine: EngineOptions) -> KVLayout:
    """The KV layout of a decoder: [layers, 2, kv_heads, tokens, head_dim], float32."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVLayout(num_layers=config.num_hidden_layers, num_kv_heads=kv_heads,
                    head_dim=head_dim, dtype="float32", block_tokens=engine.block_tokens)


def make_tokenizer(opts: ModelOptions) -> Tokenizer:
    return ByteTokenizer() if opts.path is None else HFTokenizer(opts.path)


def load_model(opts: ModelOptions, engine: EngineOptions) -> LoadedModel:
    """Build (random) or load (path) the model, float32, in eval mode, and name its namespace."""
    import torch

    model: Any
    if opts.path is None:
        from transformers import LlamaForCausalLM

        config = llama_config(opts)
        torch.manual_seed(opts.seed)
        model = LlamaForCausalLM(config)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            opts.path, dtype=torch.float32, attn_implementation=opts.attn)
        config = model.config.get_text_config(decoder=True)
    model = model.to(torch.float32).eval()
    layout = layout_of(config, engine)
    spec = NamespaceSpec(opts.model_id, weights_fingerprint(model, opts, engine), layout,
                         engine.salt)
    tokenizer = make_tokenizer(opts)
    allowed = getattr(tokenizer, "output_ids", None)
    output_ids = None if allowed is None else torch.tensor(allowed, dtype=torch.long)
    return LoadedModel(model, config, tokenizer, spec, output_ids)


def weights_fingerprint(model: Any, opts: ModelOptions, engine: EngineOptions) -> str:
    """BLAKE2b-128 of every parameter's bytes (name order) and the numerics that shape the KV.

    Two replicas share blocks only if their weights are the same bytes: a fine-tune, another
    seed or a re-quantization gets a namespace of its own. The prefill chunk and attention
    implementation are part of it because the KV's last bits depend on them (see engine).
    """
    import torch
    import transformers

    h = hashlib.blake2b(digest_size=16, person=b"cmx-weights-v1")
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(memoryview(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()))
    numerics = {"attn": opts.attn, "chunk": engine.chunk_tokens, "dtype": "float32",
                "torch": torch.__version__, "transformers": transformers.__version__}
    h.update(json.dumps(numerics, sort_keys=True).encode())
    return h.hexdigest()
