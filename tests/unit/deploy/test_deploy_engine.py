"""The engine on a tiny random Llama with an in-process memory: exact reuse, gating, stores."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fakes import TINY, TINY_ENGINE, DictMemory  # noqa: E402

from cmx.deploy.engine import Engine  # noqa: E402
from cmx.deploy.messages import GenerateRequest  # noqa: E402
from cmx.deploy.model import load_model  # noqa: E402
from cmx.deploy.sampling import SamplingParams  # noqa: E402
from cmx.policies.breakeven import BreakEven  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def loaded():
    return load_model(TINY, TINY_ENGINE)


def prompt(n: int, seed: int = 0) -> tuple[int, ...]:
    import random

    rng = random.Random(seed)
    return tuple(rng.randrange(8, 264) for _ in range(n))


def request(ids: tuple[int, ...], cache: bool = True, **kw) -> GenerateRequest:
    return GenerateRequest("r", ids, max_tokens=kw.pop("max_tokens", 12),
                           sampling=kw.pop("sampling", GREEDY), use_cache=cache,
                           ignore_eos=kw.pop("ignore_eos", True), **kw)


def engine(loaded, memory, **kw) -> Engine:
    # The tiny model recomputes 100 tokens in a millisecond or two: only a load from memory
    # that costs next to nothing is worth it, which the in-process fake is.
    kw.setdefault("gate", BreakEven(links={"dram": (1e-6, 1e12)}, margin=0.0))
    return Engine(loaded, memory, TINY_ENGINE.chunk_tokens, **kw)


def test_a_loaded_prefix_gives_the_tokens_recompute_gives(loaded) -> None:
    memory = DictMemory(loaded.spec.layout)
    eng = engine(loaded, memory)
    shared = prompt(200)
    first = eng.run(request(shared + prompt(30, seed=1)))
    eng.flush()
    assert first.cached_tokens == 0 and first.stored_tokens == 224  # 7 whole chunks of 32
    second = request(shared + prompt(45, seed=2))
    hit = eng.run(second)
    miss = eng.run(request(second.prompt_ids, cache=False))
    assert hit.cached_tokens == 192  # 200 shared tokens -> 6 chunks
    assert hit.served_from == {"dram": 192}
    assert hit.token_ids == miss.token_ids
    assert miss.cached_tokens == 0 and miss.stored_tokens == 0


@pytest.mark.parametrize("tail", [1, 2, 5, 31, 32, 33])
def test_exact_for_any_tail_length_and_at_least_one_token_is_computed(loaded, tail) -> None:
    import torch

    from cmx.deploy.kvcache import snapshot
    from cmx.deploy.prefill import prefill

    memory = DictMemory(loaded.spec.layout)
    eng = engine(loaded, memory)
    ids = prompt(128 + tail, seed=tail)
    eng.run(request(ids[:128]))
    eng.flush()
    fresh = prefill(loaded.model, loaded.config, ids, 32)
    found = memory.lookup(ids)
    kv = memory.load(ids, found, found.tokens)
    from concurrent.futures import Future

    fut: Future = Future()
    fut.set_result(kv)
    reused = prefill(loaded.model, loaded.config, ids, 32, load=fut, patience_s=1.0)
    assert reused.loaded_tokens == min(128, (len(ids) - 1) // 32 * 32)
    assert reused.computed, "at least one token is always computed"
    assert torch.equal(reused.logits, fresh.logits)
    for (k1, v1), (k2, v2) in zip(snapshot(reused.cache), snapshot(fresh.cache)):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_sampled_output_with_a_seed_is_the_same_with_and_without_the_cache(loaded) -> None:
    memory = DictMemory(loaded.spec.layout)
    eng = engine(loaded, memory)
    ids = prompt(160, seed=3)
    eng.run(request(ids))
    eng.flush()
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    hit = eng.run(request(ids + (9, 10), sampling=params))
    miss = eng.run(request(ids + (9, 10), cache=False, sampling=params))
    assert hit.cached_tokens > 0 and hit.token_ids == miss.token_ids


def test_a_tier_slower_than_recompute_is_not_loaded(loaded) -> None:
    memory = DictMemory(loaded.spec.layout, source="nvme@peer")
    gate = BreakEven(links={"nvme@peer": (5.0, 1e6)})  # 5 s a move: slower than any prefill
    eng = engine(loaded, memory, gate=gate)
    ids = prompt(160, seed=4)
    eng.run(request(ids))
    eng.flush()
    memory.loads = 0
    result = eng.run(request(ids + (12,)))
    assert result.matched_tokens == 160 and result.cached_tokens == 0
    assert memory.loads == 0 and "recompute" in result.plan


def test_a_late_load_is_raced_by_compute_and_adopted_when_it_lands(loaded) -> None:
    memory = DictMemory(loaded.spec.layout, load_delay_s=0.3)
    gate = BreakEven(links={"dram": (1e-6, 1e12)}, margin=0.0, slack=0.0)  # no patience
    eng = engine(loaded, memory, gate=gate)
    ids = prompt(1024, seed=5)
    eng.run(request(ids))
    eng.flush()
    result = eng.run(request(ids + (13,)))
    baseline = eng.run(request(ids + (13,), cache=False))
    assert result.token_ids == baseline.token_ids
    start = 1024 - result.cached_tokens
    assert result.cached_tokens == 0 or start % 32 == 0


def test_cache_off_neither_looks_up_nor_stores(loaded) -> None:
    memory = DictMemory(loaded.spec.layout)
    eng = engine(loaded, memory)
    result = eng.run(request(prompt(100), cache=False))
    eng.flush()
    assert memory.blocks == {} and result.matched_tokens == 0 and result.prefetch == "none"


def test_stop_strings_and_max_tokens(loaded) -> None:
    eng = engine(loaded, None)
    result = eng.run(request(prompt(40), max_tokens=5))
    assert len(result.token_ids) == 5 and result.finish_reason == "length"
    text = eng.run(request(prompt(40), max_tokens=40, ignore_eos=True)).text
    stop = text[10:12]
    stopped = eng.run(request(prompt(40), max_tokens=40, ignore_eos=True, stop=(stop,)))
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.find(stop)]
    assert all(32 <= ord(c) < 127 or c == "\n" for c in text)


def test_a_load_that_lands_mid_prefill_is_adopted_at_the_next_grid_line(loaded) -> None:
    from concurrent.futures import Future

    import torch

    from cmx.deploy.prefill import prefill

    ids = prompt(300, seed=8)
    fresh = prefill(loaded.model, loaded.config, ids, 32)
    kv = torch.cat([torch.stack((k[0, :, :256], v[0, :, :256]))[None]
                    for k, v in ((layer.keys, layer.values) for layer in fresh.cache.layers)])
    landing: Future = Future()
    calls = []

    def model(**kw):
        calls.append(kw["input_ids"].shape[1])
        if len(calls) == 2:  # the load lands while the second chunk is computed
            landing.set_result(kv)
        return loaded.model(**kw)

    raced = prefill(model, loaded.config, ids, 32, load=landing, patience_s=0.0)
    assert raced.loaded_range == (64, 256)
    assert calls == [32, 32, 32, 12]  # [0,32) [32,64), adopt [64,256), [256,288) [288,300)
    assert torch.equal(raced.logits, fresh.logits)
