"""Selections: the layers and KV heads of a block a partial load asks for, and their bytes.

A ``Selection`` is a contiguous range of layers and one of KV heads, K and V both, all tokens
of a block. ``KVLayout.slice_runs`` turns it into the (offset, length) runs of a block payload
that hold it: in a head-major payload one head across a layer range is one run per head, in a
layer-major one it is two runs (K, V) per layer. The selected bytes of a block travel as the
concatenation of its runs in offset order (``gather``), and ``to_tensor`` reads them back as
[layers, 2, heads, tokens, head_dim].

How a partial load is verified (a partial read cannot check the whole-block checksum without
reading the whole block, and no wrong byte may be returned silently):

1. At the source, before slicing: a copy in memory (HBM, DRAM, a pool node's staging) is
   checked whole against the block checksum it was committed with; a copy on NVMe is read as
   the 128 KiB chunks that cover the runs, each checked against the chunk checksums stored
   with the block (``cmx.storage.nvme.chunks``), so only those chunks are read.
2. In transit: the source sends the checksum of the selected bytes it sliced from the
   verified copy (``SlicedBlock.checksum``); the reader checks it before using the bytes.

A copy that fails step 1 is quarantined at the source and the block is read from its next
copy, or is a miss; bytes that fail step 2 make the load stop there (a shorter prefix).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cmx.errors import LayoutMismatchError
from cmx.keys import BlockHash
from cmx.layout import KVLayout, PayloadOrder
from cmx.tiers import Tier

if TYPE_CHECKING:
    import torch

__all__ = [
    "IndexSpec", "Runs", "Selection", "SelectionError", "SlicedBlock", "check_runs", "gather",
    "runs_bytes",
]

Runs = tuple[tuple[int, int], ...]  # (offset, length) runs of a block payload, sorted

IndexSpec = int | range | slice | Sequence[int] | None


class SelectionError(LayoutMismatchError):
    """A layer or head selection that is not a non-empty contiguous range of the layout."""


@dataclass(frozen=True)
class Selection:
    layers: range  # contiguous, step 1, within 0..num_layers
    heads: range  # contiguous, step 1, within 0..num_kv_heads

    @classmethod
    def of(cls, layout: KVLayout, layers: IndexSpec = None, heads: IndexSpec = None) -> Selection:
        """The selection of ``layers`` x ``heads`` (each: None for all, an index, a range or
        slice of step 1, or consecutive indices); SelectionError for anything else."""
        return cls(_as_range(layers, layout.num_layers, "layers"),
                   _as_range(heads, layout.num_kv_heads, "heads"))

    def is_whole(self, layout: KVLayout) -> bool:
        return len(self.layers) == layout.num_layers and len(self.heads) == layout.num_kv_heads

    def runs(self, layout: KVLayout) -> Runs:
        return tuple(layout.slice_runs(self.layers, self.heads))

    def block_bytes(self, layout: KVLayout) -> int:
        """Selected bytes of one block."""
        return len(self.layers) * 2 * len(self.heads) * layout.head_run_bytes

    def to_tensor(self, layout: KVLayout, data: np.ndarray) -> torch.Tensor:
        """The [layers, 2, heads, tokens, head_dim] tensor of one block's ``gather``ed bytes
        (a view of ``data``)."""
        import torch

        if data.nbytes != self.block_bytes(layout):
            raise LayoutMismatchError(
                f"selected bytes are {data.nbytes}, the selection is {self.block_bytes(layout)}")
        nl, nh, t, d = len(self.layers), len(self.heads), layout.block_tokens, layout.head_dim
        with warnings.catch_warnings():  # a read-only array (Ray's) is only ever read here
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))
        t5 = flat.view(layout.torch_dtype())
        if layout.order is PayloadOrder.LAYER_MAJOR:
            return t5.reshape(nl, 2, nh, t, d)
        return t5.reshape(nh, nl, 2, t, d).permute(1, 2, 0, 3, 4)


@dataclass(frozen=True)
class SlicedBlock:
    """The selected bytes of one block, sliced at the source from a verified copy."""

    key: BlockHash
    data: np.ndarray  # uint8: the runs of the selection, concatenated in offset order
    checksum: int  # XXH3-64 of ``data``, taken at the source
    source_tier: Tier
    source_node: str


def gather(payload: np.ndarray, runs: Runs, out: np.ndarray | None = None) -> np.ndarray:
    """The bytes of ``runs`` of ``payload``, concatenated in order (into ``out`` if given)."""
    total = runs_bytes(runs)
    dst = np.empty(total, np.uint8) if out is None else out[:total]
    at = 0
    for off, length in runs:
        dst[at : at + length] = payload[off : off + length]
        at += length
    return dst


def runs_bytes(runs: Runs) -> int:
    return sum(length for _, length in runs)


def check_runs(runs: Runs, size: int) -> None:
    """SelectionError unless ``runs`` are sorted, disjoint and inside a ``size``-byte block."""
    end = 0
    for off, length in runs:
        if off < end or length <= 0 or off + length > size:
            raise SelectionError(f"runs {list(runs)[:4]}... are not sorted, disjoint ranges "
                                 f"within a block of {size} bytes")
        end = off + length


def _as_range(spec: IndexSpec, n: int, name: str) -> range:
    if spec is None:
        return range(n)
    if isinstance(spec, bool):
        raise SelectionError(f"{name} must be an index, a range or a slice, got {spec!r}")
    if isinstance(spec, (int, np.integer)):
        r = range(int(spec), int(spec) + 1)
    elif isinstance(spec, slice):
        if spec.step not in (None, 1):
            raise SelectionError(f"{name} slice {spec} must have step 1")
        start = 0 if spec.start is None else spec.start
        stop = n if spec.stop is None else spec.stop
        if not all(isinstance(v, (int, np.integer)) for v in (start, stop)):
            raise SelectionError(f"{name} slice {spec} must have int bounds")
        r = range(int(start), int(stop))
    elif isinstance(spec, range):
        r = spec
    elif isinstance(spec, Sequence) and not isinstance(spec, (str, bytes)):
        values = list(spec)
        if not values or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                 for v in values):
            raise SelectionError(f"{name} {spec!r} must be a non-empty sequence of ints")
        r = range(int(values[0]), int(values[-1]) + 1)
        if list(r) != [int(v) for v in values]:
            raise SelectionError(f"{name} {spec!r} are not consecutive ascending indices")
    else:
        raise SelectionError(f"{name} must be an index, a range or a slice, got {spec!r}")
    if r.step != 1 or len(r) == 0 or r.start < 0 or r.stop > n:
        raise SelectionError(f"{name} {spec!r} is not a non-empty range within 0..{n}")
    return r
