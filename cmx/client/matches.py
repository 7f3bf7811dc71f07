"""What a lookup finds, and what the parts of a load read of the namespace that asked.

The parts below the facade (loads through the agent, partial loads) take a ``Reader``: the
namespace's layout and key space, and its client's node, link and plane. ``NamespaceClient``
is one; the parts never import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cmx.protocol import Copy
from cmx.tiers import Tier

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cmx.client.node_plane import NodePlane
    from cmx.config import ServiceConfig
    from cmx.keys import BlockHash, Namespace
    from cmx.layout import KVLayout

__all__ = ["BlockLocation", "Client", "Match", "Node", "Reader", "held_here", "in_memory_here"]


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
    blocks: tuple[BlockLocation, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


def in_memory_here(block: BlockLocation, node: str) -> bool:
    """Whether the lookup found a copy of ``block`` in ``node``'s memory (HBM or DRAM): its
    best copy is one (``best_copy`` puts a copy on ``node`` first, the fastest tier next)."""
    return block.node == node and block.tier in (Tier.HBM, Tier.DRAM)


def held_here(match: Match, node: str) -> int:
    """How many leading blocks of ``match`` the lookup found in ``node``'s memory."""
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
