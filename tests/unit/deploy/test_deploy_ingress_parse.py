"""Decoding a body at the ingress, through the real FastAPI app of ``cmx.deploy.ingress``: the
JSON and its validation run on the ingress's parse threads, so a big body being decoded leaves
the event loop free for other requests; token ids past the context are refused by their count.

The request model is the real ``CompletionRequest``, subclassed to hold its validation while a
scenario says so; the replica is a stand-in for the ``LLMServer`` handle, as in
``test_deploy_auth``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from ingress_standin import ReplicaStandIn, servable_dependency

from cmx.deploy.auth import current_tenancy
from cmx.deploy.config import EngineOptions, ServeOptions
from cmx.deploy.ingress import OpenAIIngress, app
from cmx.deploy.messages import ReplicaInfo
from cmx.deploy.openai_types import CompletionRequest

MAX_MODEL_LEN = 256
HOLD_BOUND_S = 10.0  # the longest a held validation waits for its scenario
NAMESPACE: dict[str, object] = {"model": "m", "weights": "w", "num_layers": 2, "num_kv_heads": 1,
                                "head_dim": 16, "dtype": "float16", "block_tokens": 32}
INFO = ReplicaInfo(replica="r1", node="n1", model="m", namespace=NAMESPACE, block_tokens=32,
                   max_model_len=MAX_MODEL_LEN, vocab_size=1000, cache=True)


class Held:
    """A validation held until ``release`` is set, and where and how it ran."""

    release = threading.Event()
    entered = threading.Event()
    thread: str | None = None
    waited_out = False  # the held call ended at HOLD_BOUND_S, not when let go


class HeldCompletionRequest(CompletionRequest):
    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> CompletionRequest:
        Held.thread = threading.current_thread().name
        Held.entered.set()
        Held.waited_out = not Held.release.wait(HOLD_BOUND_S)
        return CompletionRequest.model_validate(obj, **kwargs)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    monkeypatch.setattr("cmx.deploy.model.load_tokenizer", lambda _opts: None)
    replica = ReplicaStandIn(INFO, 7, "x")
    args = ServeOptions(engine=EngineOptions(block_size=32,
                                             max_model_len=MAX_MODEL_LEN)).to_args()
    ingress = OpenAIIngress.__new__(OpenAIIngress)
    asyncio.run(OpenAIIngress.__init__(ingress, replica, args))  # Serve's wrapper: async
    # Outside a replica, Serve's context is missing: its two look-ups return this object.
    app.dependency_overrides[servable_dependency()] = lambda: ingress
    app.dependency_overrides[current_tenancy] = lambda: ingress.tenancy
    try:
        yield {"replica": replica, "ingress": ingress}
    finally:
        app.dependency_overrides.clear()
        ingress._parsing.shutdown(wait=True)
        ingress._tokenizing.shutdown(wait=True)


def test_the_event_loop_serves_other_requests_while_a_body_is_decoded(
    served: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("cmx.deploy.ingress.CompletionRequest", HeldCompletionRequest)
    Held.release.clear()
    Held.entered.clear()

    async def scenario() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            completion = asyncio.create_task(client.post(
                "/v1/completions", json={"prompt": list(range(1, 65)), "max_tokens": 1}))
            entered = await asyncio.to_thread(Held.entered.wait, HOLD_BOUND_S)
            models = await client.get("/v1/models")  # while the body's validation is held
            seen = {"entered": entered, "models": models.status_code,
                    "released_first": Held.release.is_set()}
            Held.release.set()
            seen["completion"] = (await completion).status_code
            return seen

    seen = asyncio.run(scenario())
    assert seen == {"entered": True, "models": 200, "released_first": False, "completion": 200}
    assert not Held.waited_out
    assert Held.thread is not None and Held.thread.startswith("cmx-parse")
    assert served["replica"].requests[0].prompt_ids == tuple(range(1, 65))


def test_token_ids_past_the_context_are_refused_by_their_count(served: dict[str, Any]) -> None:
    from fastapi.testclient import TestClient

    past = [5000] * (MAX_MODEL_LEN + 1)  # outside the vocabulary, too: the count is said
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": past, "max_tokens": 1})
        big = client.post("/v1/completions", content=b"[" + b"1," * (5 << 20) + b"1]",
                          headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "the prompt has 257" in r.json()["error"]["message"]
    assert big.status_code == 413, big.text  # over MAX_BODY_BYTES, refused unread
    assert served["replica"].requests == []
