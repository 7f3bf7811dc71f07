"""Engines of different tensor-parallel degrees share one prefix: SmolLM2 (3 KV heads) at TP=3,
each rank a process holding one head, beside the TP=1 engine of this process. What one stores,
the other loads, with the output it gives without the cache."""

from __future__ import annotations

from typing import Any

from .test_vllm_connector import (
    full_blocks,
    generate,
    namespace,
    report,
    run_fresh_engine,
    shards,
    wait_stored,
)
from .vllm_support import BLOCK_SIZE, prompts

TP3 = {"tensor_parallel_size": 3, "distributed_executor_backend": "mp",
       "enable_prefix_caching": False}  # every hit from the service


def test_a_prefix_stored_at_tp1_loads_at_tp3_and_back(
    engine: Any, baseline: Any, cm: Any, service: Any,
) -> None:
    loaded, computed = prompts()[0], prompts()[4]
    stored = generate(engine, loaded, salt="tp1-to-tp3")
    tokens = full_blocks(stored)
    wait_stored(namespace(cm, engine, "tp1-to-tp3"), stored.prompt_token_ids, tokens)

    results = run_fresh_engine(service, [
        {"text": loaded, "salt": "tp1-to-tp3", "cmx": {"skip": True}},  # without the cache
        {"text": loaded, "salt": "tp1-to-tp3"},  # each rank loads its head of the TP=1 blocks
        {"text": computed, "salt": "tp3-to-tp1"},  # each rank stores its head
    ], {}, engine=TP3, timeout_s=900)
    alone, hit, new = results
    assert hit["tokens"] == alone["tokens"]
    assert hit["cached"] == tokens > 0  # from the service: its own prefix cache is off
    assert hit["report"]["cmx"]["loaded_tokens"] == tokens
    assert "loaded_tokens" not in new["report"]["cmx"]

    ids = new["prompt_ids"]
    back = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    wait_stored(shards("tp3-to-tp1"), ids, back)  # every head of every block
    assert namespace(cm, engine, "tp3-to-tp1").lookup(ids).num_tokens == 0  # none whole
    again = generate(engine, computed, salt="tp3-to-tp1")
    assert again.num_cached_tokens == back > 0
    assert report(again)["loaded_tokens"] == back
    assert list(again.outputs[0].token_ids) == baseline[computed]
