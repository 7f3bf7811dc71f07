"""The OpenAI wire format's response bodies: whole ones, stream chunks, errors.

A reply is assembled from a replica's stream (``Delta`` lists, then a ``Summary``) by
``Reply``; the same deltas become server-sent events when the client streams. Every response
carries a ``cmx`` object: time to first token, the tokens that came from the context memory,
the replica, and each choice's token ids (so a client can compare runs token for token).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from cmx.deploy.messages import Delta, Summary

__all__ = ["Kind", "Reply", "error_body", "models_body", "sse"]

Kind = Literal["completion", "chat"]
_OBJECT = {"completion": "text_completion", "chat": "chat.completion"}
_PREFIX = {"completion": "cmpl", "chat": "chatcmpl"}


def error_body(status: int, message: str, kind: str = "invalid_request_error",
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def models_body(model: str, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                        "owned_by": "cmx", "max_model_len": max_model_len}]}


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Reply:
    """One response being assembled; ``chunk`` renders deltas as they come (streaming)."""

    kind: Kind
    model: str
    n: int
    id: str = ""
    created: int = 0
    choices: list[_Choice] = field(default_factory=list)
    summary: Summary | None = None
    _started: set[int] = field(default_factory=set)  # choices whose first chunk went out

    def __post_init__(self) -> None:
        self.id = self.id or f"{_PREFIX[self.kind]}-{uuid.uuid4().hex[:24]}"
        self.created = self.created or int(time.time())
        self.choices = [_Choice() for _ in range(self.n)]

    def add(self, delta: Delta) -> None:
        c = self.choices[delta.index]
        c.text += delta.text
        c.token_ids += delta.token_ids
        c.finish_reason = delta.finish_reason or c.finish_reason

    def usage(self) -> dict[str, Any]:
        s = self.summary
        prompt = s.prompt_tokens if s else 0
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": s.cached_tokens if s else 0}}

    def extension(self) -> dict[str, Any]:
        s = self.summary
        if s is None:
            return {}
        return {"ttft_s": round(s.ttft_s, 6), "total_s": round(s.total_s, 6),
                "cached_tokens": s.cached_tokens, "loaded_tokens": s.loaded_tokens,
                "prefetch": s.prefetch, "replica": s.replica, "node": s.node,
                "memory": s.memory,
                "completion_token_ids": [c.token_ids for c in self.choices]}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self) -> dict[str, Any]:
        """The whole response (``stream`` false)."""
        choices = []
        for i, c in enumerate(self.choices):
            choice: dict[str, Any] = {"index": i, "finish_reason": c.finish_reason,
                                      "logprobs": None}
            if self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            choices.append(choice)
        return {**self._head(_OBJECT[self.kind]), "choices": choices, "usage": self.usage(),
                "cmx": self.extension()}

    def chunk(self, deltas: list[Delta]) -> dict[str, Any]:
        """A stream chunk with these deltas (a choice's first chat chunk names its role)."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        choices = []
        for d in deltas:
            choice: dict[str, Any] = {"index": d.index, "finish_reason": d.finish_reason,
                                      "logprobs": None}
            if self.kind == "chat":
                first = d.index not in self._started
                self._started.add(d.index)
                choice["delta"] = {"role": "assistant", "content": d.text} if first \
                    else {"content": d.text}
            else:
                choice["text"] = d.text
            choices.append(choice)
        return {**self._head(obj), "choices": choices}

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage(),
                "cmx": self.extension()}
