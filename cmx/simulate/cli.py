"""``cmx simulate``: one scenario under our strategy and an LMCache-like one, side by side;
with ``--capacity``, each one's highest load within a TTFT p99 target."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

__all__ = ["simulate_command"]

console = Console(log_path=False)


def simulate_command(
    name: Annotated[str, typer.Argument(help="Scenario: seed, tutti, mix or scale.")] = "seed",
    nodes: Annotated[int | None, typer.Option(min=1, help="GPU nodes (8 GPUs each).")] = None,
    duration: Annotated[
        float | None,
        typer.Option(
            min=1.0,
            help="Seconds of simulated arrivals (default 600; scale: 3600, but 600 with "
            "--capacity).",
        ),
    ] = None,
    load: Annotated[
        float | None,
        typer.Option(
            min=0.01,
            max=4.0,
            help="Offered load: busy share of the replicas if hits were free (default 0.7; "
            "tutti 0.05, where a request mostly has its drive to itself).",
        ),
    ] = None,
    model: Annotated[str, typer.Option(help="llama-3-8b or llama-3-70b.")] = "llama-3-8b",
    host_cores: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Cores of each node's host, shared by its engines' host work and every "
            "move's CPU work (default 112: a DGX H100's).",
        ),
    ] = None,
    process_threads: Annotated[
        int,
        typer.Option(
            min=1,
            help="Threads each serving process (one per replica) does CPU work on at once: "
            "its engine's host work and an in-process library's I/O work (default 1: one "
            "interpreter and its lock).",
        ),
    ] = 1,
    routing: Annotated[
        str,
        typer.Option(
            help="How a request finds its replica: least-loaded (the less loaded of two "
            "drawn at random) or prefix (its prefix's home replica unless that one is 2 "
            "requests busier).",
        ),
    ] = "least-loaded",
    strategy: Annotated[
        list[str] | None,
        typer.Option(
            help="Strategies to run: cmx, lmcache-like, lmcache-gds-like, "
            "lmcache-gds-async-like (default: cmx and lmcache-like)."
        ),
    ] = None,
    without: Annotated[
        str,
        typer.Option(
            help="Parts turned off in every strategy run, comma-separated: peers, pool, "
            "prefetch, admission, gating (an ablation; the results are named so).",
        ),
    ] = "",
    seed: Annotated[int, typer.Option(help="Seed of the trace and of every random choice.")] = 0,
    out: Annotated[Path, typer.Option(help="Directory for the JSON and the plot.")] = Path(
        "sim-out"
    ),
    calibrate: Annotated[
        bool,
        typer.Option(
            "--calibrate",
            help="Measure this machine and the service's loads on an embedded Ray "
            "cluster; predict the loads with the simulator; exit 1 if off by more than 25%.",
        ),
    ] = False,
    docs: Annotated[
        Path | None,
        typer.Option(
            help="With --calibrate: markdown page whose calibration section is rewritten.",
        ),
    ] = None,
    clients: Annotated[
        str,
        typer.Option(help="With --calibrate: numbers of concurrent clients, comma-separated."),
    ] = "1,4,16",
    capacity: Annotated[
        bool,
        typer.Option(
            "--capacity",
            help="Search each strategy's highest load whose TTFT p99 meets "
            "--p99-target, over --seeds seeds (from --seed); --load is not used.",
        ),
    ] = False,
    p99_target: Annotated[
        float, typer.Option(help="With --capacity: the TTFT p99 target, seconds.")
    ] = 10.0,
    seeds: Annotated[
        int,
        typer.Option(
            min=1,
            help="With --capacity: seeds, each its own trace (5 or more: a bootstrap "
            "interval of the median; fewer: min-max).",
        ),
    ] = 5,
    resolution: Annotated[
        float, typer.Option(help="With --capacity: the step of the load search.")
    ] = 0.02,
) -> None:
    """Simulate a cluster serving long contexts through the service's own policies."""
    if calibrate:
        _calibrate(out, docs, _client_counts(clients))
        return
    parts = _parts(without)
    if capacity:
        _capacity(
            name,
            parts=parts,
            nodes=nodes,
            duration=duration,
            model=model,
            host_cores=host_cores,
            process_threads=process_threads,
            routing=routing,
            strategy=strategy,
            seed=seed,
            out=out,
            target=p99_target,
            seeds=seeds,
            resolution=resolution,
        )
        return
    from cmx.simulate.report import print_results, write_json, write_plots
    from cmx.simulate.scenarios import scenario

    names = _strategies(strategy)
    try:
        config = scenario(name, nodes=nodes, duration_s=duration, load=load, model=model,
                          seed=seed, host_cores=host_cores, process_threads=process_threads,
                          routing=routing)
    except ValueError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(code=2) from exc
    c = config.cluster
    console.print(
        f"scenario {name}: {config.model.name}, {c.nodes:,} nodes ({c.gpus:,} GPUs, "
        f"{c.replicas:,} replicas of {c.node.gpus_per_replica} GPU, {c.node.host_cores} host "
        f"cores a node, {c.node.process_threads} thread(s) a serving process, "
        f"{config.routing} routing), "
        f"{config.workload.duration_s:g} s of arrivals at "
        f"{config.workload.rate_per_s:.2f}/s"
    )
    # The strategies are independent runs: one process each, as many at once as there are cores.
    console.log(f"running {', '.join(names)}")
    workers = min(len(names), os.cpu_count() or 1)
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            results = list(pool.map(_run_strategy, [config] * len(names), names,
                                    [parts] * len(names)))
    else:
        results = [_run_strategy(config, s, parts) for s in names]
    title = f"cmx simulate {name}: {config.model.name}, {c.gpus:,} GPUs"
    print_results(console, results, title)
    json_path = out / f"simulate-{name}.json"
    write_json(json_path, config, results)
    png = out / f"simulate-{name}.png"
    plotted = write_plots(png, results, title)
    console.print(
        f"wrote {json_path}"
        + (f", {png}" if plotted else " (plots skipped: pip install 'cmx-ray[bench]')")
    )


def _run_strategy(config: Any, name: str, parts: tuple[str, ...] = ()) -> Any:
    """One strategy's whole run of ``config``, ``parts`` of it turned off (in a worker process
    of its own)."""
    from cmx.simulate.engine import Simulator
    from cmx.simulate.scenarios import with_strategy
    from cmx.simulate.strategy import STRATEGIES, without

    return Simulator(with_strategy(config, without(STRATEGIES[name], parts))).run()


def _parts(text: str) -> tuple[str, ...]:
    """``--without``'s parts; exit 2 for one not known."""
    from cmx.simulate.strategy import CMX, without

    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    try:
        without(CMX, parts)
    except ValueError as exc:
        console.print(f"[red]error:[/] --without: {exc}")
        raise typer.Exit(code=2) from exc
    return parts


def _strategies(names: list[str] | None) -> list[str]:
    from cmx.simulate.strategy import STRATEGIES

    chosen = names or ["cmx", "lmcache-like"]
    unknown = [s for s in chosen if s not in STRATEGIES]
    if unknown:
        console.print(f"[red]error:[/] unknown strategy {unknown}; known: {sorted(STRATEGIES)}")
        raise typer.Exit(code=2)
    return chosen


def _capacity(
    name: str,
    *,
    parts: tuple[str, ...],
    nodes: int | None,
    duration: float | None,
    model: str,
    host_cores: int | None,
    process_threads: int,
    routing: str,
    strategy: list[str] | None,
    seed: int,
    out: Path,
    target: float,
    seeds: int,
    resolution: float,
) -> None:
    import time

    from cmx.simulate.capacity import find_capacity, scenario_builder
    from cmx.simulate.report import capacity_seed_table, capacity_table, write_capacity_json
    from cmx.simulate.strategy import STRATEGIES, without

    names = _strategies(strategy)
    duration = duration or 600.0  # scale's hour, times every search step, is not bounded
    builds = [
        scenario_builder(name, without(STRATEGIES[s], parts), nodes=nodes, duration_s=duration,
                         model=model, host_cores=host_cores,
                         process_threads=process_threads, routing=routing)
        for s in names
    ]
    try:
        config = builds[0](1.0, seed)
        t0 = time.perf_counter()
        found = [
            find_capacity(
                b,
                target_p99_s=target,
                seeds=seeds,
                first_seed=seed,
                resolution=resolution,
                log=lambda m: console.log(m),
            )
            for b in builds
        ]
    except ValueError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(code=2) from exc
    wall_s = time.perf_counter() - t0
    c = config.cluster
    title = (
        f"cmx simulate {name} --capacity: {config.model.name}, {c.gpus:,} GPUs, "
        f"TTFT p99 <= {target:g} s, {duration:g} s runs, seeds {seed}-{seed + seeds - 1}"
    )
    console.print(capacity_table(found, title))
    console.print(capacity_seed_table(found))
    json_path = out / f"simulate-{name}-capacity.json"
    write_capacity_json(
        json_path, config, found, {"duration_s": duration, "first_seed": seed, "wall_s": wall_s}
    )
    console.print(f"{wall_s:.1f} s wall; wrote {json_path}")


def _client_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(c) for c in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise typer.BadParameter(f"--clients takes positive whole numbers, comma-separated: "
                                 f"got {text!r}")
    return counts


def _calibrate(out: Path, docs: Path | None, clients: tuple[int, ...]) -> None:
    from cmx.simulate.calibrate import run_calibration, write_calibration

    result = run_calibration(log=lambda m: console.log(m), clients=clients)
    console.print(result.table())
    console.print(result.parameter_table())
    write_calibration(result, out / "calibration.json", docs)
    console.print(f"wrote {out / 'calibration.json'}" + (f", {docs}" if docs else ""))
    if not result.ok:
        raise typer.Exit(code=1)
