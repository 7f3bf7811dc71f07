"""Loads in layer groups: a cached prefix handed over one group of layers at a time, so that an
engine's attention over the first layers runs while the later layers are still on their way
(``NamespaceClient.load_layers``; the vLLM connector's sync loads).

A ``LayerLoad`` is asked for its groups in order, contiguous from layer 0 (``group``), then
``finish`` says how many blocks every group brought whole and verified. Where the bytes come
from:

- What this node's memory holds is pinned once, at the start, in one round trip to its tiers,
  checked whole there (``copy_out.checked``), before any group is handed over, and each group
  is copied out of their shared memory. ``finish`` checks each block again: a pin whose lease
  ended while the groups were copied may have let its slot take another block.
- The rest (NVMe, a peer, the pool) comes whole with the first group, through this node's
  agent into its HBM as a whole load's does (``cmx.client.loads``), each block verified as it
  is copied out, and stays there for the next load; the later groups are cut from it. Fetched
  group by group as layer selections instead (``cmx.client.selections``: the agent sends each
  group's bytes by value), a 256 MiB prefix on NVMe took 2.7 times as long in all and its
  first group was ready little sooner (``cmx bench layers``, docs/BENCHMARKS.md).

So no group carries a block before its checksum was found right. The first group may bring
fewer blocks than were found (a block went since the lookup, or failed its check). Only
``finish``'s count is the load's: a block past it (its slot reused after its lease ended)
was handed over in an earlier group and must not be used, which the caller says to the
engine (vLLM recomputes such blocks, then overwrites them). Pins are let go at ``finish`` or
``close``, or expire with their lease.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from cmx.client.copy_out import checked, empty_kv, kv_array
from cmx.client.loads import load_through_agent
from cmx.client.matches import Match, block_keys, held_here
from cmx.errors import CmxError
from cmx.layout import PayloadOrder

if TYPE_CHECKING:
    from cmx.client.namespaces import NamespaceClient
    from cmx.client.node_plane import LocalPin

__all__ = ["LayerLoad", "layer_groups"]

log = logging.getLogger(__name__)


def layer_groups(num_layers: int, groups: int) -> list[range]:
    """``num_layers`` split into at most ``groups`` contiguous ranges, in order, the first ones
    no longer than the later: the first group is the one the engine waits for."""
    groups = max(1, min(groups, num_layers))
    size, extra = divmod(num_layers, groups)
    out, at = [], 0
    for g in range(groups):
        n = size + (1 if g >= groups - extra else 0)
        out.append(range(at, at + n))
        at += n
    return out


class LayerLoad:
    def __init__(self, ns: NamespaceClient, match: Match) -> None:
        self.ns = ns
        self.layout = ns.layout
        self._plane = ns.cm.plane
        keys = block_keys(match.blocks)
        here = held_here(match, ns.cm.node_id)
        self._pins: Sequence[LocalPin] = []
        self._payloads: list[np.ndarray] = []
        if here:
            self._pins = self._plane.pin_prefix(keys[:here], f"client:{uuid.uuid4().hex}")
            try:
                self._payloads = self._plane.payloads(self._pins)
            except (CmxError, OSError, ValueError, IndexError) as exc:  # an arena gone
                log.warning("a local block's arena is gone: %s", exc)
                self._release(self._pins)
        self._away_kv: Any = None  # what was away, every layer, once the first group came
        self._next = 0  # the first layer of the next group
        try:
            pinned = len(self._payloads)
            if pinned == here:
                self._away = list(match.blocks[pinned:])
            else:  # a block here went since the lookup: the directory is asked for the rest
                self._away = list(ns._locate(keys[pinned:], ask_here=False))
            self._blocks = pinned + len(self._away)  # what every group so far brought
            self._verify_whole_first()
        except BaseException:  # nobody holds this load to close it: its pins go now
            self.close()
            raise

    @property
    def blocks(self) -> int:
        """Blocks every group so far brought (an upper bound of ``finish``'s count)."""
        return self._blocks

    def group(self, layers: range) -> Any:
        """KV [len(layers), 2, kv_heads, n, head_dim] of the next group of layers."""
        import torch

        L = self.layout
        if layers.step != 1 or layers.start != self._next or not layers or \
                layers.stop > L.num_layers:
            raise ValueError(f"layer group {layers} does not follow layer {self._next}")
        T = L.block_tokens
        local = min(len(self._payloads), self._blocks)
        if self._blocks > local and self._away_kv is None:  # the first group: the rest, whole
            away = self._away[: self._blocks - local]
            self._away_kv = empty_kv(L, len(away) * T)
            self._blocks = local + load_through_agent(self.ns, away, self._away_kv, 0)
        self._next = layers.stop
        n = (self._blocks - local) * T  # tokens of it that came
        if not local and self._away_kv is not None and n == self._away_kv.shape[3]:
            return self._away_kv[layers.start : layers.stop]  # all of it away: no copy
        out = torch.empty((len(layers), 2, L.num_kv_heads, self._blocks * T, L.head_dim),
                          dtype=L.torch_dtype())
        self._copy_local(layers, kv_array(out), local)
        if n:
            out[:, :, :, local * T :].copy_(self._away_kv[layers.start : layers.stop, :, :, :n])
        return out

    def finish(self) -> int:
        """How many leading blocks every group brought whole and verified (0 unless every
        layer was asked); the pins are let go."""
        blocks = self._blocks if self._next == self.layout.num_layers else 0
        if self.ns.verify and blocks:
            # Checked before the first group and again now, so a slot taken back and reused
            # while the groups were copied (a lease that ended) is not believed.
            for i, (pin, payload) in enumerate(zip(self._pins, self._payloads[:blocks])):
                if not checked(pin.pin.key, payload, pin.pin.checksum):
                    self._plane.quarantine([pin])
                    blocks = i
                    break
        self.close()
        return blocks

    def close(self) -> None:
        self._release(self._pins)

    # -- here ----------------------------------------------------------------------------------

    def _verify_whole_first(self) -> None:
        """Each block here checked whole, before any group of it is handed over; the load
        ends before the first that fails."""
        if not self.ns.verify or not self._payloads:
            return
        for i, (pin, payload) in enumerate(zip(self._pins, self._payloads)):
            if not checked(pin.pin.key, payload, pin.pin.checksum):
                self._plane.quarantine([pin])
                self._payloads = self._payloads[:i]
                self._away = []
                self._blocks = i
                return

    def _copy_local(self, layers: range, dst: np.ndarray, count: int) -> None:
        L = self.layout
        T = L.block_tokens
        for i, payload in enumerate(self._payloads[:count]):
            src = payload.view(dst.dtype).reshape(L.payload_shape)
            place = dst[:, :, :, i * T : (i + 1) * T]
            if L.order is PayloadOrder.LAYER_MAJOR:
                np.copyto(place, src[layers.start : layers.stop])
            else:
                np.copyto(place, src.transpose(1, 2, 0, 3, 4)[layers.start : layers.stop])

    def _release(self, pins: Sequence[LocalPin]) -> None:
        if pins:
            self._plane.unpin(pins)
        self._pins, self._payloads = [], []
