"""The client's partial loads: some layers and KV heads of a cached prefix (``NamespaceClient.load``
with ``layers=`` or ``heads=``).

This node's agent gathers each block's selected bytes from its fastest copy
(``actors.agent.slices``) and hands them back by value: nothing stays pinned, nothing is
promoted. Each block's bytes are checked against the checksum its source took of them
(``cmx.selection``) before they are used; a block that fails, like one not found, ends the
prefix there.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from cmx.client.copy_out import checked
from cmx.doors import LoadSlices
from cmx.protocol import actor_name
from cmx.selection import Selection, SlicedBlock

if TYPE_CHECKING:
    from cmx.client.matches import BlockLocation, Match, Reader

__all__ = ["load_selection"]

log = logging.getLogger(__name__)


def load_selection(ns: Reader, selection: Selection, match: Match) -> Any:
    """KV [len(layers), 2, len(heads), n, head_dim] of the longest loadable cached prefix."""
    import torch

    layout = ns.layout
    T = layout.block_tokens
    shape = (len(selection.layers), 2, len(selection.heads), match.num_blocks * T,
             layout.head_dim)
    out = torch.empty(shape, dtype=layout.torch_dtype())
    per_block = selection.block_bytes(layout)
    window = max(1, ns.cm.config.hbm_bytes // 2 // per_block)
    blocks = list(match.blocks)
    loaded = 0
    for start in range(0, len(blocks), window):
        chunk = blocks[start : start + window]
        got = _load_window(ns, selection, chunk)
        for i, b in enumerate(got):
            at = (start + i) * T
            out[:, :, :, at : at + T].copy_(selection.to_tensor(layout, b.data))
        loaded += len(got)
        if len(got) < len(chunk):
            break
    return out[:, :, :, : loaded * T]


def _load_window(ns: Reader, selection: Selection,
                 blocks: list[BlockLocation]) -> list[SlicedBlock]:
    """The verified selections of the longest prefix of ``blocks`` the agent found."""
    agent = actor_name("agent", ns.cm.node_id)
    try:
        found = ns.cm.link.call(agent, LoadSlices(
            keys=[b.key for b in blocks], copies=[list(b.copies) for b in blocks],
            runs=selection.runs(ns.layout)), timeout_s=ns.cm.config.load_timeout_s)
    except Exception as exc:  # noqa: BLE001 - a failed or late load is a miss
        log.warning("partial load failed: %s", exc)
        return []
    intact = []
    for b, want in zip(found, blocks):
        if b.key != want.key:
            log.warning("the agent answered %s for %s", b.key.hex()[:12], want.key.hex()[:12])
            break
        if not checked(b.key, b.data, b.checksum):
            break
        intact.append(b)
    return intact
