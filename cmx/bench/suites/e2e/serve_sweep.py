"""The rate sweep of suite "e2e-serve": request rates rise until a run breaks the TTFT p99 target.

A setup's throughput at the target is the fastest of its runs that held it
(``serve_report.sustained``). A sweep that ends while every setup still holds gives each the same
fastest rate, the last one tried, and so a ratio of 1.0 whatever the connector gains. So each
setup's rates rise, one run each, until a run breaks the target (``held``: its p99 above
``P99_TARGET_MS``, or a request failed), through at most ``MAX_RATES`` rates. Every setup sweeps
to its own break, whichever order the setups run in, so a finished sweep has at least one setup
past its target, and the setup that holds a higher rate shows it. A setup that holds at the last
rate of the ladder has run out of rates, not of capacity: its throughput there is a lower bound,
and the report says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cmx.bench.suites.e2e.vllm_results import ServeRun

__all__ = ["MAX_RATES", "P99_TARGET_MS", "RATES", "check_rates", "held", "sweep"]

P99_TARGET_MS = 10_000.0  # the TTFT p99 at which throughput is compared
# Requests/s, both clients together, each about 1.4x the one before: from well within two
# cores' capacity (a server prefills about 250 tokens/s) to several times what either setup
# held in the first runs (0.8 req/s, 2026-12-05), fine enough that a gain of 1.5x falls
# between two rates.
RATES = (0.2, 0.3, 0.4, 0.6, 0.8, 1.1, 1.6, 2.2, 3.2, 4.5)
MAX_RATES = 10  # the most rates one sweep runs: a bound on its time


def check_rates(rates: Sequence[float]) -> None:
    """ValueError unless ``rates`` are positive, rising, and at most ``MAX_RATES``."""
    if not rates or min(rates) <= 0:
        raise ValueError(f"rates must be positive, got {tuple(rates)}")
    if any(b <= a for a, b in zip(rates, rates[1:], strict=False)):
        raise ValueError(f"rates must rise, got {tuple(rates)}")
    if len(rates) > MAX_RATES:
        raise ValueError(f"at most {MAX_RATES} rates in a sweep, got {len(rates)}")


def held(run: ServeRun) -> bool:
    """The run kept its TTFT p99 within the target and no request failed."""
    return run.failed == 0 and run.ttft_p99_ms <= P99_TARGET_MS


def sweep(rates: Sequence[float],
          measure: Callable[[float], ServeRun]) -> list[tuple[float, ServeRun]]:
    """``measure(rate)`` for each of ``rates`` in order, stopping after the first run that did
    not hold the target; every rate and its run, in the order run."""
    check_rates(rates)
    done: list[tuple[float, ServeRun]] = []
    for rate in rates:
        run = measure(rate)
        done.append((rate, run))
        if not held(run):
            break
    return done
