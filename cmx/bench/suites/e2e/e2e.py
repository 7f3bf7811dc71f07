"""Suite "e2e": time to first token through the Serve application on vLLM (CPU) with
SmolLM2-135M-Instruct, on a two-node local cluster with one replica per node
(``cmx.deploy.local``). Three applications, one after the other: vLLM with CMXConnector, with
vLLM's own ``ExampleConnector`` (its disk connector), and with no connector.

By prompt length (4K and 8K tokens: 8,128, the longest prompt that leaves room for its token in
SmolLM2's 8,192-token context; 16K does not fit it), each repetition with new random token ids:

- **Hit**: replica A computes (and stores) a prompt; replica B is sent another prompt sharing
  its first 90%. B's TTFT with the cache against the same prompt with ``"cache": false``
  (recompute, same replica). Goal: <= 0.25 of recompute.
- **Limit**: the same prefix once more on B, now in B's own vLLM prefix cache: prefill of the
  uncached tail alone over a prefix already in place. Goal: the hit within 1.5x of it.
- **Against ExampleConnector**: A computes a prompt, B is sent the same prompt (ExampleConnector
  matches whole prompts only), with each connector. Goal: CMX's hit >= 3x lower TTFT.
- **Miss overhead**: a prompt nobody stored, with CMXConnector against no connector.
  Goal: <= 1.05.

TTFT is the replica's own: from the request's arrival at the replica to its first token.
"""

from __future__ import annotations

import random
import time
from contextlib import AbstractContextManager
from typing import Any

from cmx.bench.harness.core import BenchContext, Figure, Goal, SuiteResult, Table

__all__ = ["LENGTHS", "run_e2e"]

LENGTHS = (4096, 8128)  # prompt tokens; SmolLM2-135M's context is 8,192 tokens
SHARE = 0.9  # of each prompt, the prefix the other replica stored
VOCAB = (1000, 40000)  # token ids drawn from here: ordinary text tokens of SmolLM2


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


class _Driver:
    def __init__(self, app: Any, ctx: BenchContext) -> None:
        import httpx

        self.app = app
        self.ctx = ctx
        self.http = httpx.Client(timeout=900)
        self.a, self.b = app.replicas  # head node's replica first

    def ttft(self, ids: list[int], replica: dict[str, str], cache: bool = True) -> dict[str, Any]:
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
                "replica": replica["replica"], "cache": cache}
        r = self.http.post(f"{self.app.openai_url}/completions", json=body)
        r.raise_for_status()
        ext: dict[str, Any] = r.json()["cmx"]
        if ext["replica"] != replica["replica"]:
            raise AssertionError(f"asked for {replica['replica']}, served by {ext['replica']}")
        return ext

    def wait_stored(self, ids: list[int], tokens: int) -> None:
        if self.app.options.engine.connector != "cmx":
            time.sleep(1.0)  # ExampleConnector writes its files in the step itself
            return
        ns = self.app.namespace()
        T = ns.layout.block_tokens
        tokens = min(tokens, len(ids)) // T * T
        deadline = time.monotonic() + 120
        while ns.lookup(ids).num_tokens < tokens:
            if time.monotonic() > deadline:
                raise AssertionError(f"{tokens} tokens never became visible")
            time.sleep(0.2)


def _app(options: Any, ctx: BenchContext, name: str) -> AbstractContextManager[Any]:
    from cmx.deploy.local import local_app

    return local_app(options, service={"placement": "write_through"}, step=ctx.log,
                     scratch=str(ctx.scratch(f"e2e-{name}")))


def _options(connector: str, lengths: tuple[int, ...]) -> Any:
    from cmx.deploy.config import EngineOptions, ServeOptions

    longest = max(lengths)
    kv_gib = max(2.0, 4 * longest * 23_040 / 2**30)  # room for four prompts of the longest
    engine = EngineOptions(connector=connector, max_model_len=longest + 64,
                           kv_cache_gib=round(kv_gib), max_num_seqs=4)
    return ServeOptions(engine=engine, replicas=2, app_name=f"cmx-e2e-{connector}")


def _cmx(d: _Driver, reps: int, lengths: tuple[int, ...]) -> dict[str, dict[str, list[float]]]:
    """Per length: hit, recompute, limit, same-prompt hit and fresh-prompt miss TTFTs."""
    out: dict[str, dict[str, list[float]]] = {}
    for n in lengths:
        got: dict[str, list[float]] = {k: [] for k in
                                       ("hit", "recompute", "limit", "same", "miss")}
        for rep in range(reps):
            rng = random.Random(n * 1000 + rep)
            prefix = _ids(rng, int(n * SHARE))
            d.ttft(prefix + _ids(rng, n - len(prefix)), d.a)
            d.wait_stored(prefix, len(prefix))
            prompt = prefix + _ids(rng, n - len(prefix))
            hit = d.ttft(prompt, d.b)
            got["hit"].append(hit["ttft_s"])
            got["recompute"].append(d.ttft(prompt, d.b, cache=False)["ttft_s"])
            got["limit"].append(d.ttft(prefix + _ids(rng, n - len(prefix)), d.b)["ttft_s"])
            whole = _ids(rng, n)
            d.ttft(whole, d.a)
            d.wait_stored(whole, n - 1)
            got["same"].append(d.ttft(whole, d.b)["ttft_s"])
            got["miss"].append(d.ttft(_ids(rng, n), d.b)["ttft_s"])
            d.ctx.log(f"cmx {n} rep {rep + 1}: hit {hit['ttft_s']:.3f} s "
                      f"({hit['loaded_tokens']} loaded), recompute {got['recompute'][-1]:.3f} s")
        out[str(n)] = got
    return out


def _other(d: _Driver, reps: int, lengths: tuple[int, ...], same: bool) -> dict[str, list[float]]:
    """Per length: TTFT on B of a prompt A computed first (``same``), else of a fresh one."""
    out: dict[str, list[float]] = {}
    for n in lengths:
        out[str(n)] = []
        for rep in range(reps):
            rng = random.Random(n * 7919 + rep)
            prompt = _ids(rng, n)
            if same:
                d.ttft(prompt, d.a)
                d.wait_stored(prompt, n - 1)
            ext = d.ttft(prompt, d.b)
            out[str(n)].append(ext["ttft_s"])
            d.ctx.log(f"{d.app.options.engine.connector} {n} rep {rep + 1}: "
                      f"{ext['ttft_s']:.3f} s ({ext['cached_tokens']} cached)")
    return out


def _figures(cmx: dict[str, dict[str, list[float]]], example: dict[str, list[float]],
             none: dict[str, list[float]]) -> list[Figure]:
    figures = []
    for n, got in cmx.items():
        k = f"{int(n):,}"
        figures += [
            Figure("e2e", f"TTFT, {k}-token prompt, 90% stored by the other replica", "s",
                   tuple(got["hit"]), "recompute (cache off), same replica and prompt",
                   tuple(got["recompute"]), Goal("<=", 0.25),
                   "ratio <= 0.25: at least 4x lower TTFT than recompute"),
            Figure("e2e", f"TTFT, {k}-token prompt, 90% loaded from the other replica's store",
                   "s", tuple(got["hit"]), "the same prefix in this replica's own vLLM cache",
                   tuple(got["limit"]), Goal("<=", 1.5),
                   "within 1.5x of prefilling the uncached tail over a prefix in place"),
        ]
        if example.get(n):
            figures.append(Figure(
                "e2e", f"TTFT, {k}-token prompt stored by the other replica, CMXConnector", "s",
                tuple(got["same"]), "vLLM ExampleConnector (disk), same prompts",
                tuple(example[n]), Goal("<=", 1 / 3),
                "ratio <= 0.33: at least 3x lower TTFT on hits"))
        if none.get(n):
            figures.append(Figure(
                "e2e", f"TTFT, {k}-token prompt nobody stored, CMXConnector", "s",
                tuple(got["miss"]), "vLLM without a connector", tuple(none[n]),
                Goal("<=", 1.05), "a miss costs nothing visible: <= 1.05x"))
    return figures


def run_e2e(ctx: BenchContext, lengths: tuple[int, ...] = LENGTHS) -> SuiteResult:
    result = SuiteResult("e2e", command="")
    reps = ctx.config.reps
    with _app(_options("cmx", lengths), ctx, "cmx") as app:
        cmx = _cmx(_Driver(app, ctx), reps, lengths)
    others: dict[str, dict[str, list[float]]] = {}
    for connector, same in (("example", True), ("none", False)):
        try:
            with _app(_options(connector, lengths), ctx, connector) as app:
                others[connector] = _other(_Driver(app, ctx), reps, lengths, same=same)
        except Exception as exc:  # noqa: BLE001 - the CMX figures stand without this baseline
            others[connector] = {}
            result.notes.append(f"connector {connector!r}: no figures ({exc})")
    example, none = others["example"], others["none"]
    result.figures += _figures(cmx, example, none)
    options = _options("cmx", lengths)
    result.notes.append(
        f"model: SmolLM2-135M-Instruct on vLLM (CPU, {options.engine.dtype}, "
        f"{options.threads} OpenMP thread(s) per replica, blocks of "
        f"{options.engine.block_size} tokens); two Ray nodes on this machine, one replica "
        f"each; TTFT measured by the replica, arrival to first token; one generated token")
    rows = [(n, f"{min(g['hit']):.3f}", f"{min(g['recompute']):.3f}", f"{min(g['limit']):.3f}",
             f"{min(g['same']):.3f}", f"{min(example.get(n, [float('nan')])):.3f}",
             f"{min(g['miss']):.3f}", f"{min(none.get(n, [float('nan')])):.3f}")
            for n, g in cmx.items()]
    result.tables.append(Table(
        "Best TTFT (s) of each kind, by prompt length",
        ("prompt", "90% hit", "recompute", "limit", "hit (same prompt)", "ExampleConnector",
         "miss", "no connector"), tuple(rows)))
    return result
