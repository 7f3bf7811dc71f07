"""What a lookup finds, and what the parts of a load read of the namespace that asked.

The parts below the facade (loads through the agent, partial loads) take a ``Reader``: the
namespace's layout and key space, and its client's node, link and plane. ``NamespaceClient``
is one; the parts never import it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, overload

import numpy as np

from cmx.protocol import Copy
from cmx.tiers import Tier

if TYPE_CHECKING:
    from cmx.client.node_plane import NodePlane
    from cmx.config import ServiceConfig
    from cmx.copy_table import CopyTable
    from cmx.keys import BlockHash, Namespace
    from cmx.layout import KVLayout

__all__ = ["BlockLocation", "Blocks", "Client", "Match", "Node", "Reader", "block_keys",
           "block_places", "held_here", "in_memory_here"]


@dataclass(frozen=True)
class BlockLocation:
    key: BlockHash
    tier: Tier  # the fastest tier holding a copy
    node: str  # where that copy is
    copies: tuple[Copy, ...]


@dataclass(frozen=True)
class Match:
    """The longest committed prefix of a token sequence."""

    num_tokens: int
    blocks: Sequence[BlockLocation]  # a lookup's are ``Blocks``; equal to their tuple

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class Blocks(Sequence[BlockLocation]):
    """A lookup's blocks as columns: their keys, their copies (``cmx.copy_table``) and each
    one's best copy for ``node``. A ``BlockLocation`` is made when it is first read, and kept,
    so a lookup of 62,500 blocks makes none and a reader of a few makes a few. Equal to the
    tuple of the same locations; a slice is a ``Blocks`` over the same columns."""

    def __init__(self, keys: Sequence[BlockHash], table: CopyTable, node: str) -> None:
        best = table.best(node)
        if len(keys) != len(table) or (best < 0).any():
            raise ValueError(f"{len(keys)} keys, {len(table)} with {int((best >= 0).sum())} "
                             "found: a lookup's blocks are keys found, one a row")
        self._keys, self._table, self._best, self._node = keys, table, best, node
        self._lo, self._hi = 0, len(keys)
        # shared with slices: each location once made, and the columns as lists (made at the
        # first read: a location is then a few list reads, not numpy scalars)
        self._made: list[BlockLocation | None] = [None] * len(keys)
        self._rows: list[list[Any]] = []

    def __len__(self) -> int:
        return self._hi - self._lo

    @overload
    def __getitem__(self, i: int) -> BlockLocation: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[BlockLocation]: ...

    def __getitem__(self, i: int | slice) -> BlockLocation | Sequence[BlockLocation]:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return tuple(self[j] for j in range(start, stop, step))
            part = copy.copy(self)
            part._lo, part._hi = self._lo + start, self._lo + max(start, stop)
            return part
        if not -len(self) <= i < len(self):
            raise IndexError(f"block {i} of {len(self)}")
        return self._at(self._lo + i % len(self))

    def __iter__(self) -> Iterator[BlockLocation]:
        return map(self._at, range(self._lo, self._hi))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Blocks({len(self)} blocks)"

    def keys(self) -> list[BlockHash]:
        """Each block's key, read from the column: no location made."""
        return list(self._keys[self._lo : self._hi])

    def places(self) -> list[tuple[Tier, str]]:
        """Each block's best copy as (tier, node), read from the columns: no location made."""
        table = self._table
        return [table.places[p] for p in table.place[self._best[self._lo : self._hi]].tolist()]

    def held_here(self, node: str) -> int:
        """``held_here`` of these blocks, over the columns."""
        table = self._table
        memory = np.array([_in_memory(t, n, node) for t, n in table.places] or [False])
        away = np.flatnonzero(~memory[table.place[self._best[self._lo : self._hi]]])
        return int(away[0]) if away.size else len(self)

    def _at(self, i: int) -> BlockLocation:
        made = self._made[i]
        if made is not None:
            return made
        table = self._table
        if not self._rows:
            self._rows += [table.starts.tolist(), table.counts.tolist(), table.place.tolist(),
                           table.size.tolist(), table.checksum.tolist(), self._best.tolist()]
        starts, counts, place, size, checksum, best = self._rows
        places = table.places
        copies = tuple(Copy(places[place[r]][0], places[place[r]][1], size[r], checksum[r])
                       for r in range(starts[i], starts[i] + counts[i]))
        tier, node = places[place[best[i]]]
        made = self._made[i] = BlockLocation(self._keys[i], tier, node, copies)
        return made


def block_keys(blocks: Sequence[BlockLocation]) -> list[BlockHash]:
    """The keys of ``blocks``, a lookup's (``Blocks``: from its column) or any."""
    return blocks.keys() if isinstance(blocks, Blocks) else [b.key for b in blocks]


def block_places(blocks: Sequence[BlockLocation]) -> list[tuple[Tier, str]]:
    """Where the best copy of each of ``blocks`` is, as (tier, node) (``Blocks.places``)."""
    return blocks.places() if isinstance(blocks, Blocks) else [(b.tier, b.node) for b in blocks]


def in_memory_here(block: BlockLocation, node: str) -> bool:
    """Whether the lookup found a copy of ``block`` in ``node``'s memory (HBM or DRAM): its
    best copy is one (``best_copy`` puts a copy on ``node`` first, the fastest tier next)."""
    return _in_memory(block.tier, block.node, node)


def _in_memory(tier: Tier, where: str, node: str) -> bool:
    return where == node and tier in (Tier.HBM, Tier.DRAM)


def held_here(match: Match, node: str) -> int:
    """How many leading blocks of ``match`` the lookup found in ``node``'s memory."""
    if isinstance(match.blocks, Blocks):
        return match.blocks.held_here(node)
    for i, b in enumerate(match.blocks):
        if not in_memory_here(b, node):
            return i
    return len(match.blocks)


class Node(Protocol):
    """The client as a load's parts see it: this node, the service's settings, the calls."""

    @property
    def node_id(self) -> str: ...

    @property
    def config(self) -> ServiceConfig: ...

    @property
    def link(self) -> Any: ...

    @property
    def plane(self) -> NodePlane: ...


class Client(Node, Protocol):
    """The client as a namespace sees it: a node that also asks the directory."""

    def copies(self, keys: Sequence[BlockHash]) -> list[list[Copy]]: ...

    def copy_table(self, keys: Sequence[BlockHash]) -> CopyTable: ...


class Reader(Protocol):
    """A namespace as a load's parts see it (``NamespaceClient`` is one)."""

    @property
    def cm(self) -> Node: ...

    @property
    def layout(self) -> KVLayout: ...

    @property
    def namespace(self) -> Namespace: ...

    @property
    def verify(self) -> bool: ...
