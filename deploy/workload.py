"""The demo's workload: what a chat assistant over a few documents sees.

A long system prompt that every request starts with; documents asked about several times;
multi-turn conversations whose every turn repeats the turns before. Requests come in *waves*:
the requests of a wave arrive together (two users at once), so the router must weigh where a
prefix is against which replica is free. Texts are made from a seeded generator: the same
workload every run, nothing read from disk.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["Ask", "Conversation", "Message", "Workload", "make_workload"]


@dataclass(frozen=True)
class Message:
    role: str  # "system", "user" or "assistant"
    content: str

_WORDS = (
    "cache tier block prefix replica node memory bandwidth latency request token model layer "
    "head attention context window storage drive queue agent directory shard copy eviction "
    "policy prefetch load store commit pin lease checksum segment journal index snapshot "
    "transfer descriptor arena slot budget backpressure placement label host device serving "
    "engine scheduler batch decode prefill throughput capacity pressure hierarchy cluster"
).split()
_GLUE = ("the", "a", "each", "every", "its", "this", "that", "one", "no", "our")
_VERBS = ("moves", "holds", "keeps", "finds", "serves", "evicts", "loads", "stores", "pins",
          "checks", "names", "maps", "waits for", "reads", "writes")


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_GLUE), rng.choice(_WORDS), rng.choice(_VERBS), rng.choice(_GLUE),
             rng.choice(_WORDS)]
    words += [rng.choice(_WORDS) for _ in range(rng.randrange(0, 4))]
    text = " ".join(words)
    return text[0].upper() + text[1:] + "."


def _text(rng: random.Random, nbytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < nbytes:
        s = _sentence(rng)
        out.append(s)
        size += len(s) + 1
    return " ".join(out)


@dataclass(frozen=True)
class Ask:
    """One request: a question about a document, or the next turn of a conversation."""

    label: str
    document: str | None = None  # document name, for a question about it
    question: str = ""
    conversation: str | None = None  # conversation name, for a turn of it


@dataclass
class Conversation:
    history: list[Message] = field(default_factory=list)


@dataclass(frozen=True)
class Workload:
    system: str
    documents: dict[str, str]
    waves: tuple[tuple[Ask, ...], ...]
    max_tokens: int = 12  # reply length for questions about documents
    chat_max_tokens: int = 24  # reply length for conversation turns

    @property
    def requests(self) -> int:
        return sum(len(w) for w in self.waves)

    def messages(self, ask: Ask, conversations: dict[str, Conversation]) -> list[Message]:
        system = Message("system", self.system)
        if ask.document is not None:
            doc = self.documents[ask.document]
            return [system, Message("user", f"Document {ask.document}:\n{doc}\n\n"
                                            f"Question: {ask.question}")]
        conv = conversations.setdefault(ask.conversation or "", Conversation())
        return [system, *conv.history, Message("user", ask.question)]


def make_workload(seed: int = 0, scale: float = 1.0) -> Workload:
    """The demo's waves. ``scale`` multiplies every text's length (about 4 bytes a token)."""
    rng = random.Random(seed)
    system = ("You are the operations assistant of a context memory service for LLM serving. "
              "Answer from the documents you are given, in one or two short sentences, and "
              "say which tier a figure comes from. " + _text(rng, int(3000 * scale)))
    docs = {name: _text(rng, int(6000 * scale)) for name in ("A", "B")}

    def q(doc: str, i: int) -> Ask:
        return Ask(f"doc {doc} q{i}", document=doc,
                   question=f"({i}) " + _sentence(rng).rstrip(".") + "?")

    def turn(conv: str, i: int) -> Ask:
        return Ask(f"chat {conv} t{i}", conversation=conv,
                   question=_text(rng, int(800 * scale)) + " What should I check first?")

    waves = (
        (q("A", 1),),
        (q("A", 2),),
        (q("B", 1), q("A", 3)),
        (turn("X", 1),),
        (turn("X", 2), q("B", 2)),
        (turn("X", 3), turn("Y", 1)),
        (turn("Y", 2), q("A", 4)),
    )
    return Workload(system, docs, waves)
