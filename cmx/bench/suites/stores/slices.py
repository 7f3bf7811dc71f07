"""Suite "slices": one KV head of a long prefix, asked for as 512-byte pieces, served from NVMe.

The workload, precisely:

- Geometry: Llama-3-8B (32 layers, 8 KV heads, head_dim 128, bfloat16, 256-token blocks of
  32 MiB). The prefix is ``--gib`` GiB of full blocks, keyed by chaining a namespace digest over
  its token ids, written once to an NvmeStore and flushed.
- A request reads one KV head ``h`` across all layers of every block of the prefix (the access
  of head-wise attention offload). The engine expresses it as pieces of 512 bytes: a piece is
  the K vector and the V vector (128 x 2 bytes each) of head ``h``, one layer, one token — the
  seed article's sub-kilobyte access. Pieces come in engine order (block, layer, token).
- Each piece is two 256-byte byte runs of the block's payload (K and V lie apart in both
  orders), handed to ``NvmeStore.read_runs([(key, offset, length), ...])`` in one call: for a
  2 GiB prefix, 64 blocks x 32 layers x 256 tokens = 524,288 pieces, 1,048,576 runs, 256 MiB.
- The figures judge the disk I/Os the store issued for that call (from ``stats().extra``): the
  share of them that are >= 128 KiB, and read amplification = bytes read from disk / bytes
  requested. Repetition ``r`` asks for head ``r mod 8``, after dropping the page cache.

The namespace is head-major (``PayloadOrder.HEAD_MAJOR``: [head, layer, k/v, token, dim]), where
head ``h`` of a block is one 4 MiB extent. The same request against a layer-major namespace,
where it is 64 runs of 64 KiB spaced 512 KiB apart, is measured beside it for contrast.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from cmx.bench.harness.baselines import FioJob, fio_bandwidth, fio_engine
from cmx.bench.harness.core import GB, BenchContext, Figure, Goal, KiB, MiB, SuiteResult, Table
from cmx.bench.harness.payloads import payload_pool
from cmx.bench.suites.stores.storage import io_histogram, size_label
from cmx.keys import BlockHash, Namespace, chain_keys
from cmx.layout import KVLayout, PayloadOrder

if TYPE_CHECKING:
    from cmx.storage import NvmeStore

__all__ = ["PIECE_BYTES", "head_pieces", "io_size_bytes", "run_slices", "share_at_least"]

PIECE_BYTES = 512
MIN_IO = 128 * KiB
GEOMETRY = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=256)


def head_pieces(layout: KVLayout, head: int) -> np.ndarray:
    """Byte offsets of head ``head``'s pieces in one block: shape [layers * tokens, 2] (K, V).

    Row ``layer * block_tokens + token`` holds the offsets of that token's K and V vectors;
    each is ``head_dim * itemsize`` bytes long.
    """
    L, H, T, D = layout.num_layers, layout.num_kv_heads, layout.block_tokens, layout.head_dim
    vec = D * layout.itemsize
    layer = np.arange(L).reshape(L, 1, 1)
    kv = np.arange(2).reshape(1, 1, 2)
    token = np.arange(T).reshape(1, T, 1)
    if layout.order is PayloadOrder.LAYER_MAJOR:  # [layer, kv, head, token, dim]
        row = (layer * 2 + kv) * H + head
    else:  # [head, layer, kv, token, dim]
        row = (head * L + layer) * 2 + kv
    offsets = (row * T + token) * vec
    return offsets.reshape(L * T, 2)


def request_runs(layout: KVLayout, keys: list[BlockHash],
                 head: int) -> list[tuple[BlockHash, int, int]]:
    """The request for head ``head`` over every block, as (key, offset, length) runs."""
    vec = layout.head_dim * layout.itemsize
    per_block = head_pieces(layout, head).reshape(-1).tolist()
    return [(key, off, vec) for key in keys for off in per_block]


def io_size_bytes(label: object) -> int:
    """Bytes of a histogram bucket label: an int, or "4K" / "128 KiB" / "1M" / "1 MiB"."""
    if isinstance(label, int):
        return label
    text = str(label).strip().upper().replace("IB", "").replace("B", "").replace(" ", "")
    text = text.lstrip("<>=≥≤")
    units = {"K": KiB, "M": MiB, "G": 1 << 30}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(float(text))


def share_at_least(histogram: Mapping[Any, int], size: int) -> float:
    """Fraction of I/Os in ``histogram`` (bucket -> count) of at least ``size`` bytes."""
    total = sum(histogram.values())
    big = sum(c for k, c in histogram.items() if io_size_bytes(k) >= size)
    return big / total if total else float("nan")


def _hist_delta(before: Mapping[int, int], after: Mapping[int, int]) -> dict[int, int]:
    delta = {k: after[k] - before.get(k, 0) for k in after}
    return {k: v for k, v in delta.items() if v}


def _stat(extra: Mapping[str, object], name: str) -> int:
    # The ignore below: extra maps names to ints or dicts
    return int(extra.get(name, 0))  # type: ignore[call-overload]




def _fill(store: NvmeStore, layout: KVLayout, keys: list[BlockHash]) -> None:

    pool = payload_pool(layout.block_bytes, 4 * layout.block_bytes)
    parent = None
    for i, key in enumerate(keys):
        store.put(key, pool[i % len(pool)], parent=parent)
        parent = key
    store.flush()


def _measure(ctx: BenchContext, order: PayloadOrder) -> dict[str, list[float]]:
    """Per repetition: requested bytes/s, disk bytes, requested bytes, I/O share >= 128 KiB."""
    from cmx.storage import NvmeStore

    layout = KVLayout(**GEOMETRY, order=order)  # type: ignore[arg-type]  # GEOMETRY's values: one union
    n = max(1, ctx.config.nbytes // layout.block_bytes)
    tokens = np.random.default_rng(7).integers(0, 128_256, size=n * layout.block_tokens)
    keys = chain_keys(Namespace("meta-llama/Meta-Llama-3-8B", layout).digest, tokens,
                      layout.block_tokens)
    root = ctx.work / f"slices-{order.value}"
    capacity = n * layout.block_bytes + n * layout.block_bytes // 4 + layout.block_bytes
    out: dict[str, list[float]] = {k: [] for k in ("rate", "disk", "asked", "share", "fio")}
    store = NvmeStore(root, capacity_bytes=capacity, block_bytes=layout.block_bytes)
    with store:
        _fill(store, layout, keys)
        hists: list[dict[int, int]] = []
        for rep in range(ctx.config.reps):
            ctx.log(f"slices {order.value}, rep {rep + 1}/{ctx.config.reps}")
            out["fio"].append(fio_bandwidth(ctx, FioJob("read", MiB, 16)) / GB)
            runs = request_runs(layout, keys, rep % layout.num_kv_heads)
            ctx.drop_cache()
            before = store.stats().extra
            t0 = time.perf_counter()
            store.read_runs(runs)
            seconds = time.perf_counter() - t0
            after = store.stats().extra
            asked = _stat(after, "bytes_requested") - _stat(before, "bytes_requested")
            disk = _stat(after, "bytes_read_from_disk") - _stat(before, "bytes_read_from_disk")
            hist = _hist_delta(io_histogram(before, "read"), io_histogram(after, "read"))
            hists.append(hist)
            out["rate"].append(asked / seconds / GB)
            out["disk"].append(disk / MiB)
            out["asked"].append(asked / MiB)
            out["share"].append(share_at_least(hist, MIN_IO))
        store.check_integrity()
    shutil.rmtree(root, ignore_errors=True)
    ctx.memo[f"slices_hist_{order.value}"] = hists[-1]
    return out


def run_slices(ctx: BenchContext) -> SuiteResult:
    result = SuiteResult("slices", command="")
    engine = fio_engine(ctx)
    ones = tuple(1.0 for _ in range(ctx.config.reps))
    for order, goals in ((PayloadOrder.HEAD_MAJOR, True), (PayloadOrder.LAYER_MAJOR, False)):
        m = _measure(ctx, order)
        tag = order.value.replace("_", "-")
        result.figures += [
            Figure("slices", f"{tag}: disk I/Os >= 128 KiB (share of I/Os)", "share",
                   tuple(m["share"]), "all disk I/Os of the request", ones,
                   Goal(">=", 1.0) if goals else None),
            Figure("slices", f"{tag}: bytes read from disk", "MiB", tuple(m["disk"]),
                   "bytes requested", tuple(m["asked"]), Goal("<=", 1.5) if goals else None,
                   note="" if goals else "ratio = read amplification"),
            Figure("slices", f"{tag}: requested bytes served per second", "GB/s",
                   tuple(m["rate"]), f"fio read 1 MiB QD16, {engine}", tuple(m["fio"])),
        ]
        hist = ctx.memo[f"slices_hist_{order.value}"]
        rows = tuple((size_label(io_size_bytes(k)), str(v))
                     for k, v in sorted(hist.items(), key=lambda kv: io_size_bytes(kv[0])))
        result.tables.append(Table(f"Disk I/O sizes of one request, {tag} (last repetition)",
                                   ("I/O size (bucket: next power of two)", "count"), rows))
    result.notes += [
        "a request = one KV head, all 32 layers, every token of every block of the prefix, as "
        "512-byte pieces (K and V of one token and one layer: two 256-byte runs), one "
        "read_runs call; read amplification = bytes read from disk / bytes requested",
        f"cold reads: {ctx.cold_read_method}",
    ]
    return result
