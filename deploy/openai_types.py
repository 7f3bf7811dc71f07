"""The OpenAI wire format's request bodies (pydantic, at the HTTP edge), strictly bounded.

Every field is typed and bounded here, so a malformed body is a 400 before anything runs:
negative token ids, more than ``MAX_STOPS`` stop strings or one longer than ``MAX_STOP_CHARS``,
``n`` over ``MAX_N``, a salt of the wrong shape. Limits that depend on the model (vocabulary,
context length) are checked by the ingress against the served model.

Extensions, all optional: ``cache`` (false: neither load from nor store to the context memory,
and no engine-local prefix reuse either: the request is computed from scratch), ``ignore_eos``
and ``cache_salt`` (as in vLLM), ``replica`` (route to this replica id, for tests and
benchmarks).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

__all__ = ["MAX_N", "MAX_STOPS", "MAX_STOP_CHARS", "ChatMessage", "ChatRequest",
           "CompletionRequest", "StreamOptions"]

MAX_N = 8  # choices per request
MAX_STOPS = 4  # stop strings per request (OpenAI's own limit)
MAX_STOP_CHARS = 256  # characters per stop string
MAX_SALT_CHARS = 256
MAX_MESSAGES = 1024

TokenId = Annotated[StrictInt, Field(ge=0)]
Seed = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool = False  # a last chunk with the usage and no choices


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are accepted and ignored

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    cache: StrictBool = True  # extension: false computes the request from scratch
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)
    ignore_eos: StrictBool = False  # extension (vLLM's): generate max_tokens whatever comes
    replica: str | None = Field(None, max_length=256)  # extension: route to this replica id

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        for s in stops:
            if not 1 <= len(s) <= MAX_STOP_CHARS:
                raise ValueError(f"a stop sequence has 1 to {MAX_STOP_CHARS} characters, "
                                 f"got {len(s)}")
        return stop

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: StrictInt | None = Field(16, ge=1)

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request (a batch of several is refused)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("one prompt per request")
            return p[0]
        return p  # type: ignore[return-value]  # a str or token ids here


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)

    def limit(self) -> int | None:
        """The most tokens to generate; None: as many as the context leaves."""
        return self.max_completion_tokens or self.max_tokens

    def as_dicts(self) -> list[dict[str, Any]]:
        """The messages as a chat template takes them ("developer" speaks as the system)."""
        roles = {"developer": "system"}
        return [{"role": roles.get(m.role, m.role), "content": m.text()} for m in self.messages]
