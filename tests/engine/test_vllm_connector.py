"""CMXConnector in vLLM on CPU with SmolLM2-135M: what is loaded is exactly what was computed.

Every test compares greedy tokens with vLLM's own, without a connector (``baseline``). The
engine under test has its own prefix cache off, so a repeated prompt is served by the service.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from vllm import SamplingParams

from cmx.connectors.settings import Namespaces, namespace_salt
from cmx.connectors.vllm import CMXConnector
from cmx.doors import Evict

from .vllm_support import BLOCK_SIZE, MAX_TOKENS, prompts

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
MODEL_TOKENS = BLOCK_SIZE  # the connector stores full blocks only


def generate(llm: Any, prompt: str, salt: str | None = None,
             cmx: dict[str, Any] | None = None) -> Any:
    """Greedy output of ``prompt``; ``cmx``: the request's ``kv_transfer_params["cmx"]``."""
    item: dict[str, Any] = {"prompt": prompt}
    if salt is not None:
        item["cache_salt"] = salt
    params = GREEDY
    if cmx is not None:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                extra_args={"kv_transfer_params": {"cmx": cmx}})
    return llm.generate([item], params, use_tqdm=False)[0]


def report(out: Any) -> dict[str, Any]:
    return dict((out.kv_transfer_params or {}).get("cmx", {}))


def namespace(cm: Any, llm: Any, salt: str = "") -> Any:
    """The service's namespace in which the engine's connector stores for ``salt`` (its whole
    blocks: the engine runs at TP=1)."""
    ns = shards(salt)
    return getattr(ns, "whole", ns)


def shards(salt: str = "") -> Any:
    """The namespaces the engine's connector loads from for ``salt``: its whole blocks and
    each KV head's (``cmx.connectors.shards``)."""
    return worker_side().namespaces.get(namespace_salt("", salt))


def worker_side() -> Any:
    """The worker side of the connector of the engine in this process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    assert isinstance(connector, CMXConnector)
    return connector._side_worker()


def wait_stored(ns: Any, prompt_ids: list[int], tokens: int, timeout_s: float = 60.0) -> None:
    """Stores are asynchronous: wait (bounded) until the service answers ``tokens``."""
    deadline = time.monotonic() + timeout_s
    while ns.lookup(prompt_ids).num_tokens < tokens:
        assert time.monotonic() < deadline, "the engine's blocks were never committed"
        time.sleep(0.1)


def full_blocks(out: Any) -> int:
    return (len(out.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_loaded_prefix_gives_the_same_tokens(engine: Any, baseline: Any, cm: Any) -> None:
    prompt = prompts()[0]
    first = generate(engine, prompt, salt="same-tokens")
    assert list(first.outputs[0].token_ids) == baseline[prompt]
    assert first.num_cached_tokens == 0
    wait_stored(namespace(cm, engine, "same-tokens"), first.prompt_token_ids, full_blocks(first))

    again = generate(engine, prompt, salt="same-tokens")
    assert list(again.outputs[0].token_ids) == baseline[prompt]
    assert again.num_cached_tokens == full_blocks(first) > 0
    assert report(again)["loaded_tokens"] == full_blocks(first)


def test_a_fresh_engine_in_another_process_loads_the_prefix(
    engine: Any, baseline: Any, cm: Any, service: Any,
) -> None:
    import ray

    prompt = prompts()[1]
    stored = generate(engine, prompt)
    wait_stored(namespace(cm, engine), stored.prompt_token_ids, full_blocks(stored))
    here = os.path.dirname(__file__)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    address = ray.get_runtime_context().gcs_address
    run = subprocess.run(
        [sys.executable, os.path.join(here, "fresh_engine.py"), address,
         json.dumps(asdict(service)), json.dumps({"text": prompt, "max_tokens": MAX_TOKENS})],
        env=env, capture_output=True, text=True, timeout=480)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["tokens"] == baseline[prompt]
    assert result["cached"] == full_blocks(stored) > 0  # its own prefix cache was empty
    assert result["report"]["cmx"]["loaded_tokens"] == full_blocks(stored)


def test_an_engine_in_async_mode_loads_and_stores_the_same_tokens(
    engine: Any, baseline: Any, cm: Any, service: Any,
) -> None:
    # A fresh engine with asynchronous loads and saves: a prefix another engine stored is
    # loaded while its request waits; a prompt it computes is copied out after each step and
    # stored, and the engine of this process then loads that one.
    loaded, computed = prompts()[1], prompts()[3]
    stored = generate(engine, loaded)
    wait_stored(namespace(cm, engine), stored.prompt_token_ids, full_blocks(stored))
    results = run_fresh_engine(service, [{"text": loaded}, {"text": computed,
                                                            "salt": "async-saves"}],
                               {"load_mode": "async", "save_mode": "async"})
    assert [r["tokens"] for r in results] == [baseline[loaded], baseline[computed]]
    assert results[0]["cached"] == full_blocks(stored) > 0  # its own prefix cache was empty
    assert results[0]["report"]["cmx"]["loaded_tokens"] == full_blocks(stored)
    assert "loaded_tokens" not in results[1]["report"]["cmx"]

    ids = results[1]["prompt_ids"]
    tokens = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    wait_stored(namespace(cm, engine, "async-saves"), ids, tokens)
    again = generate(engine, computed, salt="async-saves")
    assert again.num_cached_tokens == tokens > 0
    assert list(again.outputs[0].token_ids) == baseline[computed]


def run_fresh_engine(service: Any, requests: list[dict[str, Any]],
                     settings: dict[str, Any], engine: dict[str, Any] | None = None,
                     timeout_s: float = 480) -> list[dict[str, Any]]:
    """What a fresh engine in another process (multiprocessing on) made of each request;
    ``engine``: more of its ``LLM`` arguments."""
    import ray

    here = os.path.dirname(__file__)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    address = ray.get_runtime_context().gcs_address
    run = subprocess.run(
        [sys.executable, os.path.join(here, "fresh_engine.py"), address,
         json.dumps(asdict(service)), json.dumps({"requests": requests, "engine": engine or {},
                                                  "max_tokens": MAX_TOKENS}),
         json.dumps(settings)],
        env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and len(lines) == len(requests), run.stderr[-3000:]
    return [json.loads(line.removeprefix("RESULT ")) for line in lines]


def test_a_block_dropped_between_lookup_and_load_is_recomputed(
    engine: Any, baseline: Any, cm: Any,
) -> None:
    prompt = prompts()[2]
    salt = "dropped"
    first = generate(engine, prompt, salt=salt)
    ns = namespace(cm, engine, salt)
    tokens = full_blocks(first)
    wait_stored(ns, first.prompt_token_ids, tokens)
    keep = 3  # blocks that stay; the rest vanish after the scheduler found them
    worker = worker_side()
    real = worker.namespaces
    worker.namespaces = DropOnLoad(real, cm, ns.keys(first.prompt_token_ids)[keep:])
    try:
        again = generate(engine, prompt, salt=salt)
    finally:
        worker.namespaces = real
    assert list(again.outputs[0].token_ids) == baseline[prompt]
    got = report(again)
    assert got["lookup_tokens"] == tokens  # the scheduler saw every block...
    assert got["loaded_tokens"] == keep * BLOCK_SIZE  # ...the worker found only these
    assert got["load_failed_tokens"] == tokens - keep * BLOCK_SIZE


def test_two_cache_salts_never_share_a_block(engine: Any, baseline: Any, cm: Any) -> None:
    prompt = prompts()[3]
    a = generate(engine, prompt, salt="tenant-a")
    ns_a, ns_b = namespace(cm, engine, "tenant-a"), namespace(cm, engine, "tenant-b")
    wait_stored(ns_a, a.prompt_token_ids, full_blocks(a))
    assert not set(ns_a.keys(a.prompt_token_ids)) & set(ns_b.keys(a.prompt_token_ids))

    b = generate(engine, prompt, salt="tenant-b")
    assert b.num_cached_tokens == 0 and report(b)["lookup_tokens"] == 0
    assert list(b.outputs[0].token_ids) == baseline[prompt]
    again = generate(engine, prompt, salt="tenant-a")
    assert again.num_cached_tokens == full_blocks(a)
    assert list(again.outputs[0].token_ids) == baseline[prompt]


def test_a_request_that_opts_out_is_kept_out_of_the_cache(
    engine: Any, baseline: Any, cm: Any,
) -> None:
    prompt = prompts()[4]
    salt = "opt-out"
    ns = namespace(cm, engine, salt)
    skipped = generate(engine, prompt, salt=salt, cmx={"skip": True})
    assert list(skipped.outputs[0].token_ids) == baseline[prompt]
    assert report(skipped) == {}  # neither looked up nor stored
    worker = worker_side()
    deadline = time.monotonic() + 60
    while worker.stores.pending:  # a store handed over would be running now
        assert time.monotonic() < deadline, "a store never finished"
        time.sleep(0.1)
    assert ns.lookup(skipped.prompt_token_ids).num_tokens == 0

    stored = generate(engine, prompt, salt=salt)
    wait_stored(ns, stored.prompt_token_ids, full_blocks(stored))
    unloaded = generate(engine, prompt, salt=salt, cmx={"load": False})
    assert unloaded.num_cached_tokens == 0 and "loaded_tokens" not in report(unloaded)
    assert list(unloaded.outputs[0].token_ids) == baseline[prompt]
    loaded = generate(engine, prompt, salt=salt)
    assert loaded.num_cached_tokens == full_blocks(stored) > 0


class DropOnLoad(Namespaces):
    """The worker's namespaces, which evict ``keys`` from the service the first time the
    worker asks for a namespace: after the scheduler's lookup, before the worker's load."""

    def __init__(self, real: Namespaces, cm: Any, keys: list[bytes]) -> None:
        super().__init__(real.cm, real.model, real.layout, real.weights)
        self.real = real
        self.drop = keys

    def get(self, salt: str) -> Any:
        if self.drop:
            evict(self.cm, self.drop)
            self.drop = []
        return self.real.get(salt)


def evict(cm: Any, keys: list[bytes]) -> None:
    """Remove every copy of ``keys`` from the service, as its own eviction would."""
    from cmx.links import actor_name

    holders: dict[tuple[str, str], list[bytes]] = {}
    for key, copies in zip(keys, cm.copies(keys)):
        for c in copies:
            holders.setdefault((c.tier.value, c.node), []).append(key)
    for (tier, node), held in holders.items():
        cm.link.call(actor_name(tier, node), Evict(keys=held))
    deadline = time.monotonic() + 30
    while any(cm.copies(keys)):
        assert time.monotonic() < deadline, "evicted blocks are still listed"
        time.sleep(0.05)


def test_a_corrupt_block_in_the_service_never_reaches_the_engine(
    engine: Any, baseline: Any, cm: Any,
) -> None:
    """A byte of a stored block's last layer flipped in the service's DRAM: the engine's
    load checks each block before any of its layers is written, loads the blocks before it,
    recomputes the rest and answers exactly as vLLM alone; the copy is quarantined."""
    prompt = prompts()[2]
    salt = "corrupt"
    first = generate(engine, prompt, salt=salt)
    ns = namespace(cm, engine, salt)
    tokens = full_blocks(first)
    wait_stored(ns, first.prompt_token_ids, tokens)
    keys = ns.keys(first.prompt_token_ids)
    plane = ns.cm.plane
    before = quarantined(ns)
    pins = plane.pin_prefix(keys, "test-corrupt")
    try:
        assert len(pins) == tokens // BLOCK_SIZE
        payload = plane.payload(pins[1])
        payload[-1] ^= 0xFF
    finally:
        plane.unpin(pins)
    again = generate(engine, prompt, salt=salt)
    assert list(again.outputs[0].token_ids) == baseline[prompt]
    got = report(again)
    assert got["loaded_tokens"] == BLOCK_SIZE  # the block before the bad one, no more
    assert got["load_failed_tokens"] == tokens - BLOCK_SIZE
    # The bad copy is quarantined (sent one way, after the load); the engine then stores the
    # blocks it recomputed, so a good copy may take its place.
    deadline = time.monotonic() + 60
    while quarantined(ns) == before:
        assert time.monotonic() < deadline, "the corrupt copy was never quarantined"
        time.sleep(0.1)
    assert quarantined(ns) == before + 1


def quarantined(ns: Any) -> int:
    """Copies this node's DRAM tier dropped as corrupt so far."""
    from cmx.doors import TierStatsOf
    from cmx.links import actor_name

    stats = ns.cm.link.call(actor_name("dram", ns.cm.node_id), TierStatsOf())
    return int(stats.store.quarantined)
