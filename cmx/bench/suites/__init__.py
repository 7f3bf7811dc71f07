"""The suites of ``cmx bench``, by name in ``SUITES``.

Each suite is a function ``(BenchContext) -> SuiteResult``, imported only when it runs; a new
suite is a new module (or a module in its family's folder) and one line in ``SUITES``. Suites
import the harness (``cmx.bench.harness``), and a family's modules each other; no suite imports
another family's.

    limits     "limits": fio's O_DIRECT matrix and memcpy, the baselines alone
    stores     "nvme", "dram", "slices": NvmeStore and DramStore against fio and memcpy, and one
               KV head as 512-byte pieces served by NvmeStore.read_runs
    service    "transfer", "directory", "pool": the service on a local multi-node Ray cluster
    xhost      "transfer-hosts": that load between two hosts with only TCP between them, against
               one TCP stream
    lookups    "lookups": 1,000-block lookups under 16 callers, node plane against the directory
    million    "million": a 1M-token prefix (62,500 blocks of 16 KiB) stored, looked up (as
               ContextMemory and as the vLLM scheduler) and loaded, each beside a warm memcpy
    heads      "heads": one KV head of eight through the service against a whole load, per tier
    layers     "layers": the vLLM connector's loads in groups of layers, layer 0's wait against
               the last's and against the whole prefix first
    hits       "service", "pressure": local hits against Ray round trips, the client's checksum
               of a load, a prefix on NVMe, and one eight times HBM and DRAM, against fio
    copies     "copies": a 512 MiB DRAM hit into the caller's buffer and a new tensor: the
               caller's CPU and wall against a warm memcpy
    lmcache    "lmcache", "prefetch": the stores against LMCache 0.5 in a virtual environment of
               its own, and loads started at a request's arrival against at its scheduling
    dpu        "dpu": loads through an agent on the host and one on a DPU over NIXL
    e2e        "e2e", "e2e-miss", "e2e-serve", "prefill-decode": time to first token through the
               Serve application, a miss's cost with and without CMXConnector, vLLM's OpenAI
               servers driven by ``vllm bench serve``, and ``cmx serve``'s prefill and decode
               replicas against colocated ones, driven the same way
    soak       "soak": ``cmx serve`` under streamed OpenAI traffic for ``--minutes`` while actors
               and replicas are killed
"""

from __future__ import annotations

__all__ = ["NAMED_ONLY", "SUITES"]

# name -> "module:function"; the default run is every suite but NAMED_ONLY, in this order.
SUITES: dict[str, str] = {
    "limits": "cmx.bench.suites.limits:run_limits",
    "nvme": "cmx.bench.suites.stores.storage:run_nvme",
    "dram": "cmx.bench.suites.stores.storage:run_dram",
    "slices": "cmx.bench.suites.stores.slices:run_slices",
    "transfer": "cmx.bench.suites.service:run_transfer",
    "transfer-hosts": "cmx.bench.suites.xhost.xhost:run_transfer_hosts",
    "directory": "cmx.bench.suites.service:run_directory",
    "lookups": "cmx.bench.suites.lookups:run_lookups",
    "million": "cmx.bench.suites.million:run_million",
    "pool": "cmx.bench.suites.service:run_pool",
    "heads": "cmx.bench.suites.heads:run_heads",
    "layers": "cmx.bench.suites.layers:run_layers",
    "service": "cmx.bench.suites.hits.hits:run_service",
    "copies": "cmx.bench.suites.copies:run_copies",
    "pressure": "cmx.bench.suites.hits.pressure:run_pressure",
    "lmcache": "cmx.bench.suites.lmcache.peer:run_lmcache",
    "prefetch": "cmx.bench.suites.lmcache.prefetch:run_prefetch",
    "dpu": "cmx.bench.suites.dpu:run_dpu",
    "e2e": "cmx.bench.suites.e2e.e2e:run_e2e",
    "e2e-miss": "cmx.bench.suites.e2e.e2e_miss:run_e2e_miss",
    "e2e-serve": "cmx.bench.suites.e2e.vllm_serve:run_e2e_serve",
    "prefill-decode": "cmx.bench.suites.e2e.prefill_decode:run_prefill_decode",
    "soak": "cmx.bench.suites.soak.soak:run_soak",
}
# Suites the default run leaves out, run only when named: the soak takes half an hour.
NAMED_ONLY: frozenset[str] = frozenset({"soak"})
