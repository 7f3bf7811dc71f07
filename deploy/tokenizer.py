"""Tokenizers: a byte-level one for the built-in random model, and Hugging Face's for real ones.

``ByteTokenizer`` maps UTF-8 bytes to ids ``OFFSET + byte`` after a handful of special tokens.
It is deterministic, needs no file, and round-trips every text exactly, so a chat's next turn
re-tokenizes the earlier turns to the same ids and finds their blocks cached. Its chat template
marks roles with special tokens:

    <|bos|> <|system|> text <|end|> <|user|> text <|end|> <|assistant|>
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["ByteTokenizer", "HFTokenizer", "Message", "Tokenizer"]


@dataclass(frozen=True)
class Message:
    role: str  # "system", "user" or "assistant"
    content: str


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of a conversation, ending with the cue for the assistant's reply."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens; ids below ``OFFSET`` are the special tokens."""

    SPECIAL = ("<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>",
               "<|assistant|>")
    OFFSET = 8  # ids 0..7: the special tokens (one spare)

    def __init__(self) -> None:
        self.ids = {name: i for i, name in enumerate(self.SPECIAL)}
        self.bos_token_id = self.ids["<|bos|>"]
        self.eos_token_id: int | None = self.ids["<|eos|>"]
        self.vocab_size = self.OFFSET + 256
        # What a model may answer with: end of sequence, newline and printable ASCII.
        self.output_ids = [self.ids["<|eos|>"], self.OFFSET + 10,
                           *range(self.OFFSET + 32, self.OFFSET + 127)]

    def encode(self, text: str) -> list[int]:
        return [self.OFFSET + b for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        raw = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < self.OFFSET + 256)
        return raw.decode("utf-8", errors="replace")

    def chat(self, messages: Sequence[Message]) -> list[int]:
        out = [self.bos_token_id]
        for m in messages:
            role = self.ids.get(f"<|{m.role}|>")
            if role is None:
                raise ValueError(f"unknown role {m.role!r}: system, user or assistant")
            out += [role, *self.encode(m.content), self.ids["<|end|>"]]
        return out + [self.ids["<|assistant|>"]]


class HFTokenizer:
    """A Hugging Face tokenizer from a model directory, with its own chat template if it has one."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(path)
        self.eos_token_id = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def chat(self, messages: Sequence[Message]) -> list[int]:
        as_dicts = [{"role": m.role, "content": m.content} for m in messages]
        if getattr(self._tok, "chat_template", None):
            ids = self._tok.apply_chat_template(as_dicts, add_generation_prompt=True,
                                                tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        text = "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"
        return self.encode(text)
