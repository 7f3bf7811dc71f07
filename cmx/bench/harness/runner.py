"""Run named suites in order, each with the command that reproduces it, into one BenchReport."""

from __future__ import annotations

import importlib
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

from cmx.bench.harness.baselines import FioMissingError
from cmx.bench.harness.core import BenchConfig, BenchContext, SuiteResult
from cmx.bench.harness.machine import code_version, machine_info
from cmx.bench.harness.report import BenchReport
from cmx.bench.suites import NAMED_ONLY, SUITES

__all__ = ["resolve_suites", "run_bench", "suite_command"]

SuiteFn = Callable[[BenchContext], SuiteResult]


def resolve_suites(names: Sequence[str]) -> list[str]:
    """The suites to run, in registry order; for no names, all but ``NAMED_ONLY``. ValueError
    on unknowns."""
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite(s) {', '.join(unknown)}; known: {', '.join(SUITES)}")
    return [n for n in SUITES if n in names or (not names and n not in NAMED_ONLY)]


def _load(name: str) -> SuiteFn:
    module, fn = SUITES[name].split(":")
    return getattr(importlib.import_module(module), fn)


def suite_command(name: str, config: BenchConfig) -> str:
    """The command line that reruns ``name`` with ``config``'s settings."""
    args = ["cmx", "bench", name, "--reps", str(config.reps), "--gib", f"{config.gib:g}",
            "--dir", str(config.dir)]
    if config.fio_seconds != BenchConfig.fio_seconds:
        args += ["--fio-seconds", f"{config.fio_seconds:g}"]
    if config.minutes != BenchConfig.minutes:
        args += ["--minutes", f"{config.minutes:g}"]
    return shlex.join(args)


def run_bench(names: Sequence[str], config: BenchConfig,
              log: Callable[[str], None] = lambda _m: None,
              on_suite: Callable[[SuiteResult], None] = lambda _s: None,
              keep: bool = False) -> BenchReport:
    """Run ``names`` (all suites if empty) in a new directory inside ``config.dir``.

    A suite that fails is reported with its error (``SuiteResult.error``) and the next one
    runs; a missing fio stops the run. The directory and every data file in it are removed at
    the end unless ``keep``.
    """
    suites = resolve_suites(names)
    created = not config.dir.exists()
    config.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cmx-bench-", dir=config.dir))
    ctx = BenchContext(config, work, log)
    report = BenchReport(
        machine=machine_info(config.dir),
        started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        code=code_version(),
        config={"reps": config.reps, "gib": config.gib, "fio_seconds": config.fio_seconds,
                "dir": str(config.dir), "cold_reads": ctx.cold_read_method},
    )
    try:
        for name in suites:
            t0, load0 = time.perf_counter(), os.getloadavg()[0]
            try:
                result = _load(name)(ctx)
            except FioMissingError:
                raise
            except Exception as exc:  # one broken suite must not cost the others' figures
                log(f"{name} failed: {type(exc).__name__}: {exc}")
                result = SuiteResult(name, command="", error=f"{type(exc).__name__}: {exc}")
            result.command = suite_command(name, config)
            result.seconds = time.perf_counter() - t0
            # Other work on the machine skews figures; say how busy it was.
            result.notes.append(f"load average (1 min) {load0:.1f} at the start, "
                                f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores")
            report.suites.append(result)
            on_suite(result)
    finally:
        if keep:
            log(f"data files kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
            if created and not any(config.dir.iterdir()):
                config.dir.rmdir()
    return report
