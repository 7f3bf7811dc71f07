"""``cmx simulate``: one scenario under our strategy and an LMCache-like one, side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

__all__ = ["simulate_command"]

console = Console(log_path=False)


def simulate_command(
    name: Annotated[str, typer.Argument(help="Scenario: seed, mix or scale.")] = "seed",
    nodes: Annotated[int | None, typer.Option(min=1, help="GPU nodes (8 GPUs each).")] = None,
    duration: Annotated[float | None, typer.Option(
        min=1.0, help="Seconds of simulated arrivals (default 600; scale: 3600).")] = None,
    load: Annotated[float, typer.Option(
        min=0.01, max=4.0, help="Offered load: busy share of the replicas if hits were free.",
    )] = 0.7,
    model: Annotated[str, typer.Option(help="llama-3-8b or llama-3-70b.")] = "llama-3-8b",
    strategy: Annotated[list[str] | None, typer.Option(
        help="Strategies to run (default: cmx and lmcache-like).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the trace and of every random choice.")] = 0,
    out: Annotated[Path, typer.Option(help="Directory for the JSON and the plot.")] = Path(
        "sim-out"),
    calibrate: Annotated[bool, typer.Option(
        "--calibrate", help="Measure this machine and the service's loads on an embedded Ray "
        "cluster; predict the loads with the simulator; exit 1 if off by more than 25%.",
    )] = False,
    docs: Annotated[Path | None, typer.Option(
        help="With --calibrate: markdown page whose calibration section is rewritten.",
    )] = None,
) -> None:
    """Simulate a cluster serving long contexts through the service's own policies."""
    if calibrate:
        _calibrate(out, docs)
        return
    from cmx.simulate.engine import Simulator
    from cmx.simulate.report import print_results, write_json, write_plots
    from cmx.simulate.scenarios import scenario, with_strategy
    from cmx.simulate.strategy import STRATEGIES

    names = strategy or ["cmx", "lmcache-like"]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown:
        console.print(f"[red]error:[/] unknown strategy {unknown}; known: {sorted(STRATEGIES)}")
        raise typer.Exit(code=2)
    try:
        config = scenario(name, nodes=nodes, duration_s=duration, load=load, model=model,
                          seed=seed)
    except ValueError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(code=2) from exc
    c = config.cluster
    console.print(f"scenario {name}: {config.model.name}, {c.nodes:,} nodes ({c.gpus:,} GPUs, "
                  f"{c.replicas:,} replicas of {c.node.gpus_per_replica} GPU), "
                  f"{config.workload.duration_s:g} s of arrivals at "
                  f"{config.workload.rate_per_s:.2f}/s")
    results = []
    for s in names:
        console.log(f"running {s}")
        results.append(Simulator(with_strategy(config, STRATEGIES[s])).run())
    title = f"cmx simulate {name}: {config.model.name}, {c.gpus:,} GPUs"
    print_results(console, results, title)
    json_path = out / f"simulate-{name}.json"
    write_json(json_path, config, results)
    png = out / f"simulate-{name}.png"
    plotted = write_plots(png, results, title)
    console.print(f"wrote {json_path}" + (f", {png}" if plotted else
                                          " (plots skipped: pip install 'cmx-ray[bench]')"))


def _calibrate(out: Path, docs: Path | None) -> None:
    from cmx.simulate.calibrate import run_calibration, write_calibration

    result = run_calibration(log=lambda m: console.log(m))
    console.print(result.table())
    write_calibration(result, out / "calibration.json", docs)
    console.print(f"wrote {out / 'calibration.json'}" + (f", {docs}" if docs else ""))
    if not result.ok:
        raise typer.Exit(code=1)
