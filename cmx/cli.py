"""The ``cmx`` command line. Each command parses its options and delegates to a module.

Commands import their modules lazily, so ``cmx --help`` stays fast. A family of related commands
(a service's ``up``/``status``/``down``, say) gets its own ``typer.Typer`` in its module,
mounted here with ``app.add_typer``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from cmx.bench import NAMED_ONLY, SUITES

__all__ = ["app"]

app = typer.Typer(
    name="cmx",
    help="CMX on Ray: context memory for LLM KV cache across DRAM and NVMe.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(log_path=False)


def _fail(message: str) -> typer.Exit:
    console.print(f"[red]error:[/] {message}")
    return typer.Exit(code=2)


@app.command("demo-storage")
def demo_storage(
    tokens: Annotated[int, typer.Option(help="Prompt prefix length (256-token blocks).")] = 24_576,
    workdir: Annotated[Path | None, typer.Option(
        "--dir", help="Work directory for the NVMe store (default: a new one in /var/tmp).",
    )] = None,
    keep: Annotated[bool, typer.Option(help="Keep the NVMe store's files.")] = False,
    dram_mib: Annotated[int | None, typer.Option(
        help="DRAM tier capacity in MiB (default: a third of the prefix).",
    )] = None,
    seed: Annotated[int, typer.Option(help="Seed of the token ids and KV payloads.")] = 0,
) -> None:
    """Store a long prefix's Llama-3-8B KV blocks through DRAM and NVMe, load and verify them."""
    from cmx.errors import CmxError
    from cmx.render import byte_progress, print_demo
    from cmx.storage_demo import DemoOptions, run_demo

    opts = DemoOptions(tokens=tokens, workdir=workdir, keep=keep, seed=seed,
                       dram_bytes=None if dram_mib is None else dram_mib << 20)
    progress, update = byte_progress(console)
    try:
        with progress:
            result = run_demo(opts, update)
    except CmxError as exc:
        raise _fail(str(exc)) from exc
    print_demo(console, result)
    if not result.ok:
        raise typer.Exit(code=1)


@app.command()
def bench(
    suites: Annotated[list[str] | None, typer.Argument(
        help=f"Suites to run (default: all but {', '.join(sorted(NAMED_ONLY))}): "
             f"{', '.join(SUITES)}.", show_default=False,
    )] = None,
    workdir: Annotated[Path, typer.Option(
        "--dir", help="Scratch directory, on the filesystem under test.",
    )] = Path("/var/tmp/cmx-bench"),
    reps: Annotated[int, typer.Option(min=1, help="Repetitions; figures are medians.")] = 3,
    gib: Annotated[float, typer.Option(min=0.01, help="GiB moved per store measurement.")] = 2.0,
    fio_seconds: Annotated[float, typer.Option(min=0.1, help="Run time of a fio job.")] = 3.0,
    minutes: Annotated[float, typer.Option(
        min=0.1, help="Length of the soak's traffic (suite soak).")] = 30.0,
    out: Annotated[Path, typer.Option(help="Directory for JSON, markdown, plots.")] = Path(
        "bench-out"),
    json_out: Annotated[Path | None, typer.Option(
        help="JSON path (default: OUT/results.json).")] = None,
    docs: Annotated[Path, typer.Option(
        help="Markdown page whose suite sections are rewritten, if its folder exists.",
    )] = Path("docs/BENCHMARKS.md"),
    no_docs: Annotated[bool, typer.Option("--no-docs", help="Leave the docs page alone.")] = False,
    keep: Annotated[bool, typer.Option(help="Keep the data files in --dir.")] = False,
    strict: Annotated[bool, typer.Option(help="Exit 1 if any goal is missed.")] = False,
) -> None:
    """Measure the stores against the machine's own limits; every figure a ratio to a baseline."""
    from cmx.bench.harness.baselines import FioMissingError
    from cmx.bench.harness.core import BenchConfig, Verdict
    from cmx.bench.harness.render import print_suite
    from cmx.bench.harness.report import write_outputs
    from cmx.bench.harness.runner import resolve_suites, run_bench

    try:
        names = resolve_suites(suites or [])
        config = BenchConfig(dir=workdir, reps=reps, gib=gib, fio_seconds=fio_seconds, out=out,
                             minutes=minutes)
    except ValueError as exc:
        raise _fail(str(exc)) from exc
    console.print(f"suites: {', '.join(names)}; {reps} reps, {gib:g} GiB, data in {workdir}")
    try:
        report = run_bench(names, config, log=lambda m: console.log(m),
                           on_suite=lambda s: print_suite(console, s), keep=keep)
    except FioMissingError as exc:
        raise _fail(str(exc)) from exc
    docs_path = None if no_docs or not docs.parent.is_dir() else docs
    written = write_outputs(report, out, json_out, docs_path)
    console.print(f"wrote {written.describe()}")
    failed = [s for s in report.suites if s.error]
    for suite in failed:
        console.print(f"[red]suite {suite.name} failed:[/red] {suite.error}")
    if failed or (strict and any(f.verdict is Verdict.MISS for f in report.figures)):
        raise typer.Exit(code=1)


# simulate: the cluster at scale, on the service's own policies
from cmx.simulate.cli import simulate_command  # noqa: E402 - mounted after this module's commands

app.command("simulate")(simulate_command)

# up, status, lookup, block, evict, down
from cmx.operate.cli import app as _operate  # noqa: E402 - mounted after this module's commands

app.add_typer(_operate)

# demo (the LLM workload, the main job), serve
from cmx.deploy.cli import app as _deploy  # noqa: E402 - mounted after this module's commands

app.add_typer(_deploy)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
