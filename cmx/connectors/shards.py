"""An engine's KV heads shared across tensor-parallel degrees.

A tensor-parallel engine splits each layer's KV heads among its ranks: at TP=k each worker
holds ``num_kv_heads / k`` of them (or, when there are fewer heads than ranks, one head that
several ranks hold alike). The service keeps a model's blocks in two forms, so engines of any
degree share them:

- **whole**: every head of a block, in the model's namespace (what a TP=1 engine stores);
- **one head a namespace**: head ``h`` of a block in the namespace of ``head_model(model, h)``
  (what each rank of a TP>1 engine stores: only the heads it holds, each rank alone, no
  gather between ranks; a head several ranks hold is stored by the first of them).

A rank loads its heads from whichever form holds more of the prefix: from the whole blocks it
reads only its heads' bytes (a partial load, ``NamespaceClient.load(heads=...)``), from the
heads' namespaces each of its heads. The scheduler counts a block as cached only when every
head has it, in one form or the other, so every rank can load what it is offered. LMCache's
keys carry the world size and the worker id instead: its engines share only at one degree.

``HeadShards`` answers, for one salt, the calls the connector makes of a namespace (lookup,
load, load into the paged cache, store, prefetch), in whichever form each takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from cmx.client.matches import Match
from cmx.errors import LayoutMismatchError

if TYPE_CHECKING:
    from cmx.client.copy_out import Sink
    from cmx.client.namespaces import NamespaceClient
    from cmx.layout import KVLayout

__all__ = ["HeadPlan", "HeadShards", "HeadSink", "ShardMatch", "cut", "head_model"]


def head_model(model: str, head: int) -> str:
    """The model id of the namespace that holds KV head ``head`` of ``model``'s blocks."""
    return f"{model}#kv-head-{head}"


@dataclass(frozen=True)
class HeadPlan:
    """Which of a model's KV heads one engine process holds, and whether it stores them."""

    total: int  # the model's KV heads
    local: range  # the heads this process holds (of the model's), consecutive
    stores: bool = True  # False: another rank holds the same head and stores it
    tp: int = 1  # the engine's tensor-parallel degree
    rank: int = 0  # this process's rank (the scheduler's: 0)

    @classmethod
    def of(cls, total: int, tp: int, rank: int) -> HeadPlan:
        """vLLM's split: ``total / tp`` heads a rank, or with fewer heads than ranks each head
        held by ``tp / total`` consecutive ranks."""
        if total < 1 or tp < 1 or not 0 <= rank < tp:
            raise ValueError(f"no KV heads for rank {rank} of {tp} with {total} heads")
        if total >= tp:
            if total % tp:
                raise LayoutMismatchError(f"{total} KV heads do not split among {tp} ranks")
            per = total // tp
            return cls(total, range(rank * per, (rank + 1) * per), True, tp, rank)
        if tp % total:
            raise LayoutMismatchError(f"{tp} ranks do not share {total} KV heads evenly")
        replicas = tp // total
        head = rank // replicas
        return cls(total, range(head, head + 1), rank % replicas == 0, tp, rank)

    @classmethod
    def everything(cls, total: int, tp: int = 1) -> HeadPlan:
        """The scheduler's view: every head (a block is cached when every rank can load it)."""
        return cls(total, range(total), True, tp)

    @property
    def whole(self) -> bool:
        """Blocks are stored whole (one process holds every head)."""
        return self.tp == 1

    @property
    def storing_ranks(self) -> int:
        """Ranks that store a step's blocks (each reports how its stores ended)."""
        return min(self.tp, self.total)


@dataclass(frozen=True)
class ShardMatch(Match):
    """A lookup's answer in one of the two forms: ``parts`` holds the whole blocks' match
    (``whole``), or one match per head of the asker's, each cut to the shortest."""

    parts: tuple[Match, ...] = field(default=(), compare=False)
    whole: bool = field(default=True, compare=False)


def cut(match: Match, lo: int, hi: int) -> Match:
    """Blocks ``[lo, hi)`` of a match (of every part, for a ``ShardMatch``)."""
    if isinstance(match, ShardMatch):
        parts = tuple(cut(p, lo, hi) for p in match.parts)
        blocks = match.blocks[lo:hi]
        return ShardMatch(len(blocks) * _per_block(match), blocks, parts, match.whole)
    blocks = tuple(match.blocks[lo:hi])
    return Match(len(blocks) * _per_block(match), blocks)


def _per_block(match: Match) -> int:
    return match.num_tokens // match.num_blocks if match.num_blocks else 0


class HeadShards:
    """One salt's namespaces of a model: its whole blocks (``whole``) and each KV head's
    (``heads``), seen by a process that holds heads ``plan.local``."""

    def __init__(self, whole: NamespaceClient, heads: Sequence[NamespaceClient],
                 plan: HeadPlan, layout: KVLayout) -> None:
        if len(heads) != plan.total:
            raise ValueError(f"{len(heads)} head namespaces for {plan.total} heads")
        self.whole = whole
        self.heads = list(heads)
        self.plan = plan
        self.layout = layout  # the process's: its own heads only
        self.namespace = whole.namespace

    def clients(self) -> list[NamespaceClient]:
        return [self.whole, *self.heads]

    # -- lookups -------------------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], here_first: bool = False) -> ShardMatch:
        """The longer of the whole blocks' prefix and the prefix every local head holds."""
        best = self.whole.lookup(token_ids, here_first)
        answer = ShardMatch(best.num_tokens, best.blocks, (best,), True)
        if best.num_blocks >= len(token_ids) // self.layout.block_tokens:
            return answer
        parts = []
        for h in self.plan.local:
            part = self.heads[h].lookup(token_ids, here_first)
            if part.num_blocks <= best.num_blocks:
                return answer  # the heads together hold no more than the whole blocks
            parts.append(part)
        n = min(p.num_blocks for p in parts)
        shortest = min(parts, key=lambda p: p.num_blocks)
        T = self.layout.block_tokens
        return ShardMatch(n * T, shortest.blocks[:n], tuple(cut(p, 0, n) for p in parts), False)

    def prefetch(self, match: ShardMatch, first: int) -> None:
        """``NamespaceClient.prefetch_away`` of the match's blocks from ``first`` on."""
        clients = [self.whole] if match.whole else [self.heads[h] for h in self.plan.local]
        for client, part in zip(clients, match.parts):
            if part.num_blocks > first:
                client.prefetch_away(part.blocks[first:])

    # -- loads ---------------------------------------------------------------------------------

    def load(self, token_ids: Sequence[int], match: ShardMatch | None = None) -> Any:
        """KV [layers, 2, local heads, n, head_dim] of the match's blocks (a prefix)."""
        import torch

        match = match if match is not None else self.lookup(token_ids, True)
        if match.whole:
            if self._all_heads:
                return self.whole.load(token_ids, match.parts[0])
            return self.whole.load(token_ids, match.parts[0], heads=self.plan.local)
        kvs = [self.heads[h].load(token_ids, part)
               for h, part in zip(self.plan.local, match.parts)]
        n = min(kv.shape[3] for kv in kvs)
        return torch.cat([kv[:, :, :, :n] for kv in kvs], dim=2)

    def load_to(self, sink: Sink, token_ids: Sequence[int],
                match: ShardMatch | None = None) -> int:
        """The match's blocks into ``sink`` (the local heads of each block's place); returns
        the blocks every head of which landed, a prefix."""
        match = match if match is not None else self.lookup(token_ids, True)
        if match.whole and self._all_heads:
            return self.whole.load_to(sink, token_ids, match.parts[0])
        if match.whole:
            return _put_tensor(sink, self.load(token_ids, match), self.layout.block_tokens)
        shape = (self.layout.num_layers, 2, 1, self.layout.block_tokens, -1)
        got = [self.heads[h].load_to(HeadSink(sink, j, shape), token_ids, part)
               for j, (h, part) in enumerate(zip(self.plan.local, match.parts))]
        return min(got)

    def load_layers(self, token_ids: Sequence[int], match: ShardMatch | None = None) -> Any:
        """``NamespaceClient.load_layers``: whole blocks with every head as they come; else
        the prefix at the first group, each group a slice of it."""
        match = match if match is not None else self.lookup(token_ids, True)
        if match.whole and self._all_heads:
            return self.whole.load_layers(token_ids, match.parts[0])
        return WholeLoad(self.load(token_ids, match), self.layout.block_tokens)

    # -- stores --------------------------------------------------------------------------------

    def store(self, token_ids: Sequence[int], kv: Any, start: int = 0,
              grant_timeout_s: float | None = None) -> Any:
        """Whole blocks from an engine holding every head; else each local head's blocks in
        its own namespace (a tensor only: a paged source is read whole)."""
        if self.plan.whole:
            return self.whole.store(token_ids, kv, start, grant_timeout_s)
        if not hasattr(kv, "dim"):
            raise LayoutMismatchError("a tensor-parallel rank stores from a host tensor")
        self.layout.check_kv(kv)
        handles = [self.heads[h].store(token_ids, kv[:, :, j : j + 1], start, grant_timeout_s)
                   for j, h in enumerate(self.plan.local)]
        return HeadStores(handles)

    @property
    def _all_heads(self) -> bool:
        return len(self.plan.local) == self.plan.total


class HeadStores:
    """The stores of one save's heads, seen as one: committed is what every head committed."""

    def __init__(self, handles: Sequence[Any]) -> None:
        self.handles = list(handles)

    def wait(self, timeout_s: float | None = None) -> int:
        return min(h.wait(timeout_s) for h in self.handles)

    @property
    def refused(self) -> tuple[Any, ...]:
        return max((tuple(h.refused) for h in self.handles), key=len, default=())


class HeadSink:
    """A ``Sink`` of one KV head's blocks writing into head ``head`` of another sink's places
    (``cmx.client.copy_out.Sink``); ``shape`` is one head's payload, ``[layers, 2, 1, T, -1]``
    (the last in the sink's units)."""

    def __init__(self, sink: Sink, head: int, shape: tuple[int, ...]) -> None:
        self.sink = sink
        self.head = head
        self.shape = shape
        self.itemsize = sink.itemsize
        self.blocks = sink.blocks

    def put(self, i: int, index: tuple[slice, ...], src: np.ndarray) -> None:
        full = tuple(index) + (slice(None),) * (5 - len(index))  # [layers, 2, heads, T, dim]
        start, stop, _ = full[2].indices(1)
        heads = slice(self.head + start, self.head + stop)
        self.sink.put(i, (*full[:2], heads, *full[3:]), src)

    def put_run(self, i: int, rows: np.ndarray) -> None:
        for j, row in enumerate(rows):
            self.put(i + j, (slice(None),), row.reshape(self.shape))

    def clear(self, i: int) -> None:
        self.sink.clear(i)  # the block's other heads are of no use without this one


class WholeLoad:
    """A ``LayerLoad`` of a prefix already loaded: each group its layers' slice."""

    def __init__(self, kv: Any, block_tokens: int) -> None:
        self.kv = kv
        self._blocks = kv.shape[3] // block_tokens

    @property
    def blocks(self) -> int:
        return self._blocks

    def group(self, layers: range) -> Any:
        return self.kv[layers.start : layers.stop]

    def finish(self) -> int:
        return self._blocks

    def close(self) -> None:
        pass


def _put_tensor(sink: Sink, kv: Any, block_tokens: int) -> int:
    """A loaded, checked KV tensor into a sink, a block at a time; the blocks it held."""
    from cmx.client.copy_out import kv_bytes

    data = kv_bytes(kv)
    blocks = min(kv.shape[3] // block_tokens, sink.blocks)
    for i in range(blocks):
        sink.put(i, (slice(None),), data[:, :, :, i * block_tokens : (i + 1) * block_tokens])
    return blocks
