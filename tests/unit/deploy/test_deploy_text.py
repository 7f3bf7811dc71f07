"""The OpenAI request bodies and their bounds, the replies built from replica streams, tenants'
salts, and the demo's workload."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cmx.deploy.messages import Delta, Summary
from cmx.deploy.openai_bodies import Reply
from cmx.deploy.openai_types import MAX_N, MAX_STOP_CHARS, ChatRequest, CompletionRequest
from cmx.deploy.tenants import UnknownKeyError, bearer_key, tenant_salt
from cmx.deploy.workload import Conversation, make_workload


def test_the_workload_is_deterministic_and_shares_prefixes() -> None:
    w1, w2 = make_workload(seed=3), make_workload(seed=3)
    assert w1 == w2 and w1.requests == 11
    convs: dict[str, Conversation] = {}
    asks = [a for wave in w1.waves for a in wave]
    first_doc = [w1.messages(a, convs) for a in asks if a.document == "A"]
    assert len(first_doc) == 4
    assert all(m[0] == first_doc[0][0] for m in first_doc)  # the same system prompt
    assert make_workload(seed=3, scale=0.5).documents["A"] != w1.documents["A"]


def test_openai_bodies_accept_the_extensions() -> None:
    c = CompletionRequest.model_validate({"prompt": "hi", "cache": False, "replica": "r1",
                                          "temperature": 0, "stop": "x", "logit_bias": {},
                                          "n": 2, "stream": True, "cache_salt": "s",
                                          "stream_options": {"include_usage": True}})
    assert c.cache is False and c.replica == "r1" and c.stops() == ("x",) and c.n == 2
    assert c.include_usage and c.cache_salt == "s"
    assert CompletionRequest.model_validate({"prompt": [[1, 2]]}).single_prompt() == [1, 2]
    with pytest.raises(ValueError):
        CompletionRequest.model_validate({"prompt": ["a", "b"]}).single_prompt()
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    chat = ChatRequest.model_validate({"messages": [{"role": "developer", "content": parts}],
                                       "max_completion_tokens": 3})
    assert chat.as_dicts() == [{"role": "system", "content": "ab"}] and chat.limit() == 3


@pytest.mark.parametrize("body", [
    {"prompt": [-1, 5]},  # a negative token id
    {"prompt": [[3, -7]]},
    {"prompt": [1.5]},  # not an integer
    {"prompt": "hi", "stop": ["x"] * 5},  # too many stop strings
    {"prompt": "hi", "stop": "y" * (MAX_STOP_CHARS + 1)},  # one too long
    {"prompt": "hi", "stop": [""]},  # an empty one
    {"prompt": "hi", "n": MAX_N + 1},
    {"prompt": "hi", "n": "2"},  # wrong types are not coerced
    {"prompt": "hi", "stream": "yes"},
    {"prompt": "hi", "max_tokens": 0},
    {"prompt": "hi", "seed": 2**64},
    {"prompt": "hi", "temperature": float("nan")},
    {"prompt": "hi", "cache_salt": ""},
    {"prompt": 7},
])
def test_malformed_completion_bodies_are_refused(body: dict) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "robot", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": [{"role": "user", "content": 5}]},
])
def test_malformed_chat_bodies_are_refused(body: dict) -> None:
    with pytest.raises(ValidationError):
        ChatRequest.model_validate(body)


def _summary(cached: int = 4) -> Summary:
    return Summary(prompt_tokens=10, cached_tokens=cached, loaded_tokens=cached, ttft_s=0.1,
                   total_s=0.2, prefetch="none", replica="r", node="n")


def test_a_reply_assembles_choices_from_deltas_and_reports_usage() -> None:
    reply = Reply("chat", "m", n=2)
    for d in (Delta(0, (1,), "a"), Delta(1, (5,), "x"), Delta(0, (2, 3), "bc", "stop"),
              Delta(1, (6,), "y", "length")):
        reply.add(d)
    reply.summary = _summary()
    body = reply.body()
    assert [c["message"]["content"] for c in body["choices"]] == ["abc", "xy"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    assert body["cmx"]["completion_token_ids"] == [[1, 2, 3], [5, 6]]


def test_stream_chunks_name_the_role_once_per_choice_and_end_with_the_usage() -> None:
    reply = Reply("chat", "m", n=1)
    first = reply.chunk([Delta(0, (1,), "a")])
    second = reply.chunk([Delta(0, (2,), "b", "stop")])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert second["choices"][0]["delta"] == {"content": "b"}
    assert first["object"] == "chat.completion.chunk" and first["id"] == second["id"]
    reply.add(Delta(0, (1, 2), "ab", "stop"))
    reply.summary = _summary(cached=0)
    last = reply.usage_chunk()
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
    completion = Reply("completion", "m", n=1).chunk([Delta(0, (1,), "z")])
    assert completion["object"] == "text_completion" and completion["choices"][0]["text"] == "z"


def test_tenants_get_their_own_salt_and_no_key_keeps_the_deployments() -> None:
    assert bearer_key("Bearer k1") == "k1" and bearer_key("bearer  k2 ") == "k2"
    assert bearer_key(None) is None and bearer_key("") is None  # no key: sent none
    for malformed in ("Basic abc", "Bearer ", "Bearer", "Bearer\tk1", "Token k1", "Bearer a b"):
        with pytest.raises(UnknownKeyError, match="malformed"):
            bearer_key(malformed)
    assert tenant_salt("", None, None) == "" and tenant_salt("d", None, None) == "d"
    salts = {tenant_salt("", "k1", None), tenant_salt("", "k2", None),
             tenant_salt("", None, "k1"), tenant_salt("", "k1", "s"), tenant_salt("d", "k1", None)}
    assert len(salts) == 5  # a key and a cache_salt of the same text are different tenants
    assert tenant_salt("", "k1", None) == tenant_salt("", "k1", None)
    # Length-prefixed parts: moving text from one part to the next changes the salt.
    assert tenant_salt("", "ab", "c") != tenant_salt("", "a", "bc")
    assert "k1" not in tenant_salt("", "k1", None)
