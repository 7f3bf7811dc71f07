"""Suite "lmcache": the stores against LMCache 0.5, on the same disk, with the same bytes.

Every figure is ours over LMCache's, measured in the same repetition, one right after the other:

- Geometry: Llama-3-8B (32 layers, 8 KV heads, head_dim 128, bfloat16), ``--gib`` GiB of
  prefix, in 256-token chunks (32 MiB) and 16-token chunks (2 MiB).
- LMCache: its v1 engine (``LMCacheEngineBuilder``) with its local disk backend (O_DIRECT on,
  ``extra_config={"use_odirect": True}``; no CPU hot cache, so loads come from disk) in a
  directory under ``--dir``, driven through a CPU stand-in for its GPU connector
  (``lmcache_driver.py``, in LMCache's own virtual environment; see ``lmcache_env``).
- Store: ours ``put`` of every block then ``flush`` (durable: data fdatasync'ed, index
  journaled); LMCache ``store`` until its last chunk file is written (O_DIRECT, no fsync).
- Load: ours one ``get_many_into`` of every block into its slot of a faulted-in page-aligned
  buffer; LMCache ``lookup`` + ``retrieve`` into a CPU KV tensor (its disk reads
  run on 4 threads).
- One KV head of eight, all layers, every token: ours reads just that head, a contiguous run
  of each head-major block, with one ``read_runs`` call; LMCache has no partial read, so it
  retrieves whole chunks and slices the head out. Judged on the head's bytes per second.
- Restart: after the store is closed, a new process opens the same directory and looks the
  prefix up. Ours replays its snapshot and journal; LMCache's disk index lives in memory.
- DRAM: ours DramStore ``put`` / ``get_into`` against LMCache's LocalCPUBackend ``store`` /
  ``retrieve`` of the same bytes in 256-token chunks.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cmx.bench.harness.baselines import FioJob, FioMissingError, fio_bandwidth
from cmx.bench.harness.core import (
    GB,
    BenchContext,
    Figure,
    Goal,
    MiB,
    SuiteResult,
    Table,
    median,
    timed,
)
from cmx.bench.harness.payloads import block_keys, payload_pool
from cmx.bench.suites.lmcache.lmcache_env import Peer, PeerError, ensure_peer, run_driver
from cmx.bench.suites.lmcache.prefix import (
    GEOMETRY,
    head_runs,
    hits_after_restart,
    llama_layout,
    load_into,
    open_store,
    prefix_keys,
    put_prefix,
)
from cmx.buffers import aligned_empty

__all__ = ["CHUNK_TOKENS", "Samples", "driver_geometry", "run_lmcache"]

CHUNK_TOKENS = (256, 16)
PARITY = Goal(">=", 1.0)  # at least LMCache's bandwidth
HEAD_GOAL = Goal(">=", 4.0)  # one head of eight: at least 4x LMCache's
RESTART_GOAL = Goal(">=", 1.0)  # every flushed block found again
_RING_BYTES = 256 * MiB  # LMCache's KV source, as big as our payload pool


@dataclass
class Samples:
    """One list per measured quantity, one value per repetition."""

    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, **kv: float) -> None:
        for name, value in kv.items():
            self.values.setdefault(name, []).append(float(value))

    def get(self, name: str) -> tuple[float, ...]:
        return tuple(self.values.get(name, ()))


def driver_geometry() -> dict[str, Any]:
    """The geometry as the driver takes it (it does not import cmx)."""
    return {"layers": GEOMETRY["num_layers"], "kv_heads": GEOMETRY["num_kv_heads"],
            "head_dim": GEOMETRY["head_dim"], "dtype": GEOMETRY["dtype"]}


def _ours_disk(ctx: BenchContext, tokens: int, blocks: int, rep: int, dest: np.ndarray,
               pool: list[np.ndarray], out: Samples) -> None:
    """Store, load, one head, restart: one repetition of ours at ``tokens``-token blocks."""
    layout = llama_layout(tokens)
    block = layout.block_bytes
    keys = prefix_keys(layout, blocks, seed=rep)
    root = ctx.work / f"ours-{tokens}t-{rep}"
    total, head = blocks * block, rep % layout.num_kv_heads
    view = dest[:total]
    try:
        store = open_store(root, blocks + 1, block)
        try:
            _warm_up(store, layout, rep, view[:block], pool)
            store_s = timed(lambda: put_prefix(store, keys, pool))
            ctx.drop_cache()
            load_s = timed(lambda: load_into(store, keys, view))
            _check_slots(view, block, blocks, pool)
            runs = head_runs(layout, keys, head)
            got: list[Any] = []
            ctx.drop_cache()
            head_s = timed(lambda: got.extend(store.read_runs(runs)))
            _check_head(got, runs, pool)
            store.check_integrity()
        finally:
            store.close()
        hits, reopen_s = hits_after_restart(root, blocks + 1, block, keys)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    head_bytes = total // layout.num_kv_heads
    out.add(store=total / store_s / GB, load=total / load_s / GB,
            head=head_bytes / head_s / GB, hits=hits / blocks, reopen_s=reopen_s)


def _warm_up(store: Any, layout: Any, rep: int, slot: np.ndarray,
             pool: list[np.ndarray]) -> None:
    """One block of other tokens stored and loaded, untimed, as LMCache's engine warms up."""
    key = prefix_keys(layout, 1, seed=10_000 + rep)[0]
    store.put(key, pool[-1])
    store.get_into(key, slot)


def _check_slots(dest: np.ndarray, block: int, blocks: int, pool: list[np.ndarray]) -> None:
    for i in {0, blocks - 1}:
        if not np.array_equal(dest[i * block:(i + 1) * block], pool[i % len(pool)]):
            raise AssertionError(f"block {i} loaded wrong bytes")


def _check_head(got: list[Any], runs: Sequence[tuple[bytes, int, int]],
                pool: list[np.ndarray]) -> None:
    if any(g is None for g in got):
        raise AssertionError("read_runs missed a block of the head range")
    _, off, length = runs[0]
    if not np.array_equal(got[0], pool[0][off:off + length]):
        raise AssertionError("read_runs returned wrong bytes for the head range")


def _theirs_disk(ctx: BenchContext, peer: Peer, tokens: int, blocks: int, rep: int,
                 out: Samples, problems: list[str]) -> None:
    """The same repetition on LMCache's disk backend, then its restart in a new process."""
    layout = llama_layout(tokens)
    disk = ctx.work / f"lmcache-{tokens}t-{rep}"
    disk.mkdir(parents=True, exist_ok=True)
    spec = {"op": "disk", "geometry": driver_geometry(), "chunk_tokens": tokens,
            "tokens": blocks * tokens, "disk_dir": str(disk), "seed": rep,
            "head": rep % layout.num_kv_heads, "full_destination": True,
            "ring_tokens": max(tokens, _RING_BYTES // layout.token_bytes)}
    work = ctx.scratch("lmcache-driver")
    try:
        got = run_driver(peer, spec, work)
        if got["loaded_tokens"] != blocks * tokens or not got["verified"]:
            problems.append(f"LMCache {tokens}-token chunks, rep {rep + 1}: retrieved "
                            f"{got['loaded_tokens']} of {blocks * tokens} tokens, "
                            f"verified={got['verified']}")
        again = run_driver(peer, {**spec, "op": "restart"}, work)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    total = int(got["bytes"])
    out.add(store=total / got["store_s"] / GB, load=total / got["load_s"] / GB,
            head=total / layout.num_kv_heads / got["head_s"] / GB,
            hits=again["hit_chunks"] / again["chunks"], files=again["files_before"])


def _ours_dram(blocks: int, block: int, pool: list[np.ndarray], dest: np.ndarray,
               out: Samples) -> None:
    from cmx.storage import DramStore

    keys = block_keys(blocks + 1, b"peer-dram")
    warm, keys = keys[-1], keys[:-1]
    total = blocks * block
    store = DramStore(capacity_bytes=total + block, block_bytes=block)
    with store:
        store.put(warm, pool[-1])  # untimed, as LMCache's engine warms up
        store.get_into(warm, dest[:block])

        def put_all() -> None:
            for i, key in enumerate(keys):
                store.put(key, pool[i % len(pool)])

        def get_all() -> None:
            for i, key in enumerate(keys):
                if store.get_into(key, dest[i * block:(i + 1) * block]) is None:
                    raise AssertionError(f"DramStore lost block {i}")

        put_s, get_s = timed(put_all), timed(get_all)
        store.check_integrity()
    out.add(store=total / put_s / GB, load=total / get_s / GB)


def _theirs_dram(ctx: BenchContext, peer: Peer, blocks: int, rep: int, out: Samples,
                 problems: list[str]) -> None:
    layout = llama_layout(256)
    spec = {"op": "cpu", "geometry": driver_geometry(), "chunk_tokens": 256,
            "tokens": blocks * 256, "disk_dir": "", "seed": rep, "full_destination": True,
            "ring_tokens": _RING_BYTES // layout.token_bytes}
    got = run_driver(peer, spec, ctx.scratch("lmcache-driver"))
    if got["loaded_tokens"] != blocks * 256 or not got["verified"]:
        problems.append(f"LMCache local_cpu, rep {rep + 1}: retrieved {got['loaded_tokens']} "
                        f"of {blocks * 256} tokens, verified={got['verified']}")
    total = int(got["bytes"])
    out.add(store=total / got["store_s"] / GB, load=total / got["load_s"] / GB)


def _fio(ctx: BenchContext, out: Samples) -> None:
    try:
        out.add(write=fio_bandwidth(ctx, FioJob("write", MiB, 16)) / GB,
                read=fio_bandwidth(ctx, FioJob("read", MiB, 16)) / GB)
    except FioMissingError:
        pass


def run_lmcache(ctx: BenchContext) -> SuiteResult:
    result = SuiteResult("lmcache", command="")
    try:
        peer = ensure_peer(ctx)
    except PeerError as exc:
        result.notes.append(f"LMCache could not be installed or started, so nothing was "
                            f"compared: {exc}")
        return result
    nbytes = ctx.config.nbytes
    ours = {t: Samples() for t in CHUNK_TOKENS}
    theirs = {t: Samples() for t in CHUNK_TOKENS}
    dram_ours, dram_theirs, fio = Samples(), Samples(), Samples()
    problems: list[str] = []
    dest = aligned_empty(nbytes)
    dest[:] = 0  # faulted in once: page faults are not I/O
    pools = {t: payload_pool(llama_layout(t).block_bytes) for t in CHUNK_TOKENS}
    try:
        for rep in range(ctx.config.reps):
            for tokens in CHUNK_TOKENS:
                blocks = max(1, nbytes // llama_layout(tokens).block_bytes)
                ctx.log(f"lmcache {tokens}-token chunks, rep {rep + 1}/{ctx.config.reps}: ours")
                _ours_disk(ctx, tokens, blocks, rep, dest, pools[tokens], ours[tokens])
                ctx.log(f"lmcache {tokens}-token chunks, rep {rep + 1}/{ctx.config.reps}: "
                        "LMCache")
                _theirs_disk(ctx, peer, tokens, blocks, rep, theirs[tokens], problems)
            blocks = max(1, nbytes // llama_layout(256).block_bytes)
            ctx.log(f"lmcache DRAM, rep {rep + 1}/{ctx.config.reps}")
            _ours_dram(blocks, llama_layout(256).block_bytes, pools[256], dest, dram_ours)
            _theirs_dram(ctx, peer, blocks, rep, dram_theirs, problems)
            _fio(ctx, fio)
    except PeerError as exc:
        result.notes.append(f"LMCache failed during the run, so its figures are missing: {exc}")
        return result
    finally:
        del dest
    result.figures += _disk_figures(ours, theirs, nbytes)
    result.figures += _dram_figures(dram_ours, dram_theirs, nbytes)
    result.tables.append(_detail_table(ours, theirs, fio))
    result.notes += _notes(ctx, peer) + problems
    return result


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:g} GiB"


def _disk_figures(ours: dict[int, Samples], theirs: dict[int, Samples],
                  nbytes: int) -> list[Figure]:
    figures = []
    for tokens in CHUNK_TOKENS:
        o, t = ours[tokens], theirs[tokens]
        mib = llama_layout(tokens).block_bytes // MiB
        label = f"{tokens}-token chunks ({mib} MiB), {_size(nbytes)}"
        disk = "LMCache local disk, O_DIRECT"
        figures += [
            Figure("lmcache", f"store, {label}", "GB/s", o.get("store"),
                   f"{disk}: store until written", t.get("store"), PARITY,
                   note="ours put_many + flush (durable); LMCache's writes are not fsync'ed"),
            Figure("lmcache", f"load, {label}", "GB/s", o.get("load"),
                   f"{disk}: lookup + retrieve", t.get("load"), PARITY),
            Figure("lmcache", f"one KV head of 8, all layers, {label}", "GB/s of the head",
                   o.get("head"), f"{disk}: whole chunks, then the slice", t.get("head"),
                   HEAD_GOAL, note="ours: the head's contiguous run of each head-major "
                                   "block, one read_runs call"),
            Figure("lmcache", f"hit rate after a restart, {label}", "share of blocks",
                   o.get("hits"), "every block stored", tuple(1.0 for _ in o.get("hits")),
                   RESTART_GOAL, note="a new process reopens the store: snapshot + journal"),
            Figure("lmcache", f"LMCache hit rate after a restart, {label}", "share of chunks",
                   t.get("hits"), "every chunk stored", tuple(1.0 for _ in t.get("hits")),
                   note="LMCache's disk index is kept in memory only: its chunk files stay "
                        "on disk, unfound"),
        ]
    return figures


def _dram_figures(ours: Samples, theirs: Samples, nbytes: int) -> list[Figure]:
    label = f"256-token chunks (32 MiB), {_size(nbytes)}"
    cpu = "LMCache local_cpu"
    return [
        Figure("lmcache", f"DramStore put, {label}", "GB/s", ours.get("store"),
               f"{cpu}: store", theirs.get("store")),
        Figure("lmcache", f"DramStore get_into, {label}", "GB/s", ours.get("load"),
               f"{cpu}: lookup + retrieve", theirs.get("load")),
    ]


def _fmt(samples: tuple[float, ...]) -> str:
    return f"{median(samples):.3f}" if samples else "n/a"


def _detail_table(ours: dict[int, Samples], theirs: dict[int, Samples], fio: Samples) -> Table:
    rows = []
    for tokens in CHUNK_TOKENS:
        for name, what in (("store", "store GB/s"), ("load", "load GB/s"),
                           ("head", "one head GB/s")):
            rows.append((f"{tokens}", what, _fmt(ours[tokens].get(name)),
                         _fmt(theirs[tokens].get(name)),
                         " / ".join(f"{v:.3f}" for v in ours[tokens].get(name)),
                         " / ".join(f"{v:.3f}" for v in theirs[tokens].get(name))))
        rows.append((f"{tokens}", "after a restart: s to reopen (ours) / the prefix's chunk "
                     "files still on disk (LMCache)",
                     _fmt(ours[tokens].get("reopen_s")), _fmt(theirs[tokens].get("files")),
                     "", ""))
    for name in ("write", "read"):
        if fio.get(name):
            rows.append(("—", f"fio {name} 1 MiB QD16 GB/s (same reps)", _fmt(fio.get(name)),
                         "", " / ".join(f"{v:.3f}" for v in fio.get(name)), ""))
    return Table("Medians and samples per repetition",
                 ("chunk tokens", "quantity", "ours", "LMCache", "ours samples",
                  "LMCache samples"), tuple(rows))


def _notes(ctx: BenchContext, peer: Peer) -> list[str]:
    return [
        f"peer: {peer.describe()}; engine built with LMCacheEngineBuilder, local_cpu=False, "
        f"local_disk under {ctx.config.dir}, extra_config use_odirect=True, its default 4 "
        "disk I/O threads, one file per chunk; driven through a CPU stand-in for its GPU "
        "connector (copies between its memory objects and a CPU KV tensor)",
        f"ours: NvmeStore in {ctx.config.dir}, head-major Llama-3-8B blocks; stores are "
        "put_many then flush; loads one get_many_into of the prefix into page-aligned slots "
        "faulted in beforehand; LMCache's CPU memory pool is likewise allocated before its "
        "timings",
        "each side first stores and loads one block (chunk) of other tokens, untimed: "
        "LMCache's engine pays about half a second of one-time setup on its first calls",
        "restart: both sides close, then a new process opens the same directory and looks "
        "the prefix up (LMCache's processes run with PYTHONHASHSEED=0, so its chunk keys are "
        "the same in every process)",
        f"cold reads: {ctx.cold_read_method}; LMCache reads with O_DIRECT too",
    ]
