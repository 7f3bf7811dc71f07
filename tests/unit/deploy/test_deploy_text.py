"""The byte tokenizer, the demo's workload, and the OpenAI request bodies."""

from __future__ import annotations

import pytest

from cmx.deploy.openai_types import ChatRequest, CompletionRequest
from cmx.deploy.tokenizer import ByteTokenizer, Message
from cmx.deploy.workload import Conversation, make_workload


def test_bytes_round_trip_and_ids_stay_clear_of_the_special_tokens() -> None:
    tok = ByteTokenizer()
    text = "Prefix caching, für alle — 東京"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and min(ids) >= tok.OFFSET
    assert len(ids) == len(text.encode())


def test_a_chat_is_a_prefix_of_its_next_turn() -> None:
    tok = ByteTokenizer()
    first = [Message("system", "Be brief."), Message("user", "Hi")]
    second = first + [Message("assistant", "Hello"), Message("user", "Bye")]
    a, b = tok.chat(first), tok.chat(second)
    assert b[: len(a) - 1] == a[:-1]  # all but the assistant cue
    assert a[-1] == tok.ids["<|assistant|>"]
    with pytest.raises(ValueError):
        tok.chat([Message("robot", "x")])


def test_the_workload_is_deterministic_and_shares_prefixes() -> None:
    w1, w2 = make_workload(seed=3), make_workload(seed=3)
    assert w1 == w2 and w1.requests == 11
    convs: dict[str, Conversation] = {}
    asks = [a for wave in w1.waves for a in wave]
    first_doc = [w1.messages(a, convs) for a in asks if a.document == "A"]
    assert len(first_doc) == 4
    assert all(m[0] == first_doc[0][0] for m in first_doc)  # the same system prompt
    assert 800 < len(w1.system) < 1200 and all(1600 < len(d) < 1900 for d in w1.documents.values())
    assert make_workload(seed=3, scale=0.5).documents["A"] != w1.documents["A"]


def test_openai_bodies_accept_the_extensions_and_reject_what_is_unsupported() -> None:
    c = CompletionRequest.model_validate({"prompt": "hi", "cache": False, "replica": "r1",
                                          "temperature": 0, "stop": "x", "logit_bias": {}})
    assert c.cache is False and c.replica == "r1" and c.stops() == ("x",)
    assert CompletionRequest.model_validate({"prompt": [[1, 2]]}).single_prompt() == [1, 2]
    with pytest.raises(ValueError):
        CompletionRequest.model_validate({"prompt": ["a", "b"]}).single_prompt()
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    chat = ChatRequest.model_validate({"messages": [{"role": "user", "content": parts}],
                                       "max_completion_tokens": 3})
    assert chat.messages[0].text() == "ab" and chat.limit() == 3
    with pytest.raises(ValueError):
        ChatRequest.model_validate({"messages": []})
