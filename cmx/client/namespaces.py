"""A namespace of the context memory: store, look up and load the KV of token sequences.

A load takes the longest cached prefix in two parts. What this node holds in memory (HBM or
DRAM) is pinned in one round trip to the node's tiers (``NodePlane.pin_prefix``, no directory
lookup) and copied out of their shared memory here, each block checked against its checksum.
The rest is looked up in the directory and moved into this node's HBM by its agent, from NVMe,
another node or the pool, and copied out the same way. Pins are leases: they are let go one
way after the copy, or expire.

A lookup is answered the same way: the prefix this node holds committed in memory from the
tiers' own books (``NodePlane.held``, one round trip), and only the rest from the
directory, one batched call per shard. Keys are chained from the namespace's digest, so a
namespace finds only its own blocks, here as in the directory.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cmx.client.copy_out import Sink, as_sink, copy_payloads, copy_verified, empty_kv
from cmx.client.loads import load_through_agent, window_blocks
from cmx.client.matches import (
    BlockLocation,
    Blocks,
    Client,
    Match,
    block_keys,
    held_here,
    in_memory_here,
)
from cmx.client.stores import Source, StoreHandle, TensorSource, store_into_dram
from cmx.copy_table import CopyTable
from cmx.doors import Prefetch
from cmx.errors import CmxError, LayoutMismatchError
from cmx.keys import BlockHash, Namespace, chain_keys
from cmx.protocol import actor_name
from cmx.selection import IndexSpec, Selection

if TYPE_CHECKING:
    from cmx.client.layer_loads import LayerLoad

__all__ = [
    "BlockLocation", "Match", "NamespaceClient", "StoreHandle", "copy_payloads",
    "copy_verified",
]

log = logging.getLogger(__name__)


class NamespaceClient:
    def __init__(
        self, cm: Client, namespace: Namespace, replication: int | None = None
    ) -> None:
        self.cm = cm
        self.namespace = namespace
        self.layout = namespace.layout
        self.replication = replication
        # Every block is checked as it is copied out; only a benchmark of what checking
        # costs turns this off.
        self.verify = True

    def keys(self, token_ids: object) -> list[BlockHash]:
        return chain_keys(self.namespace.digest, token_ids, self.layout.block_tokens)

    def store(self, token_ids: object, kv: Any, start: int = 0,
              grant_timeout_s: float | None = None) -> StoreHandle:
        """Copy the full blocks of ``kv`` once into DRAM slots this node's agent grants
        (``cmx.client.stores``); returns once the bytes are there, the commit going on behind.

        ``kv`` holds the KV of ``token_ids[start:]``: a [layers, 2, kv_heads, tokens, head_dim]
        tensor, or a ``cmx.client.stores.Source`` (an engine's paged cache, copied from where
        it lies); ``start`` is a multiple of the block size, so an engine that already stored
        a prefix hands over only what is new. ``grant_timeout_s`` bounds the wait for DRAM
        slots (default ``load_timeout_s``): UnavailableError past it, nothing kept.
        """
        T = self.layout.block_tokens
        if start < 0 or start % T:
            raise LayoutMismatchError(f"start {start} is not a multiple of {T} tokens")
        keys = self.keys(token_ids)
        first = start // T
        if not isinstance(kv, Source):
            self.layout.check_kv(kv)
            kv = TensorSource(self.layout, kv)
        if first > len(keys) or kv.blocks < len(keys) - first:
            raise LayoutMismatchError(
                f"kv holds {kv.blocks * T} tokens from {start}; token_ids have "
                f"{len(keys) * T} in full blocks"
            )
        if first >= len(keys):
            return StoreHandle(None, 0, self.cm.config.call_timeout_s)
        new = keys[first:]
        parents = [keys[first - 1] if first else None, *new[:-1]]
        return store_into_dram(self.cm, self.layout, new, parents, kv, self.namespace.id,
                               f"client:{uuid.uuid4().hex}", self.replication, grant_timeout_s)

    def lookup(self, token_ids: object, here_first: bool = False) -> Match:
        """The longest committed prefix of ``token_ids``, each block with every copy the
        directory knows. ``here_first``: what this node's memory holds is answered by its
        tiers, each such block with its copies here only, and the directory is asked for the
        rest alone: the lookup of an engine about to load here (``load`` with its match asks
        the directory afresh should a block here have gone)."""
        blocks = self._locate(self.keys(token_ids), here_first)
        return Match(len(blocks) * self.layout.block_tokens, blocks)

    def _locate(self, keys: Sequence[BlockHash], ask_here: bool = True) -> Blocks:
        """The longest prefix of ``keys`` held: first what this node's memory holds (unless
        ``ask_here`` is False: its tiers were just asked), each with its copies here only,
        then what the directory knows of the rest, each with every copy it knows. Columns
        throughout (``cmx.copy_table``): no object per block until one is read."""
        here = self.cm.plane.held(keys) if ask_here and keys else None
        first = here.prefix if here is not None else 0
        found = [here.table.head(first)] if here is not None else []
        if first < len(keys):
            rest = self.cm.copy_table(keys[first:])
            found.append(here.confirmed(rest, first) if here is not None else rest)
        table = CopyTable.stack(found)
        held = table.prefix()
        return Blocks(keys[:held], table.head(held), self.cm.node_id)

    def load(self, token_ids: object, match: Match | None = None, layers: IndexSpec = None,
             heads: IndexSpec = None) -> Any:
        """KV [layers, 2, kv_heads, n, head_dim] of the longest loadable cached prefix.

        Without ``match``, this node's memory is asked first and the directory only for what
        it does not hold; with one, the prefix ``match`` shows in this node's memory is, and
        should a block of it have gone since, the directory is asked afresh from there.
        ``layers`` / ``heads`` (an index, a range or slice of step 1, consecutive indices):
        only those, [len(layers), 2, len(heads), n, head_dim], and only their bytes moved
        (``cmx.client.selections``); SelectionError for a selection outside the layout."""
        if layers is not None or heads is not None:
            from cmx.client.selections import load_selection

            selection = Selection.of(self.layout, layers, heads)
            return load_selection(self, selection, match or self.lookup(token_ids))

        keys = self._load_keys(token_ids, match)
        out = empty_kv(self.layout, len(keys) * self.layout.block_tokens)
        return out[:, :, :, : self._load_into(keys, match, out)]

    def load_into(self, token_ids: object, out: Any, match: Match | None = None) -> int:
        """Load the longest cached prefix into ``out``, the caller's CPU tensor [layers, 2,
        kv_heads, tokens, head_dim] of the layout's dtype (any strides but a contiguous
        head_dim): at most its
        ``tokens``, from token 0. Returns how many tokens it holds now; nothing is allocated
        for the bytes, so a buffer used again costs no page faults. ``match`` as ``load``.
        LayoutMismatchError (and nothing written) for a tensor of another shape, dtype or
        device."""
        self.layout.check_kv(out)
        if out.device.type != "cpu":
            raise LayoutMismatchError(f"load_into takes a CPU tensor, got one on {out.device}")
        if out.stride(-1) != 1:
            raise LayoutMismatchError(f"load_into takes a tensor whose head_dim is contiguous, "
                                      f"got strides {out.stride()}")
        return self._load_into(self._load_keys(token_ids, match), match, out)

    def load_to(self, sink: Sink, token_ids: object, match: Match | None = None) -> int:
        """``load_into`` a ``Sink`` of ``cmx.client.copy_out`` (an engine's paged cache: each
        byte crosses this process once); returns the blocks it holds now, a prefix."""
        blocks = self._load_into(self._load_keys(token_ids, match), match, sink)
        return blocks // self.layout.block_tokens

    def _load_keys(self, token_ids: object, match: Match | None) -> list[BlockHash]:
        return block_keys(match.blocks) if match is not None else self.keys(token_ids)

    def _load_into(self, keys: list[BlockHash], match: Match | None, out: Any) -> int:
        """``load_into`` without its checks: tokens of ``keys`` loaded into ``out`` (a KV
        tensor, or a ``Sink``)."""
        T = self.layout.block_tokens
        out = as_sink(self.layout, out)
        keys = keys[: out.blocks]
        here = len(keys) if match is None else min(held_here(match, self.cm.node_id), len(keys))
        loaded, whole = self._load_local(keys[:here], out)
        if whole and loaded < len(keys):
            if match is not None and loaded >= here:
                rest = match.blocks[loaded : len(keys)]
            else:  # what memory here lacks now, asked of the directory: NVMe, peers, the pool
                rest = self._locate(keys[loaded:], ask_here=False)
            loaded += load_through_agent(self, list(rest), out, loaded)
        return loaded * T

    def load_layers(self, token_ids: object, match: Match | None = None) -> LayerLoad:
        """The cached prefix in groups of layers, asked in order (``LayerLoad.group``), so
        the first layers can be used while the later are still on their way; ``finish``
        says how many blocks came whole and verified (``cmx.client.layer_loads``)."""
        from cmx.client.layer_loads import LayerLoad

        return LayerLoad(self, match if match is not None else self.lookup(token_ids, True))

    def _load_local(self, keys: Sequence[BlockHash], out: Any) -> tuple[int, bool]:
        """Copy the prefix of ``keys`` held in this node's memory into ``out``: (blocks
        copied, whether all that were pinned were intact, so the rest may be looked for)."""
        if not keys:
            return 0, True
        plane = self.cm.plane
        pins = plane.pin_prefix(keys, f"client:{uuid.uuid4().hex}")
        try:
            payloads = plane.pinned_payloads(pins)
        except (CmxError, OSError, ValueError, IndexError) as exc:  # its arena is gone
            log.warning("a local block's arena is gone: %s", exc)
            plane.unpin(pins)
            return 0, True  # the agent maps the tier's new incarnation
        try:
            copied = copy_payloads(self.layout, payloads, out, 0, self.verify)
        except BaseException:
            plane.unpin(pins)
            raise
        if copied < len(pins):  # sent while pinned: the copy read goes, not a later one
            plane.quarantine(pins[copied : copied + 1])
        plane.unpin(pins)
        return copied, copied == len(pins)

    def prefetch(self, token_ids: object) -> Any:
        """Start moving the cached prefix toward this node's HBM tier; returns an ObjectRef."""
        match = self.lookup(token_ids)
        if not match.blocks:
            return None
        blocks = list(match.blocks)[: window_blocks(self.cm.config)]
        return self._send_prefetch(blocks)

    def prefetch_away(self, blocks: Sequence[BlockLocation]) -> Any:
        """Start moving those of ``blocks`` (a lookup's) this node's memory lacks (on its
        NVMe, on another node, in the pool) into its HBM tier at prefetch priority, where the
        next load reads them as local hits; at most one load window of them. An ObjectRef of
        the agent's answer (blocks moved), or None when memory here holds them all. Nothing
        waits for it: a prefetch that fails leaves the blocks where they were."""
        node = self.cm.node_id
        away = [b for b in blocks if not in_memory_here(b, node)]
        if not away:
            return None
        return self._send_prefetch(away[: window_blocks(self.cm.config)])

    def _send_prefetch(self, blocks: Sequence[BlockLocation]) -> Any:
        return self.cm.link.submit(actor_name("agent", self.cm.node_id), Prefetch(
            keys=[b.key for b in blocks], copies=[list(b.copies) for b in blocks],
            namespace=self.namespace.id)).ref
