"""What an engine needs of the context memory, and the real one over ``NamespaceClient``.

Protocol, in call order, for one request:

1. ``prefetch(token_ids)`` when the request arrives: start moving its cached prefix to this node
   (returns a ``PendingPrefetch``, or None when nothing is cached).
2. ``lookup(token_ids)`` when the replica is free: the longest cached prefix, block by block,
   with the place each block would be loaded from.
3. ``load(found, n_tokens)``: the KV of the first ``n_tokens`` (a prefix of ``found``); may
   return fewer tokens (a block evicted meanwhile, a failed move): a miss, never wrong bytes.
4. ``store(token_ids, kv, start)``: hand the KV of ``token_ids[start:]``'s full blocks to the
   node's agent and return at once.

Fakes for tests subclass ``KVMemory``.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cmx.policies.breakeven import source_class

__all__ = ["Found", "KVMemory", "NamespaceMemory", "RefPrefetch"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    """The longest cached prefix of a prompt: for each block, where a load would take it from."""

    block_tokens: int
    sources: tuple[str, ...]  # source class per block: "dram", "nvme@peer", ...
    block_bytes: tuple[int, ...]  # payload size per block
    handle: Any = None  # the memory's own description (a client Match)

    @property
    def tokens(self) -> int:
        return len(self.sources) * self.block_tokens

    def blocks(self, n_tokens: int | None = None) -> list[tuple[str, int]]:
        """(source class, bytes) of the blocks covering the first ``n_tokens``."""
        n = len(self.sources) if n_tokens is None else n_tokens // self.block_tokens
        return list(zip(self.sources[:n], self.block_bytes[:n]))

    def served_from(self, start: int, end: int) -> dict[str, int]:
        """Tokens per source class among tokens ``[start, end)`` (whole blocks)."""
        T = self.block_tokens
        out: dict[str, int] = {}
        for source in self.sources[start // T : end // T]:
            out[source] = out.get(source, 0) + T
        return out


class KVMemory(ABC):
    node: str  # the node this memory loads to
    block_tokens: int

    @abstractmethod
    def lookup(self, token_ids: Sequence[int]) -> Found: ...

    @abstractmethod
    def load(self, token_ids: Sequence[int], found: Found, n_tokens: int) -> Any:
        """KV [layers, 2, kv_heads, n, head_dim] of the first ``n <= n_tokens`` tokens."""

    @abstractmethod
    def store(self, token_ids: Sequence[int], kv: Any, start: int) -> None: ...

    @abstractmethod
    def prefetch(self, token_ids: Sequence[int]) -> RefPrefetch | None: ...


class RefPrefetch:
    """A prefetch in flight: the agent call's ObjectRef (``PendingPrefetch`` for the policies)."""

    def __init__(self, ref: Any, started_s: float) -> None:
        self.ref = ref
        self.started_s = started_s  # time.monotonic() when it was asked for
        self.patience_s = float("inf")  # how long a free replica may wait for it (the plan's)
        self.sources: dict[str, int] = {}  # tokens it moves, per source class

    def on_done(self, callback: Any) -> None:
        """Call ``callback(seconds since started)`` once the move completes."""

        def done(_: Any) -> None:
            callback(time.monotonic() - self.started_s)

        self.ref.future().add_done_callback(done)

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def wait(self, timeout_s: float) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=max(0.0, timeout_s))
        return bool(ready)


class NamespaceMemory(KVMemory):
    """The service, through a ``NamespaceClient`` of this replica's node."""

    def __init__(self, ns: Any) -> None:
        self.ns = ns
        self.node = ns.cm.node_id
        self.block_tokens = ns.layout.block_tokens

    def lookup(self, token_ids: Sequence[int]) -> Found:
        match = self.ns.lookup(list(token_ids))
        sources = tuple(source_class(b.tier.value, b.node, self.node) for b in match.blocks)
        sizes = tuple(_size(b, self.ns.layout.block_bytes) for b in match.blocks)
        return Found(self.block_tokens, sources, sizes, match)

    def load(self, token_ids: Sequence[int], found: Found, n_tokens: int) -> Any:
        from cmx.client import Match

        n_blocks = n_tokens // self.block_tokens
        match = Match(n_blocks * self.block_tokens, tuple(found.handle.blocks[:n_blocks]))
        return self.ns.load(list(token_ids[: match.num_tokens]), match)

    def store(self, token_ids: Sequence[int], kv: Any, start: int) -> None:
        self.ns.store(list(token_ids), kv, start=start)

    def prefetch(self, token_ids: Sequence[int]) -> RefPrefetch | None:
        started = time.monotonic()
        ref = self.ns.prefetch(list(token_ids))
        return None if ref is None else RefPrefetch(ref, started)


def _size(block: Any, default: int) -> int:
    sizes = [c.size for c in getattr(block, "copies", ()) if getattr(c, "size", 0)]
    return sizes[0] if sizes else default
