"""Tokenizing at the ingress, through the real FastAPI app of ``cmx.deploy.ingress``: a chat or a
text prompt far longer than any context is refused (an OpenAI-style 400) before the tokenizer
sees it, and a chat being tokenized leaves the event loop free for other requests.

The tokenizer is the real ``ChatTokenizer`` over a small Hugging Face tokenizer written here
(a word-level vocabulary and a chat template), subclassed to record its calls and, where a
scenario says so, to hold a chat call until the scenario lets it go. The replica is a stand-in
for the ``LLMServer`` handle, as in ``test_deploy_auth``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from ingress_standin import ReplicaStandIn, servable_dependency

from cmx.deploy.auth import current_tenancy
from cmx.deploy.config import EngineOptions, ServeOptions
from cmx.deploy.ingress import OpenAIIngress, app
from cmx.deploy.messages import ReplicaInfo
from cmx.deploy.model import ChatTokenizer

MAX_MODEL_LEN = 256
LIMIT = 64 * MAX_MODEL_LEN  # characters the ingress tokenizes at most
HOLD_BOUND_S = 10.0  # the longest a held chat call waits for its scenario
WORDS = ["[UNK]", "</s>", "user", "assistant", "system", ":", "hello", "ab"]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
NAMESPACE: dict[str, object] = {"model": "m", "weights": "w", "num_layers": 2, "num_kv_heads": 1,
                                "head_dim": 16, "dtype": "float16", "block_tokens": 32}
INFO = ReplicaInfo(replica="r1", node="n1", model="m", namespace=NAMESPACE, block_tokens=32,
                   max_model_len=MAX_MODEL_LEN, vocab_size=len(WORDS), cache=True)


def write_tokenizer(path: Path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(path))
    return str(path)


class RecordingTokenizer(ChatTokenizer):
    """The real tokenizer; records each call, and holds a chat call while ``hold`` is set up."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.calls: list[str] = []
        self.hold: threading.Event | None = None  # a chat call waits until this is set
        self.entered = threading.Event()  # a held chat call has begun
        self.returned = threading.Event()  # ... and has ended
        self.waited_out = False  # the held call ended at HOLD_BOUND_S, not when let go
        self.thread: str | None = None  # the thread a held call ran on

    def encode(self, text: str) -> list[int]:
        self.calls.append("encode")
        return super().encode(text)

    def chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        self.calls.append("chat")
        if self.hold is not None:
            self.thread = threading.current_thread().name
            self.entered.set()
            self.waited_out = not self.hold.wait(HOLD_BOUND_S)
            self.returned.set()
        return super().chat(messages)


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    tokenizer = RecordingTokenizer(write_tokenizer(tmp_path / "tokenizer"))
    monkeypatch.setattr("cmx.deploy.model.load_tokenizer", lambda _opts: tokenizer)
    replica = ReplicaStandIn(INFO, 6, "hello")
    args = ServeOptions(engine=EngineOptions(block_size=32,
                                             max_model_len=MAX_MODEL_LEN)).to_args()
    ingress = OpenAIIngress.__new__(OpenAIIngress)
    asyncio.run(OpenAIIngress.__init__(ingress, replica, args))  # Serve's wrapper: async
    # Outside a replica, Serve's context is missing: its two look-ups return this object.
    app.dependency_overrides[servable_dependency()] = lambda: ingress
    app.dependency_overrides[current_tenancy] = lambda: ingress.tenancy
    try:
        yield {"tokenizer": tokenizer, "replica": replica, "ingress": ingress}
    finally:
        app.dependency_overrides.clear()
        ingress._tokenizing.shutdown(wait=True)


def chat_body(content: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1}


def test_a_chat_over_the_cap_is_refused_before_the_tokenizer_sees_it(
    served: dict[str, Any],
) -> None:
    tokenizer, replica = served["tokenizer"], served["replica"]
    half = "ab " * (LIMIT // 6)  # two messages, each under the cap, together over it
    big = {"messages": [{"role": "system", "content": half},
                        {"role": "user", "content": half + "hello hello"}]}
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=big)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "messages"
        assert error["message"] == f"the messages have {2 * len(half) + 11} characters; " \
                                   f"at most {LIMIT}"
        text = client.post("/v1/completions", json={"prompt": "ab " * LIMIT, "max_tokens": 1})
        assert text.status_code == 400 and text.json()["error"]["param"] == "prompt"
        assert tokenizer.calls == [] and replica.requests == []

        ok = client.post("/v1/chat/completions", json=chat_body("hello ab"))
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["message"]["content"] == "hello"
    assert tokenizer.calls == ["chat"]
    ids = tokenizer.chat([{"role": "user", "content": "hello ab"}])
    assert replica.requests[0].prompt_ids == tuple(ids) == (2, 5, 6, 7, 3, 5)


def test_the_event_loop_serves_other_requests_while_a_chat_is_tokenized(
    served: dict[str, Any],
) -> None:
    tokenizer = served["tokenizer"]
    tokenizer.hold = threading.Event()

    async def scenario() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            chat = asyncio.create_task(client.post("/v1/chat/completions",
                                                   json=chat_body("hello ab")))
            entered = await asyncio.to_thread(tokenizer.entered.wait, HOLD_BOUND_S)
            models = await client.get("/v1/models")  # while the chat call is held
            seen = {"entered": entered, "models": models.status_code,
                    "chat_returned_first": tokenizer.returned.is_set()}
            tokenizer.hold.set()
            seen["chat"] = (await chat).status_code
            return seen

    seen = asyncio.run(scenario())
    assert seen == {"entered": True, "models": 200, "chat_returned_first": False, "chat": 200}
    assert not tokenizer.waited_out
    assert tokenizer.thread is not None and tokenizer.thread.startswith("cmx-tokenize")
    assert served["replica"].requests[0].prompt_ids == (2, 5, 6, 7, 3, 5)
