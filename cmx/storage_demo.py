"""``cmx demo``: a long prompt prefix's KV cache through host DRAM and local NVMe, and back.

What it shows, in order:

1. Keys: a Llama-3-8B namespace's digest chained over the prompt's token ids, one 32-byte key
   per 256-token block (32 MiB of KV each).
2. Store, write-through: every block goes into a DramStore smaller than the prefix (so the
   oldest blocks are evicted) and into an NvmeStore; then ``flush`` makes the NVMe copies durable.
3. Load: each block from the fastest tier that has it: DRAM under a pin, NVMe otherwise. Every
   loaded block is compared byte for byte with the block regenerated from its seed.
4. Restart: the NvmeStore is closed and reopened from its directory; its index still finds
   every block, and the first and last blocks read back identical.

KV payloads are generated one block at a time, between the stores' calls (never during them),
so memory holds a block or two whatever ``--tokens`` is, and store and load speeds, which count
only the time inside the stores' calls, are not shared with the generator.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cmx.buffers import aligned_empty, as_bytes_view
from cmx.errors import CmxError
from cmx.keys import BlockHash, Namespace, chain_keys
from cmx.layout import KVLayout

if TYPE_CHECKING:
    from cmx.storage import DramStore, NvmeStore

__all__ = ["LLAMA3_8B", "DemoOptions", "DemoResult", "TierReport", "run_demo"]

LLAMA3_8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                     block_tokens=256)
MODEL = "meta-llama/Meta-Llama-3-8B"
VOCAB = 128_256  # Llama-3 vocabulary size: token ids are drawn below it
STORE_DIR = "cmx-demo-nvme"  # the NvmeStore's directory inside the work dir

Progress = Callable[[str, int, int], None]  # (phase, bytes done, bytes in all)


@dataclass(frozen=True)
class DemoOptions:
    tokens: int = 24_576  # prompt prefix length; only full blocks are stored
    workdir: Path | None = None  # None: a new directory under /var/tmp (or the current one)
    keep: bool = False  # keep the NVMe store's files after the demo
    dram_bytes: int | None = None  # DramStore capacity; None: a third of the prefix
    seed: int = 0  # seeds token ids and KV payloads
    layout: KVLayout = LLAMA3_8B


@dataclass
class TierReport:
    name: str
    stored_blocks: int = 0
    store_seconds: float = 0.0
    loaded_blocks: int = 0
    load_seconds: float = 0.0
    capacity_bytes: int = 0
    evictions: int = 0
    policy: str = ""  # eviction policy, as the store names it


@dataclass
class DemoResult:
    tokens: int
    blocks: int
    block_bytes: int
    dram: TierReport
    nvme: TierReport
    from_dram: list[int] = field(default_factory=list)  # block indexes loaded from DRAM
    mismatched: list[int] = field(default_factory=list)  # block indexes whose bytes differ
    missing: list[int] = field(default_factory=list)  # blocks found in no tier
    reopened_found: int = 0  # keys the reopened NvmeStore still holds
    reopened_verified: bool = False  # first and last block read back identical after reopen
    io_engine: str = "?"
    store_dir: Path | None = None
    kept: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (not self.mismatched and not self.missing and self.reopened_verified
                and self.reopened_found == self.blocks)


def block_payload(layout: KVLayout, index: int, seed: int) -> np.ndarray:
    """The payload of block ``index``: random KV from its own seed, so it can be regenerated."""
    kv = layout.random_kv(layout.block_tokens, seed=seed * 1_000_003 + index)
    return as_bytes_view(layout.split_blocks(kv)[0])


def _payloads(layout: KVLayout, n: int, seed: int) -> Iterator[np.ndarray]:
    """Block payloads 0..n-1, one at a time, so memory holds one block whatever the prefix."""
    for i in range(n):
        yield block_payload(layout, i, seed)


def _workdir(opts: DemoOptions) -> tuple[Path, bool]:
    """The work directory and whether the demo created it (and so removes it)."""
    if opts.workdir is not None:
        created = not opts.workdir.exists()
        opts.workdir.mkdir(parents=True, exist_ok=True)
        return opts.workdir, created
    parent = Path("/var/tmp") if Path("/var/tmp").is_dir() else Path.cwd()
    return Path(tempfile.mkdtemp(prefix="cmx-demo-", dir=parent)), True


def token_ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n, dtype=np.uint32)


class Demo:
    """One run of the demo; ``progress(phase, done_bytes, total_bytes)`` reports long work."""

    def __init__(self, opts: DemoOptions, progress: Progress | None = None) -> None:
        self.opts = opts
        self.layout = opts.layout
        self.progress = progress or (lambda *_: None)
        ns = Namespace(MODEL, self.layout, salt="cmx-demo")
        self.keys: list[BlockHash] = chain_keys(ns.digest, token_ids(opts.tokens, opts.seed),
                                                self.layout.block_tokens)
        if not self.keys:
            raise CmxError(f"--tokens must be at least one block ({self.layout.block_tokens})")
        bb = self.layout.block_bytes
        self.prefix_bytes = len(self.keys) * bb
        dram = opts.dram_bytes if opts.dram_bytes is not None else len(self.keys) // 3 * bb
        self.dram_bytes = max(bb, dram // bb * bb)
        # Room for every block, and a quarter more: a log-structured store fills segments.
        self.nvme_bytes = self.prefix_bytes + self.prefix_bytes // 4 + bb

    def run(self) -> DemoResult:
        t0 = time.perf_counter()
        workdir, created = _workdir(self.opts)
        root = workdir / STORE_DIR
        made_root = False
        try:
            if root.exists():
                raise CmxError(f"{root} exists (from an earlier --keep?): remove it or pick --dir")
            free = shutil.disk_usage(workdir).free
            if free < self.nvme_bytes:
                raise CmxError(f"{workdir} has {free / 2**30:.1f} GiB free, the demo needs "
                               f"{self.nvme_bytes / 2**30:.1f} GiB: pick --dir or fewer --tokens")
            made_root = True
            result = self._run(root)
        finally:
            if not self.opts.keep:
                if created:
                    shutil.rmtree(workdir, ignore_errors=True)
                elif made_root:
                    shutil.rmtree(root, ignore_errors=True)
        result.seconds = time.perf_counter() - t0
        return result

    def _run(self, root: Path) -> DemoResult:
        from cmx.storage import DramStore, NvmeStore

        bb = self.layout.block_bytes
        result = DemoResult(self.opts.tokens, len(self.keys), bb,
                            TierReport("DRAM", capacity_bytes=self.dram_bytes),
                            TierReport("NVMe", capacity_bytes=self.nvme_bytes),
                            store_dir=root, kept=self.opts.keep)
        dram = DramStore(capacity_bytes=self.dram_bytes, block_bytes=bb)
        with dram:
            nvme = NvmeStore(root, capacity_bytes=self.nvme_bytes, block_bytes=bb)
            with nvme:
                self._store(dram, nvme, result)
                self._load(dram, nvme, result)
                result.io_engine = nvme.stats().io_engine
            dram_stats = dram.stats()
            result.dram.evictions = dram_stats.evictions
            result.dram.policy = dram_stats.eviction
        self._reopen(NvmeStore, root, result)
        return result

    def _store(self, dram: DramStore, nvme: NvmeStore, result: DemoResult) -> None:
        bb, parent = self.layout.block_bytes, None
        for i, payload in enumerate(_payloads(self.layout, len(self.keys), self.opts.seed)):
            key = self.keys[i]
            t = time.perf_counter()
            dram.put(key, payload, parent=parent)
            t2 = time.perf_counter()
            nvme.put(key, payload, parent=parent)
            t3 = time.perf_counter()
            result.dram.store_seconds += t2 - t
            result.nvme.store_seconds += t3 - t2
            parent = key
            self.progress("store", (i + 1) * bb, self.prefix_bytes)
        t = time.perf_counter()
        nvme.flush()
        result.nvme.store_seconds += time.perf_counter() - t
        result.dram.stored_blocks = result.nvme.stored_blocks = len(self.keys)

    def _load(self, dram: DramStore, nvme: NvmeStore, result: DemoResult) -> None:
        bb = self.layout.block_bytes
        buf = aligned_empty(bb)  # the requester's buffer, reused: what an engine would hand us
        buf[:] = 0  # fault it in now, not inside the first timed load
        for i, expected in enumerate(_payloads(self.layout, len(self.keys), self.opts.seed)):
            key = self.keys[i]
            t = time.perf_counter()
            if _copy_pinned(dram, key, buf):
                tier = result.dram
                result.from_dram.append(i)
            elif nvme.get_into(key, buf):
                tier = result.nvme
            else:
                result.missing.append(i)
                continue
            tier.load_seconds += time.perf_counter() - t
            tier.loaded_blocks += 1
            if not np.array_equal(buf, expected):
                result.mismatched.append(i)
            self.progress("load", (i + 1) * bb, self.prefix_bytes)

    def _reopen(self, store_cls: type[NvmeStore], root: Path, result: DemoResult) -> None:
        bb = self.layout.block_bytes
        nvme = store_cls(root, capacity_bytes=self.nvme_bytes, block_bytes=bb)
        with nvme:
            result.reopened_found = sum(key in nvme for key in self.keys)
            ends = sorted({0, len(self.keys) - 1})
            ok = True
            for i in ends:
                got = nvme.get(self.keys[i])
                ok = ok and got is not None and np.array_equal(
                    as_bytes_view(got), block_payload(self.layout, i, self.opts.seed))
            nvme.check_integrity()
        result.reopened_verified = ok


def _copy_pinned(dram: DramStore, key: BlockHash, out: np.ndarray) -> bool:
    """Copy a DRAM block into ``out`` under a pin, the loaders' protocol; False on a miss."""
    if not dram.pin(key):
        return False
    try:
        view = dram.view(key)
        if view is None:  # cannot happen while pinned; a miss rather than wrong data
            return False
        np.copyto(out[: view.nbytes], view)
        return True
    finally:
        dram.unpin(key)


def run_demo(opts: DemoOptions, progress: Progress | None = None) -> DemoResult:
    """Run the demo; ``progress(phase, done_bytes, total_bytes)`` is called as it goes."""
    return Demo(opts, progress).run()
