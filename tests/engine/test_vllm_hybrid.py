"""A model whose layers alternate sliding-window and full attention (Gemma 3's text model,
small, with vLLM's dummy weights): with the connector vLLM keeps one KV cache group (its
hybrid manager off, every layer's KV kept for every block), and a prefix stored from it loads
back with the tokens and log-probabilities the engine gives without the cache."""

from __future__ import annotations

from typing import Any

import pytest

from .test_vllm_connector import run_fresh_engine
from .vllm_support import BLOCK_SIZE, hybrid_model, prompts


def test_a_hybrid_models_prefix_loads_with_the_output_it_gives_alone(
    cm: Any, service: Any, tmp_path: Any,
) -> None:
    model = hybrid_model(str(tmp_path / "gemma3-hybrid"))
    prompt = prompts()[2]
    alone, stored, hit = run_fresh_engine(service, [
        {"text": prompt, "salt": "hybrid", "cmx": {"skip": True}},  # without the cache
        {"text": prompt, "salt": "hybrid"},  # computed and stored
        {"text": prompt, "salt": "hybrid", "until_cached": 240},  # loaded once committed
    ], {}, engine={"model": model, "load_format": "dummy", "enable_prefix_caching": False},
        timeout_s=900)
    ids = alone["prompt_ids"]
    tokens = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert stored["cached"] == 0 and stored["tokens"] == alone["tokens"], stored
    assert hit["cached"] == tokens > 64, (stored, hit)  # past the sliding window of 64 tokens
    assert hit["report"]["cmx"]["loaded_tokens"] == tokens
    assert hit["tokens"] == alone["tokens"]
    # dummy weights choose alike tokens easily: the log-probabilities say the KV is the same
    assert hit["logprobs"] == pytest.approx(alone["logprobs"], abs=1e-3)
