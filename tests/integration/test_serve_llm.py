"""The Serve application on the session's two-node cluster, through the official OpenAI client.

Two LLM replicas, one per node, over the session's service. A prefix one replica computed and
stored is loaded by the other, across nodes, and the greedy output is the same tokens as with
the cache off. The model is small (4 layers, 2 KV heads of 32: 32 KiB per 16-token block, the
session service's slot size) so the module stays well under a minute once Serve is up.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cmx.deploy.config import EngineOptions, ModelOptions, ServeOptions
from cmx.deploy.tokenizer import ByteTokenizer

APP = "cmx-llm-test"
PREFIX = "/cmx-llm"
MODEL = ModelOptions(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                     num_kv_heads=2, vocab_size=512, max_positions=4096, seed=3)
# Gating off: on two busy cores a 600-token prefill of this model can be as quick as a load
# through the session service's tiny HBM tier; this module tests the load path, not the gate.
ENGINE = EngineOptions(block_tokens=16, chunk_tokens=32, warmup_tokens=64, gate=False)
SYSTEM = ("You are the assistant of a context memory service. Answer in one short sentence, "
          "cite the tier that served the prefix, and never invent a number. ") * 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def llm(cm: Any, config: Any, nodes: tuple[str, str]) -> Iterator[Any]:
    """The application; yields (base_url, [replica entries], namespace info)."""
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    from cmx.deploy.app import build

    had_serve = any(a["name"] == "SERVE_CONTROLLER_ACTOR"
                    for a in ray.util.list_named_actors(all_namespaces=True))
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    port = _get_global_client().http_config.port  # Serve may already run on another port
    options = ServeOptions(model=MODEL, engine=ENGINE, replicas=2, max_replicas_per_node=1,
                           service=config, app_name=APP, route_prefix=PREFIX)
    serve.run(build(options), name=APP, route_prefix=PREFIX)
    base = f"http://127.0.0.1:{port}{PREFIX}"
    try:
        deadline = time.monotonic() + 120
        replicas: list[dict[str, str]] = []
        while time.monotonic() < deadline and len(replicas) < 2:
            replicas = httpx.get(f"{base}/cmx/replicas", timeout=60).json()["replicas"]
            time.sleep(0.5)
        assert len(replicas) == 2, replicas
        assert {r["node"] for r in replicas} == set(nodes), "one replica per node"
        info = httpx.get(f"{base}/cmx/info", timeout=60).json()
        yield base, replicas, info
    finally:
        serve.delete(APP)
        if not had_serve:
            serve.shutdown()


def client(base: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)


def complete(base: str, prompt: str, **extra: Any) -> Any:
    body = {"ignore_eos": True, **extra}
    return client(base).completions.create(model="cmx-llama-random", prompt=prompt,
                                           max_tokens=8, temperature=0, extra_body=body)


def namespace(cm: Any, info: dict[str, Any]) -> Any:
    from cmx.layout import KVLayout

    ns = info["namespace"]
    layout = KVLayout(ns["num_layers"], ns["num_kv_heads"], ns["head_dim"], ns["dtype"],
                      ns["block_tokens"])
    return cm.namespace(ns["model"], layout, ns["salt"], ns["weights"])


def wait_stored(cm: Any, info: dict[str, Any], prompt: str, tokens: int) -> None:
    ns = namespace(cm, info)
    ids = ByteTokenizer().encode(prompt)
    deadline = time.monotonic() + 30
    while ns.lookup(ids).num_tokens < tokens:
        assert time.monotonic() < deadline, "the store never became visible"
        time.sleep(0.2)


def agent_bytes_in(node: str) -> int:
    import ray

    from cmx.actors.links import RAY_NAMESPACE, actor_name

    stats = ray.get(ray.get_actor(actor_name("agent", node), namespace=RAY_NAMESPACE)
                    .stats.remote())
    return sum(n for route, n in stats["moved_bytes"].items() if "@peer" in route)


def test_a_prefix_stored_by_one_replica_is_served_by_the_other_with_the_same_tokens(
    llm: Any, cm: Any
) -> None:
    base, replicas, info = llm
    first, second = replicas
    question = SYSTEM + "Q: which tier is fastest?"
    stored = complete(base, question, replica=first["replica"])
    ext = stored.model_extra["cmx"]
    assert ext["replica"] == first["replica"] and ext["node"] == first["node"]
    assert ext["cached_tokens"] == 0 and ext["stored_tokens"] > 500
    wait_stored(cm, info, question, ext["stored_tokens"])

    before = agent_bytes_in(second["node"])
    prompt = SYSTEM + "Q: and which is the slowest one?"
    hit = complete(base, prompt, replica=second["replica"])
    hit_ext = hit.model_extra["cmx"]
    assert hit_ext["replica"] == second["replica"] and hit_ext["node"] == second["node"]
    cached = hit.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached == hit_ext["cached_tokens"]
    assert cached <= ext["stored_tokens"] and cached % info["chunk_tokens"] == 0
    assert sum(hit_ext["served_from"].values()) == cached
    assert agent_bytes_in(second["node"]) > before, "the prefix crossed from the other node"
    assert hit_ext["ttft_s"] > 0

    miss = complete(base, prompt, replica=second["replica"], cache=False)
    assert miss.usage.prompt_tokens_details.cached_tokens == 0
    assert miss.model_extra["cmx"]["completion_token_ids"] == hit_ext["completion_token_ids"]
    assert miss.choices[0].text == hit.choices[0].text


def test_cache_false_neither_loads_nor_stores(llm: Any, cm: Any) -> None:
    base, replicas, info = llm
    prompt = "A prompt nobody stored. " * 30
    r = complete(base, prompt, cache=False)
    ext = r.model_extra["cmx"]
    assert ext["cached_tokens"] == 0 and ext["matched_tokens"] == 0 and ext["stored_tokens"] == 0
    time.sleep(1.0)
    assert namespace(cm, info).lookup(ByteTokenizer().encode(prompt)).num_tokens == 0


def test_the_router_sends_a_request_to_the_node_holding_its_prefix(llm: Any, cm: Any) -> None:
    base, replicas, info = llm
    doc = "Document 7: the NVMe tier keeps its index across restarts. " * 12
    for holder in replicas:
        question = doc + f"Q: who? {holder['replica']}"
        seeded = complete(base, question, replica=holder["replica"])
        wait_stored(cm, info, question, seeded.model_extra["cmx"]["stored_tokens"])
        time.sleep(3.0)  # routing stats refresh every 2 s
        routed = complete(base, doc + "Q: and what does it keep?")
        assert routed.model_extra["cmx"]["replica"] == holder["replica"]
        doc = "Document 8: the DRAM tier is a shared-memory arena. " * 12


def test_chat_sampling_with_a_seed_repeats_and_models_lists_the_model(llm: Any) -> None:
    base, _, _ = llm
    c = client(base)
    assert [m.id for m in c.models.list().data] == ["cmx-llama-random"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]
    a = c.chat.completions.create(model="cmx-llama-random", messages=messages, max_tokens=6,
                                  temperature=0.9, top_p=0.9, seed=5)
    b = c.chat.completions.create(model="cmx-llama-random", messages=messages, max_tokens=6,
                                  temperature=0.9, top_p=0.9, seed=5)
    assert a.choices[0].message.role == "assistant"
    assert a.model_extra["cmx"]["completion_token_ids"] == \
        b.model_extra["cmx"]["completion_token_ids"]
    with pytest.raises(Exception, match="does not exist"):
        c.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
