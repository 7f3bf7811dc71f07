"""Suite "e2e-serve": two vLLM OpenAI servers (CPU, SmolLM2-135M-Instruct) driven by vLLM's own
benchmark client (``vllm bench serve``, ``vllm.benchmarks.serve``, run by ``vllm_client``), at
rising request rates.

Three setups, one after the other, each two servers on this machine:

- **cmx**: CMXConnector in both, sharing one service on a local Ray cluster;
- **none**: vLLM without a connector;
- **offloading**: vLLM's own ``OffloadingConnector`` (CPU offloading), each server its own.

Each setup sweeps the rates (``serve_sweep``): for each dataset they rise, one run per rate,
until a run breaks the TTFT p99 target (10 s) or a request fails, through at most ten rates
(``ServeSettings.rates``, 0.2 to 4.5 requests/s). Each rate is one run of two clients started
together, one per server, each sending half the requests at half the rate, the same requests
(same seed), the second ``lag_s`` later; each run draws prompts of its own (its own seed), so
that no run finds an earlier one's prefixes cached, in a server or in the service, and every
setup gets the same prompts. With
vLLM's ``prefix_repetition`` dataset (each of ``num_prefixes`` long prefixes in four requests,
two per server) the first client sends them shuffled and the second grouped by prefix, so a
prefix reaches the two servers in different orders: without a connector each server computes
every prefix once, with one the server that comes second can find it computed by the other.
The other workload is ``random`` with one prefix shared by all (``--random-prefix-len``).
Throughput and TTFT p50/p99 come from the clients' result files, merged (``vllm_results``).
With ``rounds`` above 1 (``--reps``, 3 by default) the setups alternate (cmx, none, cmx, none,
...), every round with prompts of its own and a sweep of its own, and the table pools a rate's
runs: the p99 of every request of every round that reached the rate.
Every run counts the CPU-seconds of the two servers' process trees (the API servers, their
engine cores, the connector inside them), of the clients and of the rest (the local Ray
cluster and the service's actors), beside the machine's busy time (``proc_cpu``).
The judged figure: requests/s at a TTFT p99 of at most 10 s with the connector,
over vLLM's alone (``sustained``), one sample per round, paired by round. A setup whose servers
do not start is recorded with its error and the others run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cmx.bench.harness.core import BenchContext, SuiteResult
from cmx.bench.harness.proc_cpu import CpuMeter, CpuUse
from cmx.bench.suites.e2e.serve_report import Rounds, per_rate, report, sustained
from cmx.bench.suites.e2e.serve_sweep import RATES, check_rates, sweep
from cmx.bench.suites.e2e.vllm_results import (
    ClientResult,
    ServeRun,
    pool,
    prompt_tokens,
    read_result,
)

__all__ = ["SETUPS", "ServeSettings", "client_args", "run_e2e_serve", "sustained"]

SETUPS = ("cmx", "none", "offloading")
MiB = 1 << 20


@dataclass(frozen=True)
class ServeSettings:
    # Sized to two cores, where a server prefills about 250 tokens/s: a prefix computed costs
    # ~4 s of TTFT, one found costs a fraction of a second, and a p99 of 10 s is reachable.
    prefix_len: int = 1024  # tokens of each shared prefix
    suffix_len: int = 64  # tokens of each request's own tail
    num_prefixes: int = 8  # prefix_repetition: distinct prefixes, each in 4 requests of 32
    output_len: int = 4  # generated tokens per request
    num_prompts: int = 32  # per run, both clients together
    rates: tuple[float, ...] = RATES  # requests/s, both clients: rising, swept to a break
    lag_s: float = 5.0  # the second client starts this much after the first
    rounds: int = 1  # the setups run this many times, alternating, each round its own prompts
    datasets: tuple[str, ...] = ("prefix_repetition", "random")
    start_timeout_s: float = 900.0  # one server's start
    run_timeout_s: float = 1800.0  # one run of the clients

    def __post_init__(self) -> None:
        per_client = self.num_prompts // 2
        if "prefix_repetition" in self.datasets and per_client < self.num_prefixes:
            raise ValueError(f"each of the two clients sends {per_client} requests, fewer than "
                             f"the {self.num_prefixes} prefixes prefix_repetition shares: "
                             f"num_prompts must be at least {2 * self.num_prefixes}")
        check_rates(self.rates)
        if self.rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {self.rounds}")

    @property
    def max_model_len(self) -> int:
        return self.prefix_len + self.suffix_len + self.output_len + 64


def client_args(dataset: str, s: ServeSettings, url: str, model: str, rate: float,
                prompts: int, result: Path, seed: int = 0) -> list[str]:
    """``vllm.benchmarks.serve``'s arguments for one client of a run; ``seed`` draws its
    prompts (prefixes and tails) and arrival times."""
    args = ["--backend", "vllm", "--base-url", url, "--model", model, "--tokenizer", model,
            "--dataset-name", dataset, "--num-prompts", str(prompts),
            "--request-rate", f"{rate:g}", "--seed", str(seed), "--ignore-eos", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result.parent),
            "--result-filename", result.name]
    if dataset == "prefix_repetition":
        return args + ["--prefix-repetition-prefix-len", str(s.prefix_len),
                       "--prefix-repetition-suffix-len", str(s.suffix_len),
                       "--prefix-repetition-num-prefixes", str(s.num_prefixes),
                       "--prefix-repetition-output-len", str(s.output_len)]
    if dataset == "random":
        return args + ["--random-prefix-len", str(s.prefix_len),
                       "--random-input-len", str(s.suffix_len),
                       "--random-output-len", str(s.output_len)]
    raise ValueError(f"unknown dataset {dataset!r}")


def _kv_config(setup: str, address: str, service: dict[str, Any]) -> dict[str, Any] | None:
    if setup == "none":
        return None
    if setup == "offloading":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}
    from cmx.bench.suites.e2e.e2e_engine import transfer_config

    return transfer_config(setup, address, service)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Server:
    """One ``vllm.entrypoints.openai.api_server`` process."""

    def __init__(self, model: str, kv: dict[str, Any] | None, max_len: int, log: Path) -> None:
        self.port = _free_port()
        self.log = log
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(self.port), "--block-size", "32",
               "--max-model-len", str(max_len), "--dtype", "bfloat16", "--enforce-eager",
               "--seed", "0"]
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        threads = max(1, (os.cpu_count() or 2) // 2)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(threads),
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_NO_USAGE_STATS": "1"}
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {_tail(self.log)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise TimeoutError(f"server not ready in {timeout_s:.0f} s: {_tail(self.log)}")

    def prompt_tokens(self) -> dict[str, float]:
        """The server's prompt tokens so far, by source (``vllm_results.prompt_tokens``)."""
        import httpx

        return prompt_tokens(httpx.get(f"{self.url}/metrics", timeout=30).text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _tail(log: Path, lines: int = 3) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    errors = [t for t in text if "Error" in t or "error" in t]
    return " | ".join((errors or text)[-lines:])[-600:]


def _run(servers: list[_Server], model: str, dataset: str, s: ServeSettings, rate: float,
         out: Path, seed: int) -> Run:
    """One run: a client per server, together, with prompts of their own (``seed``): no
    prefix of an earlier run is cached anywhere, in the servers or in the service. Their
    results, the CPU-seconds taken while they ran, and the servers' prompt tokens by source."""
    before = [srv.prompt_tokens() for srv in servers]
    with CpuMeter({"servers": [srv.proc.pid for srv in servers]}) as meter:
        results = _clients(meter, servers, model, dataset, s, rate, out, seed)
    assert meter.use is not None
    tokens: dict[str, float] = {}
    for srv, was in zip(servers, before, strict=True):
        for source, n in srv.prompt_tokens().items():
            tokens[source] = tokens.get(source, 0.0) + n - was.get(source, 0.0)
    return results, meter.use, tokens


def _clients(meter: CpuMeter, servers: list[_Server], model: str, dataset: str,
             s: ServeSettings, rate: float, out: Path, seed: int) -> list[ClientResult]:
    n = len(servers)
    procs, paths = [], []
    for i, server in enumerate(servers):
        if i:
            time.sleep(s.lag_s)
        path = out / f"{dataset}-{rate:g}-{seed}-{i}.json"
        args = client_args(dataset, s, server.url, model, rate / n, s.num_prompts // n, path,
                           seed)
        if i and dataset == "prefix_repetition":
            # The same requests, grouped by prefix rather than shuffled: a prefix reaches the
            # servers in different orders, and either may be the first to compute it.
            args.append("--disable-shuffle")
        log = open(out / f"{path.stem}.log", "w")  # noqa: SIM115 - closed when it ends
        proc = subprocess.Popen([sys.executable, "-m", "cmx.bench.suites.e2e.vllm_client", *args],
                                stdout=log, stderr=subprocess.STDOUT)
        meter.add("clients", proc.pid)
        procs.append((proc, log))
        paths.append(path)
    for proc, log in procs:
        try:
            code = proc.wait(s.run_timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        if code:
            raise RuntimeError(f"vllm bench serve exited with {code}: "
                               f"{_tail(Path(log.name))}")
    return [read_result(p) for p in paths]


Run = tuple[list[ClientResult], CpuUse, dict[str, float]]
Runs = dict[tuple[str, float], list[Run]]


def _setup(ctx: BenchContext, setup: str, s: ServeSettings, address: str,
           service: dict[str, Any], round_: int, runs: Runs) -> dict[tuple[str, float], ServeRun]:
    """One round of a setup: its two servers started, and for every dataset the rates swept
    until a run breaks the p99 target (``serve_sweep.sweep``), each run added to ``runs``.
    The round's own runs, merged, by dataset and rate."""
    from cmx.models import smollm2_path

    model = smollm2_path()
    out = ctx.scratch(f"e2e-serve-{setup}-{round_}")
    kv = _kv_config(setup, address, service)
    servers = [_Server(model, kv, s.max_model_len, out / f"server-{i}.log") for i in range(2)]
    try:
        for server in servers:
            server.wait_ready(s.start_timeout_s)
        ctx.log(f"e2e-serve {setup}: servers on {servers[0].port}, {servers[1].port}")
        mine: dict[tuple[str, float], ServeRun] = {}
        for d, dataset in enumerate(s.datasets):

            def measure(rate: float, d: int = d, dataset: str = dataset) -> ServeRun:
                seed = 1 + 1000 * round_ + 100 * d + s.rates.index(rate)  # same in every setup
                results, cpu, tokens = _run(servers, model, dataset, s, rate, out, seed)
                runs.setdefault((dataset, rate), []).append((results, cpu, tokens))
                run = pool([results])
                ctx.log(f"e2e-serve {setup} round {round_} {dataset} {rate:g} req/s: "
                        f"{run.request_throughput:.2f} req/s, TTFT p50 {run.ttft_p50_ms:.0f} ms,"
                        f" p99 {run.ttft_p99_ms:.0f} ms, {run.failed} failed; CPU-s "
                        + ", ".join(f"{g} {v:.0f}" for g, v in cpu.groups.items())
                        + f", machine {cpu.machine_busy_s:.0f} of {cpu.wall_s * cpu.cores:.0f}; "
                        + ", ".join(f"{k} {v:.0f}" for k, v in tokens.items()) + " tokens")
                return run

            mine.update(((dataset, rate), run) for rate, run in sweep(s.rates, measure))
        return mine
    finally:
        for server in servers:
            server.stop()


def run_e2e_serve(ctx: BenchContext, settings: ServeSettings | None = None,
                  setups: tuple[str, ...] = SETUPS) -> SuiteResult:
    from cmx.bench.harness.cluster import bench_cluster
    from cmx.config import ServiceConfig

    s = settings or ServeSettings(rounds=ctx.config.reps)
    result = SuiteResult("e2e-serve", command="")
    every: dict[str, Runs] = {}
    by_round: Rounds = {}
    failed: dict[str, str] = {}  # setup -> its error
    for round_ in range(s.rounds):
        for setup in setups:
            if setup in failed:
                continue
            runs = every.setdefault(setup, {})
            try:
                if setup == "cmx":
                    config = ServiceConfig(block_bytes=2 * MiB, hbm_bytes=128 * MiB,
                                           dram_bytes=1024 * MiB, nvme_bytes=4096 * MiB,
                                           nvme_dir=str(ctx.scratch("e2e-serve-nvme")))
                    with bench_cluster(config) as bc:
                        mine = _setup(ctx, setup, s, bc.cluster.address, asdict(bc.config),
                                      round_, runs)
                else:
                    mine = _setup(ctx, setup, s, "", {}, round_, runs)
                by_round.setdefault(setup, []).append(mine)
            except Exception as exc:  # noqa: BLE001 - one setup that fails must not cost the others
                failed[setup] = f"{type(exc).__name__}: {exc}"
                every.pop(setup, None)
                by_round.pop(setup, None)
                result.notes.append(f"setup {setup!r}: no figures ({type(exc).__name__}: {exc})")
                ctx.log(f"e2e-serve {setup} failed: {exc}")
    got = {setup: {key: pool([r for r, _, _ in rs]) for key, rs in runs.items()}
           for setup, runs in every.items()}
    cpu = {setup: {key: sum((c for _, c, _ in rs[1:]), rs[0][1]) for key, rs in runs.items()}
           for setup, runs in every.items()}
    tokens = {setup: {key: _add(t for _, _, t in rs) for key, rs in runs.items()}
              for setup, runs in every.items()}
    report(result, got, cpu, s.rounds, tokens, by_round, failed)
    result.notes.append(
        f"SmolLM2-135M-Instruct, vLLM OpenAI server (CPU, bfloat16, blocks of 32 tokens), two "
        f"servers per setup; {s.num_prompts} requests per run ({s.prefix_len}-token prefixes, "
        f"{s.suffix_len}-token tails, {s.output_len} output tokens), the second client "
        f"{s.lag_s:g} s after the first with the same requests; rates rising from "
        f"{s.rates[0]:g} to at most {s.rates[-1]:g} req/s ({len(s.rates)} rates), each "
        f"setup's stopping after its first run past a TTFT p99 of 10 s or with a request "
        f"failed; {per_rate(s.rounds)}"
        + ("" if s.rounds == 1 else ", the setups alternating round by round"))
    return result


def _add(counts: Iterable[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0.0) + v
    return total
