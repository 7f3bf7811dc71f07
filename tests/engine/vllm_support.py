"""What the engine tests and the fresh-engine script share: the engine's settings, the prompts.

Imported as ``engine.vllm_support`` by the tests and as ``vllm_support`` by ``fresh_engine.py``,
which runs as a script of its own.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict
from typing import Any

from cmx.config import ServiceConfig

BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
MAX_TOKENS = 8
# About 290 tokens of shared system prompt: nine full blocks, then each question's own tail.
SYSTEM = ("You are the assistant of a context memory service for LLM inference. The service "
          "keeps the KV cache of prompts in GPU memory, host memory and NVMe drives, and finds "
          "the longest cached prefix of each new prompt. ") * 6
QUESTIONS = ["Which tiers does it use?", "What does it find for a new prompt?",
             "Name one tier.", "Why keep the cache?", "What is a prefix?"]


def set_engine_env(environ: Any = os.environ) -> None:
    environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def engine_kwargs(**extra: Any) -> dict[str, Any]:
    from cmx.models import smollm2_path

    # float32: greedy tokens that do not hinge on bfloat16 rounding of a different batch shape.
    return dict(model=smollm2_path(), enforce_eager=True, block_size=BLOCK_SIZE,
                max_model_len=2048, seed=0, dtype="float32") | extra


def hybrid_model(root: str) -> str:
    """A model whose layers alternate sliding-window and full attention (Gemma 3's text
    model, four small layers), written into ``root`` with SmolLM2's tokenizer; its weights
    are vLLM's dummy ones (``load_format="dummy"``): random, the same for a seed."""
    import json
    import shutil

    from cmx.models import smollm2_path

    source = smollm2_path()
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(source, name), root)
    config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
              "vocab_size": 49152, "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
              "rope_theta": 1e6, "rope_local_base_freq": 1e4, "tie_word_embeddings": True,
              "sliding_window": 64, "query_pre_attn_scalar": 32,
              "hidden_activation": "gelu_pytorch_tanh",
              "layer_types": ["sliding_attention", "full_attention"] * 2,
              "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 0}
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(config, f)
    return root


def transfer_config(service: ServiceConfig, **settings: Any) -> dict[str, Any]:
    return {"kv_connector": "CMXConnector", "kv_connector_module_path": "cmx.connectors.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"service": asdict(service), **settings}}


@functools.cache
def prompts() -> tuple[str, ...]:
    """Each question after the shared system prompt, in the model's chat template."""
    from transformers import AutoTokenizer

    from cmx.models import smollm2_path

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
             for q in QUESTIONS]
    return tuple(str(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True))
                 for c in chats)


