"""The Serve application with vLLM replicas of SmolLM2-135M-Instruct and the context memory as
their KV connector, through the official OpenAI client, streaming and not.

Two replicas, one per node of a two-node cluster of the application's own (``serve_llm_app``,
in a process of its own: the real model's blocks need slots of their own). A prefix one replica
computed and stored is loaded by the other, across nodes, and the greedy output is the same
tokens as with the cache off; cached tokens are reported in ``usage``; tenants never see each
other's blocks; every malformed request is an OpenAI-style 4xx.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from app_process import AppProcess

MODEL = "SmolLM2-135M-Instruct"
START_TIMEOUT_S = 900  # a bound: about 150 s on a quiet two-core machine


class App(AppProcess):
    """The application's process: its URL, replicas and namespace, and lookups through it."""

    def __init__(self) -> None:
        super().__init__("serve_llm_app.py", START_TIMEOUT_S)
        self.base: str = self.ready["base_url"]
        self.replicas: list[dict[str, str]] = self.ready["replicas"]
        self.info: dict[str, Any] = self.ready["info"]
        self.serve_llm: str = self.ready["serve_llm_url"]


@pytest.fixture(scope="module")
def app() -> Iterator[App]:
    running = App()
    try:
        yield running
    finally:
        running.stop()


def client(app: App, key: str = "tenant-a") -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{app.base}/v1", api_key=key, timeout=300, max_retries=0)


def prompt_ids(seed: int, n: int = 400) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def complete(app: App, ids: list[int], replica: dict[str, str] | None = None,
             key: str = "tenant-a", **extra: Any) -> Any:
    """A greedy completion of 8 tokens; ``key`` "": no Authorization header at all."""
    body = {"ignore_eos": True, **extra}
    if replica is not None:
        body["replica"] = replica["replica"]
    c = client(app, key or "unused")
    headers = {"Authorization": ""} if not key else None
    return c.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                extra_body=body, extra_headers=headers)


def salt_of(key: str) -> str:
    from cmx.deploy.tenants import tenant_salt

    return tenant_salt("", key, None)


def test_a_prefix_stored_by_one_replica_is_loaded_by_the_other_with_the_same_tokens(
    app: App,
) -> None:
    first, second = app.replicas
    prefix = prompt_ids(1)
    stored = complete(app, prefix + prompt_ids(2, 20), first)
    ext = stored.model_extra["cmx"]
    assert ext["replica"] == first["replica"] and ext["node"] == first["node"]
    assert stored.usage.prompt_tokens_details.cached_tokens == 0
    memory = ext["memory"]  # committed by the response, or still being stored then
    assert memory["stored_tokens"] + memory.get("store_pending_tokens", 0) >= 384
    assert not memory.get("store_failed_tokens")
    app.wait_stored(prefix, 384, salt_of("tenant-a"))

    prompt = prefix + prompt_ids(3, 20)
    hit = complete(app, prompt, second)
    hit_ext = hit.model_extra["cmx"]
    assert hit_ext["replica"] == second["replica"] and hit_ext["node"] == second["node"]
    cached = hit.usage.prompt_tokens_details.cached_tokens
    assert cached == hit_ext["loaded_tokens"] == 384  # whole 32-token blocks of the prefix
    miss = complete(app, prompt, second, cache=False)
    assert miss.usage.prompt_tokens_details.cached_tokens == 0
    assert miss.model_extra["cmx"]["loaded_tokens"] == 0
    assert miss.model_extra["cmx"]["completion_token_ids"] == hit_ext["completion_token_ids"]
    assert miss.choices[0].text == hit.choices[0].text


def test_streaming_gives_the_same_tokens_and_the_usage_last(app: App) -> None:
    _, second = app.replicas
    ids = prompt_ids(10, 300)
    whole = complete(app, ids, second)
    chunks = list(client(app).completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "replica": second["replica"]}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage.completion_tokens == 8 and usage.prompt_tokens == 300
    # The same prompt again on the same replica: its blocks are cached now.
    assert usage.prompt_tokens_details.cached_tokens == 288

    messages = [{"role": "system", "content": "Answer in one short sentence."},
                {"role": "user", "content": "Which tier holds a block first?"}]
    stream = client(app).chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                 temperature=0, stream=True)
    parts = list(stream)
    assert parts[0].choices[0].delta.role == "assistant"
    assert parts[-1].choices[0].finish_reason in ("stop", "length")
    plain = client(app).chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                temperature=0)
    assert "".join(p.choices[0].delta.content or "" for p in parts) == \
        plain.choices[0].message.content


def test_chat_uses_the_models_template_and_n_and_stop_work(app: App) -> None:
    from transformers import AutoTokenizer

    from cmx.models import smollm2_path

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    messages = [{"role": "user", "content": "Name three colours."}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    r = client(app).chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                            temperature=0.9, seed=7, n=3)
    assert r.usage.prompt_tokens == len(expected)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" for c in r.choices)
    again = client(app).chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                temperature=0.9, seed=7, n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]

    free = client(app).completions.create(model=MODEL, prompt="One, two, three, four, five,",
                                          max_tokens=16, temperature=0)
    word = free.choices[0].text.strip().split(",")[0].strip()
    assert word  # the model continues the count
    cut = client(app).completions.create(model=MODEL, prompt="One, two, three, four, five,",
                                         max_tokens=16, temperature=0, stop=[word])
    assert word not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"


def test_tenants_never_share_blocks_or_cached_token_figures(app: App) -> None:
    first, second = app.replicas
    prefix = prompt_ids(20)
    complete(app, prefix + [7, 8], first, key="tenant-a")
    app.wait_stored(prefix, 384, salt_of("tenant-a"))
    other = complete(app, prefix + [9, 10], second, key="tenant-b")
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    app.wait_stored(prefix, 384, salt_of("tenant-b"))  # b stores its own copy (asynchronously)
    # vLLM's cache_salt is a tenant of its own, beside the key's.
    salted = complete(app, prefix + [9, 11], second, key="tenant-a", cache_salt="project-x")
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    same = complete(app, prefix + [9, 12], second, key="tenant-a")
    assert same.usage.prompt_tokens_details.cached_tokens == 384

    info = httpx.get(f"{app.base}/cmx/info", timeout=60).text
    for key in ("tenant-a", "tenant-b"):
        assert salt_of(key) not in info and key not in info
    assert "salt" not in json.loads(info)["namespace"]


BAD_COMPLETIONS = [
    {"prompt": [-1, 5]},
    {"prompt": [49152]},  # the vocabulary has 49,152 ids
    {"prompt": [2**70]},
    {"prompt": [5] * 2048},  # no room left for one token in a 2,048-token context
    {"prompt": "hi", "max_tokens": 2048},
    {"prompt": "x" * 200_000},
    {"prompt": []},
    {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]},
    {"prompt": "hi", "stop": "s" * 10_000},
    {"prompt": "hi", "n": "2"},
    {"prompt": "hi", "temperature": "hot"},
    {"prompt": "hi", "max_tokens": -3},
    {"prompt": ["a", "b"]},
    {"prompt": {"text": "hi"}},
    {"messages": "not a completion"},
]


@pytest.mark.parametrize("body", BAD_COMPLETIONS, ids=range(len(BAD_COMPLETIONS)))
def test_a_malformed_completion_is_an_openai_4xx(app: App, body: dict[str, Any]) -> None:
    r = httpx.post(f"{app.base}/v1/completions", json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


def test_malformed_bodies_and_chats_are_4xx(app: App) -> None:
    url = f"{app.base}/v1/chat/completions"
    for raw in (b"{not json", b"[1, 2]", b"null", b'"text"'):
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 400, r.text
    for body in ({"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                 {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000},
                 {"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}):
        r = httpx.post(url, json=body, timeout=60)
        assert 400 <= r.status_code < 500 and "error" in r.json(), r.text

    def chunked() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(10_000):
            yield b"x" * 1024  # 10 MiB, no Content-Length
        yield b'"}'

    r = httpx.post(f"{app.base}/v1/completions", content=chunked(), timeout=120)
    assert r.status_code == 413, r.text


def test_the_router_sends_each_request_to_the_node_holding_its_prefix(app: App) -> None:
    # Three trials per replica, alternating: a router that ignored the prefix would pass all
    # six one time in 64.
    for trial in range(6):
        holder = app.replicas[trial % 2]
        prefix = prompt_ids(100 + trial)
        seeded = complete(app, prefix + [1], holder)
        assert seeded.model_extra["cmx"]["replica"] == holder["replica"]
        app.wait_stored(prefix, 384, salt_of("tenant-a"))
        routed = complete(app, prefix + [2, 3])
        assert routed.model_extra["cmx"]["replica"] == holder["replica"], f"trial {trial}"


def test_ray_serve_llm_with_the_connector_loads_what_the_application_stored(app: App) -> None:
    """``ray.serve.llm`` with ``kv_transfer_config`` set to CMXConnector, beside the application,
    on the same model: the same namespace, so each loads what the other stored."""
    first, _ = app.replicas
    prefix = prompt_ids(30)
    complete(app, prefix + [5], first, key="")  # no key, no cache_salt: the unsalted tenant
    app.wait_stored(prefix, 384)
    prompt = prefix + prompt_ids(31, 20)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(f"{app.serve_llm}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    hit = r.json()
    report = (hit.get("kv_transfer_params") or {}).get("cmx", {})
    assert report.get("loaded_tokens") == 384, hit
    baseline = complete(app, prompt, first, key="", cache=False)
    assert hit["choices"][0]["text"] == baseline.choices[0].text

    fresh = prompt_ids(32)
    r = httpx.post(f"{app.serve_llm}/v1/completions", timeout=300,
                   json={**body, "prompt": fresh + [6]})
    assert r.status_code == 200, r.text
    app.wait_stored(fresh, 384)  # stored by ray.serve.llm's engine, found in our namespace
