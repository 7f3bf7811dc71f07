"""``cmx bench``: suites that measure the stores against the machine's own limits.

One module per group of suites; each suite is a function ``(BenchContext) -> SuiteResult``,
named in ``SUITES`` and imported only when it runs. A new suite is a new module and one line
here. Every figure is a ratio to a baseline measured in the same run (see ``core``).

    core     figures, goals (judged only on figures that can be judged), settings, cold caches
    intervals  two variants alternated per repetition; bootstrap intervals over the pairs
    machine  CPU, cores, memory, disk and kernel, for every report
    raw      "limits": fio O_DIRECT matrix and memcpy; the baselines other suites call
    storage  "nvme", "dram": NvmeStore and DramStore bandwidth against fio and memcpy
    slices   "slices": one KV head as 512-byte pieces, served by NvmeStore.read_runs
    service  "transfer", "directory", "pool": the service on a local multi-node Ray cluster
    xhost    "transfer-hosts": that load between two hosts with only TCP between them, against
             one TCP stream (xhost_run measures, tcp_copy copies)
    lookups  "lookups": 1,000-block lookups under 16 callers, node plane against the directory
    million  "million": a 1M-token prefix (62,500 blocks of 16 KiB) stored, looked up (as
             ContextMemory and as the vLLM scheduler) and loaded, each beside a warm memcpy
    heads    "heads": one KV head of eight through the service against a whole load, per tier
    hits     "service": local hits against Ray round trips; the client's checksum of a load
    copies   "copies": a 512 MiB DRAM hit into the caller's buffer and a new tensor: the
             caller's CPU and wall against a warm memcpy
    pressure "pressure": a prefix eight times HBM and DRAM loaded from NVMe, against fio
    layers   "layers": the vLLM connector's loads in groups of layers, layer 0's wait against
             the last's and against the whole prefix first
    dpu      "dpu": loads through an agent on the host and one on a DPU over NIXL
    cluster  that cluster
    e2e      "e2e": time to first token through the Serve application, cached against recompute
    e2e_miss "e2e-miss": a miss's cost, engines with and without CMXConnector paired (e2e_engine,
             e2e_pairs)
    vllm_serve "e2e-serve": vLLM's OpenAI servers driven by ``vllm bench serve`` (vllm_results,
             serve_report; proc_cpu: the CPU-seconds each process tree took)
    soak     "soak": ``cmx serve`` under streamed OpenAI traffic for ``--minutes`` while actors
             and replicas are killed (soak_traffic, soak_faults, soak_figures)
    report   JSON, markdown, plots, docs/BENCHMARKS.md
    render   a suite's figures as a table on the command line
    summary  the counts of PASS, MISS and inconclusive atop docs/BENCHMARKS.md, from its sections
    runner   runs suites in order and collects a BenchReport
"""

from __future__ import annotations

from cmx.bench.core import BenchConfig, BenchContext, Figure, Goal, SuiteResult, Verdict

__all__ = ["NAMED_ONLY", "SUITES", "BenchConfig", "BenchContext", "Figure", "Goal", "SuiteResult",
           "Verdict"]

# name -> "module:function"; the default run is every suite but NAMED_ONLY, in this order.
SUITES: dict[str, str] = {
    "limits": "cmx.bench.raw:run_limits",
    "nvme": "cmx.bench.storage:run_nvme",
    "dram": "cmx.bench.storage:run_dram",
    "slices": "cmx.bench.slices:run_slices",
    "transfer": "cmx.bench.service:run_transfer",
    "transfer-hosts": "cmx.bench.xhost:run_transfer_hosts",
    "directory": "cmx.bench.service:run_directory",
    "lookups": "cmx.bench.lookups:run_lookups",
    "million": "cmx.bench.million:run_million",
    "pool": "cmx.bench.service:run_pool",
    "heads": "cmx.bench.heads:run_heads",
    "layers": "cmx.bench.layers:run_layers",
    "service": "cmx.bench.hits:run_service",
    "copies": "cmx.bench.copies:run_copies",
    "pressure": "cmx.bench.pressure:run_pressure",
    "lmcache": "cmx.bench.peer:run_lmcache",
    "prefetch": "cmx.bench.prefetch:run_prefetch",
    "dpu": "cmx.bench.dpu:run_dpu",
    "e2e": "cmx.bench.e2e:run_e2e",
    "e2e-miss": "cmx.bench.e2e_miss:run_e2e_miss",
    "e2e-serve": "cmx.bench.vllm_serve:run_e2e_serve",
    "soak": "cmx.bench.soak:run_soak",
}
# Suites the default run leaves out, run only when named: the soak takes half an hour.
NAMED_ONLY: frozenset[str] = frozenset({"soak"})
