"""One vLLM engine (offline ``LLM`` API) in a process of its own, timing the requests it is sent.

    python -m cmx.bench.suites.e2e.e2e_engine SPEC_JSON

``SPEC_JSON`` holds ``EngineSpec``'s fields. The process answers ``ready`` once its engine is
up, then reads one JSON request per line on stdin (``{"tokens": n, "seed": s, "params": {...} |
null, "follow": seed | null}``) and answers each with one line on stdout, both prefixed with
``MARK``; vLLM's own log lines around them are kept in a file by ``EngineProcess``.

A request is a fresh prompt of ``tokens`` random ids (``e2e_pairs.prompt_ids``) and one
generated token, so the wall time of ``LLM.generate`` is its time to first token as the caller
sees it. ``params`` is the request's ``kv_transfer_params`` (``{"cmx": {"skip": true}}`` opts
out). ``follow`` sends a second fresh prompt of the same length the moment the first returns,
and times it too: work the first request left behind (a connector's stores) shows there.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = ["MARK", "EngineProcess", "EngineSpec", "transfer_config"]

MARK = "CMXBENCH "


@dataclass(frozen=True)
class EngineSpec:
    model: str  # the model's directory
    connector: str = "none"  # "cmx": CMXConnector; "none": vLLM without a connector
    ray_address: str = ""  # the service's Ray cluster (connector "cmx")
    service: dict[str, Any] = field(default_factory=dict)  # ServiceConfig fields, for "cmx"
    max_model_len: int = 8192
    block_size: int = 32  # vLLM's CPU attention takes multiples of 32
    dtype: str = "bfloat16"
    threads: int = 1  # OpenMP threads of the engine's forward passes
    kv_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE

    def environ(self) -> dict[str, str]:
        """The environment vLLM's CPU backend reads at start."""
        return {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_gib), "OMP_NUM_THREADS": str(self.threads),
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_NO_USAGE_STATS": "1"}


def transfer_config(connector: str, ray_address: str,
                    service: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's ``kv_transfer_config`` for ``connector``; None for "none"."""
    if connector == "none":
        return None
    if connector == "cmx":
        return {"kv_connector": "CMXConnector", "kv_connector_module_path": "cmx.connectors.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"service": service, "ray_address": ray_address}}
    raise ValueError(f"unknown connector {connector!r}: 'cmx' or 'none'")


def _serve(spec: EngineSpec) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from cmx.bench.suites.e2e.e2e_pairs import prompt_ids

    # The ignore below: vLLM's LLM() takes these as untyped kwargs
    llm = LLM(model=spec.model, enforce_eager=True, block_size=spec.block_size,
              max_model_len=spec.max_model_len, dtype=spec.dtype, seed=0,  # type: ignore[arg-type]
              kv_transfer_config=transfer_config(spec.connector, spec.ray_address, spec.service))

    def once(n: int, seed: int, params: Any) -> tuple[float, Any]:
        extra = {"kv_transfer_params": params} if params else None
        sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, extra_args=extra)
        prompt = TokensPrompt(prompt_token_ids=prompt_ids(seed, n))
        t0 = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        return time.perf_counter() - t0, out

    _say({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        ttft, out = once(req["tokens"], req["seed"], req.get("params"))
        answer = {"ttft_s": ttft, "cached": out.num_cached_tokens,
                  "report": out.kv_transfer_params}
        if req.get("follow") is not None:
            answer["follow_ttft_s"] = once(req["tokens"], req["follow"], None)[0]
        _say(answer)


def _say(obj: dict[str, Any]) -> None:
    print(MARK + json.dumps(obj), flush=True)


class EngineProcess:
    """The parent's handle on one engine process: start, ask, stop."""

    def __init__(self, spec: EngineSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        env = {**os.environ, **spec.environ()}
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cmx.bench.suites.e2e.e2e_engine", json.dumps(asdict(spec))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def wait_ready(self, timeout_s: float = 900) -> None:
        """Return once the engine is up (its first answer); it starts in the background."""
        self._next(timeout_s)

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            if line.startswith(MARK):
                self._answers.put(json.loads(line[len(MARK):]))
            else:
                self._log.write(line)
        self._answers.put(None)  # the process ended

    def _next(self, timeout_s: float) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"engine {self.spec.connector!r} gave no answer in "
                               f"{timeout_s:.0f} s; its log: {self.log_path}") from None
        if answer is None:
            raise RuntimeError(f"engine {self.spec.connector!r} exited with "
                               f"{self.proc.wait()}; its log: {self.log_path}")
        return answer

    def ask(self, tokens: int, seed: int, params: dict[str, Any] | None = None,
            follow: int | None = None, timeout_s: float = 900) -> dict[str, Any]:
        """Time one request (and its follower); the engine's answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"tokens": tokens, "seed": seed, "params": params,
                                          "follow": follow}) + "\n")
        self.proc.stdin.flush()
        return self._next(timeout_s)

    def stop(self, timeout_s: float = 60) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


if __name__ == "__main__":
    _serve(EngineSpec(**json.loads(sys.argv[1])))
