"""The OpenAI wire format: request bodies (pydantic, at the HTTP edge) and response bodies.

Extensions, all optional: ``cache`` (false: bypass the context memory for this request),
``ignore_eos`` (as in vLLM), ``replica`` (route to this replica id), and in every response a
``cmx`` object: time to first token, cached tokens, the tier that served them, the plan.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cmx.deploy.messages import GenerateResult

__all__ = ["ChatMessage", "ChatRequest", "CompletionRequest", "chat_body", "completion_body",
           "models_body"]


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are accepted and ignored

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1
    cache: bool = True  # extension: false bypasses the context memory
    ignore_eos: bool = False  # extension (vLLM's): generate max_tokens whatever comes
    replica: str | None = None  # extension: route to this replica id if it exists

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("one prompt per request")
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content
                       if part.get("type", "text") == "text")


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16


def _usage(r: GenerateResult) -> dict[str, Any]:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": len(r.token_ids),
        "total_tokens": r.prompt_tokens + len(r.token_ids),
        "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
    }


def cmx_extension(r: GenerateResult, elapsed_s: float) -> dict[str, Any]:
    t = r.timings
    return {
        "ttft_s": round(t.ttft_s, 6),
        "cached_tokens": r.cached_tokens,
        "matched_tokens": r.matched_tokens,
        "served_from": r.served_from,
        "prefetched_from": r.prefetched_from,
        "stored_tokens": r.stored_tokens,
        "plan": r.plan,
        "prefetch": r.prefetch,
        "timings": {k: round(v, 6) for k, v in vars(t).items()},
        "elapsed_s": round(elapsed_s, 6),  # at the ingress, request in -> response out
        "replica": r.replica,
        "node": r.node,
        "completion_token_ids": list(r.token_ids),
    }


def completion_body(r: GenerateResult, model: str, elapsed_s: float) -> dict[str, Any]:
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:24]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": r.text, "finish_reason": r.finish_reason,
                     "logprobs": None}],
        "usage": _usage(r),
        "cmx": cmx_extension(r, elapsed_s),
    }


def chat_body(r: GenerateResult, model: str, elapsed_s: float) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "finish_reason": r.finish_reason, "logprobs": None,
                     "message": {"role": "assistant", "content": r.text}}],
        "usage": _usage(r),
        "cmx": cmx_extension(r, elapsed_s),
    }


def models_body(model: str) -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": model, "object": "model", "created": 0, "owned_by": "cmx"}]}
