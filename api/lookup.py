"""Keys, nodes and prefixes as the API addresses them. Pure, apart from the backend calls."""

from __future__ import annotations

from collections.abc import Sequence

from cmx.actors.directory.shard import Copy
from cmx.api.backend import Backend
from cmx.api.models import CopyInfo, LookupBlock, LookupRequest, LookupResult
from cmx.api.problems import ApiProblem
from cmx.keys import BlockHash, Namespace, chain_keys
from cmx.layout import KVLayout

__all__ = ["LOOKUP_BATCH", "best_copy", "copy_info", "lookup_prefix", "parse_key",
           "resolve_node"]

LOOKUP_BATCH = 4096  # keys per directory round; a prefix stops at its first miss


def parse_key(hex_key: str) -> BlockHash:
    """A 64-hex-character key as bytes (the models have checked the pattern already)."""
    try:
        key = bytes.fromhex(hex_key)
    except ValueError:
        raise ApiProblem(422, f"{hex_key!r} is not a hex block key") from None
    if len(key) != 32:
        raise ApiProblem(422, f"a block key is 32 bytes (64 hex characters), got {len(key)}")
    return BlockHash(key)


def resolve_node(prefix: str, nodes: Sequence[str]) -> str:
    """The node whose id is ``prefix`` or starts with it; 404 if none, 422 if several."""
    want = prefix.lower()
    if want in nodes:
        return want
    found = [n for n in nodes if n.lower().startswith(want)]
    if not found:
        raise ApiProblem(404, f"no node {prefix!r}; the service runs on {len(nodes)} node(s)")
    if len(found) > 1:
        raise ApiProblem(422, f"node prefix {prefix!r} matches {len(found)} nodes; give more")
    return found[0]


def copy_info(c: Copy) -> CopyInfo:
    return CopyInfo(tier=c.tier.value, node=c.node, size=c.size, checksum=c.checksum)


def best_copy(copies: Sequence[Copy]) -> Copy:
    """The copy a load would prefer: the fastest tier."""
    return min(copies, key=lambda c: (c.tier.rank, c.node))


def lookup_prefix(backend: Backend, req: LookupRequest) -> LookupResult:
    layout = KVLayout(**req.layout.model_dump())
    namespace = Namespace(req.model, layout, req.salt, req.weights)
    keys = chain_keys(namespace.digest, req.token_ids, layout.block_tokens)
    blocks: list[LookupBlock] = []
    for start in range(0, len(keys), LOOKUP_BATCH):
        batch = keys[start : start + LOOKUP_BATCH]
        for i, (key, copies) in enumerate(zip(batch, backend.copies(batch))):
            if not copies:
                return _result(namespace, layout, keys, blocks)
            best = best_copy(copies)
            blocks.append(LookupBlock(index=start + i, key=key.hex(), tier=best.tier.value,
                                      node=best.node, copies=[copy_info(c) for c in copies]))
    return _result(namespace, layout, keys, blocks)


def _result(namespace: Namespace, layout: KVLayout, keys: list[BlockHash],
            blocks: list[LookupBlock]) -> LookupResult:
    return LookupResult(namespace_id=namespace.id, num_tokens=len(blocks) * layout.block_tokens,
                        num_blocks=len(blocks), full_blocks=len(keys), blocks=blocks)
