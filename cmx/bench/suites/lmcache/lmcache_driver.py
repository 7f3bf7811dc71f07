"""LMCache's side of ``cmx bench lmcache`` and ``cmx bench prefetch``, run in LMCache's own venv.

    python lmcache_driver.py SPEC.json OUT.json

This script never imports cmx: it runs with the Python of a separate virtual environment that
holds LMCache 0.5 and a CPU build of torch. SPEC names one operation and its sizes; OUT receives
one JSON object of timings (seconds) and counts. Operations:

- ``probe``: versions of lmcache and torch.
- ``disk``: a fresh engine on ``disk_dir`` (LocalDiskBackend, O_DIRECT, no CPU hot cache);
  ``store`` of the whole prefix, timed until every chunk's file is written; ``lookup`` +
  ``retrieve`` of the whole prefix; the same again, then slicing one KV head out of it.
- ``restart``: a fresh engine on the ``disk_dir`` a previous ``disk`` run filled; ``lookup``
  of the same tokens: how many are still hits, and how many of the prefix's chunk files (by
  the engine's own key-to-path mapping) lie on disk.
- ``cpu``: LocalCPUBackend only; ``store`` then ``lookup`` + ``retrieve``.
- ``prefetch``: store the prefix on disk (in batches), then a cold blocking load per
  repetition; then per repetition, for each queue wait W of ``waits`` (seconds, fixed by the
  suite, ``cmx.bench.suites.lmcache.prefetch.QUEUE_WAITS_S``): ``async_lookup_and_prefetch``
  at the request's arrival, sleep W, then wait for the prefetch's completion and
  ``retrieve``. ``ready_s`` lists, in the order of ``waits``, each wait's times.

Every engine first stores and loads one chunk of other tokens, untimed (``Bench.warm_up``).

LMCache's stock GPU connectors need CUDA; ``CpuConnector`` stands in for one, copying between
the engine's CPU memory objects and a CPU "KV cache" of one slot per chunk, each slot in
LMCache's own chunk layout [2, layers, chunk tokens, heads * head_dim], so every copy is one
contiguous memcpy (the cheapest a connector can do). Source and destination are rings of slots
(chunk ``i`` uses slot ``i mod slots``), so a 10 GiB prefix needs no 10 GiB source tensor.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

GIB = 1 << 30
INSTANCE = "cmx-bench"
WARMUP_CHUNKS = 1


class CpuConnector(GPUConnectorInterface):
    """Copies chunks between memory objects and rings of chunk slots (``kv_src``, ``kv_dst``)."""

    def __init__(self, layers: int, hidden: int) -> None:
        self.layers = layers
        self.hidden = hidden

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.hidden])

    @staticmethod
    def _slot(kv: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The slot of the chunk that starts at token ``start`` (its first ``end - start``)."""
        chunk = kv.shape[3]
        return kv[(start // chunk) % kv.shape[0], :, :, : end - start]

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(self._slot(kwargs["kv_src"], start, end))

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self._slot(kwargs["kv_dst"], start, end).copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(obj, start, end, **kwargs)


class Scheduler:
    """Stands in for vLLM's scheduler: told by the engine when a request's prefetch is done."""

    def __init__(self) -> None:
        self._done: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self.hits: dict[str, int] = {}

    def _event(self, lookup_id: str) -> threading.Event:
        with self._lock:
            return self._done.setdefault(lookup_id, threading.Event())

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        self.hits[lookup_id] = num_hit_tokens
        self._event(lookup_id).set()

    def wait(self, lookup_id: str, timeout: float = 600.0) -> None:
        if not self._event(lookup_id).wait(timeout):
            raise TimeoutError(f"prefetch {lookup_id} not done after {timeout} s")


class Bench:
    """One engine and the rings of chunk slots it stores from and retrieves into."""

    def __init__(self, spec: dict[str, Any], *, disk: bool, cpu: bool,
                 async_loading: bool = False) -> None:
        g = spec["geometry"]
        self.chunk = int(spec["chunk_tokens"])
        self.tokens = int(spec["tokens"])
        self.layers, self.heads, self.head_dim = g["layers"], g["kv_heads"], g["head_dim"]
        self.hidden = self.heads * self.head_dim
        dtype = getattr(torch, g["dtype"])
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.token_bytes = 2 * self.layers * self.hidden * itemsize
        prefix_gib = self.tokens * self.token_bytes / GIB
        extra: dict[str, Any] = {"use_odirect": True}
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=self.chunk,
            local_cpu=cpu,
            # Every memory object of a whole-prefix store or retrieve is held at once.
            max_local_cpu_size=prefix_gib + 0.5,
            local_disk=str(spec["disk_dir"]) + "/" if disk else None,
            max_local_disk_size=prefix_gib + 1.0 if disk else 0.0,
            extra_config=extra if disk else None,
            enable_async_loading=async_loading,
        )
        shape = (self.layers, 2, self.chunk, self.heads, self.head_dim)
        metadata = LMCacheMetadata(
            model_name=spec.get("model", "llama-3-8b"), world_size=1, local_world_size=1,
            worker_id=0, local_worker_id=0, kv_dtype=dtype, kv_shape=shape,
            chunk_size=self.chunk,
        )
        connector = CpuConnector(self.layers, self.hidden)
        self.engine = LMCacheEngineBuilder.get_or_create(
            INSTANCE, config, metadata, connector, lambda _t, _r: None, lambda o, _r: o)
        self.scheduler = Scheduler()
        self.engine.post_init(async_lookup_server=self.scheduler)
        chunks = self.tokens // self.chunk
        ring = min(chunks, max(1, int(spec.get("ring_tokens", self.tokens)) // self.chunk))
        seed = int(spec.get("seed", 0))
        # Token ids depend on the seed alone, so a restart run asks for the same prefix.
        ids = torch.Generator().manual_seed(seed)
        self.token_ids = torch.randint(0, 128_256, (self.tokens,), generator=ids)
        kv = torch.Generator().manual_seed(seed + 1)
        slot = (2, self.layers, self.chunk, self.hidden)
        self.src = torch.randn(ring, *slot, generator=kv).to(dtype)
        self.dst = torch.empty(chunks if spec.get("full_destination") else ring, *slot,
                               dtype=dtype)
        self.prefault()

    def prefault(self) -> None:
        """Touch every page of the CPU memory pool and of the destination, untimed.

        Page faults are memory work, not I/O; cmx's side faults its destination in beforehand
        too. Here, with memory scarce, first touches cost up to ~0.1 s per 2 MiB.
        """
        pool = self.engine.storage_manager.local_cpu_backend.get_memory_allocator()
        buffer = getattr(pool, "buffer", None)
        if isinstance(buffer, torch.Tensor):
            buffer.view(torch.uint8).fill_(0)  # nothing is allocated from it yet
        self.dst.view(torch.uint8).fill_(0)

    @property
    def nbytes(self) -> int:
        return self.tokens * self.token_bytes

    def close(self) -> None:
        LMCacheEngineBuilder.destroy(INSTANCE)

    def _disk_backend(self) -> Any:
        return self.engine.storage_manager.storage_backends["LocalDiskBackend"]

    def on_disk(self) -> int:
        """Chunks in the disk backend's index."""
        return len(self._disk_backend().dict)

    def wait_written(self, chunks: int, timeout: float = 1800.0) -> None:
        """Until ``chunks`` chunks are indexed on disk (LMCache writes from a thread pool)."""
        disk = self._disk_backend()
        deadline = time.perf_counter() + timeout
        while disk.disk_worker.put_tasks or len(disk.dict) < chunks:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{len(disk.dict)} of {chunks} chunks written")
            time.sleep(0.001)

    def warm_up(self, disk: bool) -> None:
        """Store and load WARMUP_CHUNKS chunks of other tokens, untimed.

        The engine's first calls pay one-time setup (about half a second here), which would
        otherwise weigh on small runs.
        """
        ids = torch.arange(WARMUP_CHUNKS * self.chunk) + 200_000  # no prefix token is this
        base = self.on_disk() if disk else 0
        self.engine.store(ids, kv_src=self.src)
        if disk:
            self.wait_written(base + WARMUP_CHUNKS)
        was_async = self.engine.async_loading
        self.engine.async_loading = False  # the blocking path's first call
        self.load(ids)
        self.engine.async_loading = was_async
        if was_async:
            self.prefetched_load("warm-up", 0.0, ids)

    def store(self, batch_tokens: int | None = None, disk: bool = True) -> float:
        """Seconds to store the whole prefix (on disk: until every file is written)."""
        batch = batch_tokens or self.tokens
        base = self.on_disk() if disk else 0
        t0 = time.perf_counter()
        for first in range(0, self.tokens, batch):
            end = min(self.tokens, first + batch)
            mask = torch.zeros(end, dtype=torch.bool)
            mask[first:] = True
            self.engine.store(self.token_ids[:end], mask=mask, kv_src=self.src)
            if disk:
                self.wait_written(base + end // self.chunk)
        return time.perf_counter() - t0

    def load(self, ids: torch.Tensor | None = None) -> tuple[float, int]:
        """Seconds of lookup + blocking retrieve of the prefix (or ``ids``), tokens retrieved."""
        ids = self.token_ids if ids is None else ids
        t0 = time.perf_counter()
        hit = self.engine.lookup(ids)
        got = self.engine.retrieve(ids[:hit], kv_dst=self.dst) if hit else None
        seconds = time.perf_counter() - t0
        return seconds, int(got.sum()) if got is not None else 0

    def prefix_files(self) -> int:
        """How many of the prefix's chunk files lie on disk, by the engine's own key paths."""
        disk = self._disk_backend()
        keys = [key for _, _, key in self.engine.token_database.process_tokens(self.token_ids)]
        return sum(1 for key in keys if os.path.exists(disk._key_to_path(key)))

    def load_head(self, head: int) -> float:
        """Seconds to have one KV head of every layer and token: whole chunks, then a slice."""
        t0 = time.perf_counter()
        self.load()
        kv = self.dst.view(*self.dst.shape[:4], self.heads, self.head_dim)
        kv[..., head, :].contiguous()
        return time.perf_counter() - t0

    def verify(self) -> bool:
        """The destination holds what was stored (checked on the first and last chunks)."""
        for i in {0, self.tokens // self.chunk - 1}:
            if not torch.equal(self.dst[i % self.dst.shape[0]], self.src[i % self.src.shape[0]]):
                return False
        return True

    def prefetched_load(self, request: str, wait_s: float,
                        ids: torch.Tensor | None = None) -> tuple[float, int]:
        """Arrival: start the prefetch; wait ``wait_s`` in the queue; then seconds to ready."""
        ids = self.token_ids if ids is None else ids
        self.engine.async_lookup_and_prefetch(lookup_id=request, tokens=ids)
        time.sleep(wait_s)
        t0 = time.perf_counter()
        self.scheduler.wait(request)
        hit = self.scheduler.hits.get(request, 0)
        got = self.engine.retrieve(ids[:hit], req_id=request, kv_dst=self.dst)
        return time.perf_counter() - t0, int(got.sum())


def files_in(path: str) -> int:
    return sum(1 for p in Path(path).iterdir() if p.is_file()) if Path(path).is_dir() else 0


def op_probe(_spec: dict[str, Any]) -> dict[str, Any]:
    import importlib.metadata as md

    return {"lmcache": md.version("lmcache"), "torch": torch.__version__}


def op_disk(spec: dict[str, Any]) -> dict[str, Any]:
    bench = Bench(spec, disk=True, cpu=False)
    try:
        bench.warm_up(disk=True)
        store_s = bench.store()
        load_s, loaded = bench.load()
        ok = bench.verify()
        head_s = bench.load_head(int(spec.get("head", 0)))
        return {"bytes": bench.nbytes, "chunks": bench.tokens // bench.chunk,
                "store_s": store_s, "load_s": load_s, "loaded_tokens": loaded,
                "head_s": head_s, "verified": ok, "files": bench.prefix_files()}
    finally:
        bench.close()


def op_restart(spec: dict[str, Any]) -> dict[str, Any]:
    bench = Bench(spec, disk=True, cpu=False)
    try:
        files = bench.prefix_files()  # before the lookup: this engine has written nothing
        hit = bench.engine.lookup(bench.token_ids)
        return {"chunks": bench.tokens // bench.chunk, "hit_chunks": hit // bench.chunk,
                "hit_tokens": hit, "files_before": files,
                "files_in_dir": files_in(spec["disk_dir"])}
    finally:
        bench.close()


def op_cpu(spec: dict[str, Any]) -> dict[str, Any]:
    bench = Bench(spec, disk=False, cpu=True)
    try:
        bench.warm_up(disk=False)
        store_s = bench.store(disk=False)
        load_s, loaded = bench.load()
        return {"bytes": bench.nbytes, "store_s": store_s, "load_s": load_s,
                "loaded_tokens": loaded, "verified": bench.verify()}
    finally:
        bench.close()


def op_prefetch(spec: dict[str, Any]) -> dict[str, Any]:
    bench = Bench(spec, disk=True, cpu=False, async_loading=True)
    try:
        bench.warm_up(disk=True)
        store_s = bench.store(batch_tokens=int(spec.get("store_batch_tokens", 16384)))
        cold: list[float] = []
        for _ in range(int(spec["reps"])):
            # The blocking path (batched_get_blocking), as an engine built without
            # enable_async_loading retrieves: no preloading.
            bench.engine.async_loading = False
            seconds, loaded = bench.load()
            bench.engine.async_loading = True
            if loaded != bench.tokens:
                raise RuntimeError(f"cold load retrieved {loaded} of {bench.tokens} tokens")
            cold.append(seconds)
        waits = [float(w) for w in spec["waits"]]
        ready: list[list[float]] = [[] for _ in waits]
        for rep in range(int(spec["reps"])):
            for i, w in enumerate(waits):
                seconds, loaded = bench.prefetched_load(f"r{rep}-w{i}", w)
                if loaded != bench.tokens:
                    raise RuntimeError(f"prefetched load got {loaded} of {bench.tokens} tokens")
                ready[i].append(seconds)
        return {"bytes": bench.nbytes, "store_s": store_s, "cold_s": cold, "waits": waits,
                "ready_s": ready, "verified": bench.verify()}
    finally:
        bench.close()


OPS = {"probe": op_probe, "disk": op_disk, "restart": op_restart, "cpu": op_cpu,
       "prefetch": op_prefetch}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[1]).read_text())
    try:
        result = OPS[spec["op"]](spec)
        Path(argv[2]).write_text(json.dumps(result))
        code = 0
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # LMCache can leave non-daemon threads behind, which would keep a plain exit waiting.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
