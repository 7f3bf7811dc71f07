"""Running a scenario on hosts of their own (cmx.bench.harness.hosts), in a process of its own.

The scenario's driver runs in a network namespace of its own (``driver_network``) and makes
its cluster there. Hosts are used only in a test process that started no Ray cluster of its
own: beside a busy session cluster a host once missed its join bound, so ``make test`` runs
the suites marked ``hosts`` in a pytest run of their own (``-m hosts``, ``CMX_HOSTS=1``).
"""

from __future__ import annotations

from typing import Any

import ray
from lifecycle_support import Machine

from cmx.bench.harness.hosts import driver_network, unavailable

__all__ = ["no_hosts", "on_hosts"]


def no_hosts() -> str | None:
    """Why this test process cannot put a scenario's nodes on hosts, or None where it can."""
    if ray.is_initialized():
        return ("a Ray cluster is up in this test process (hosts run in a pytest run of "
                "their own: `CMX_HOSTS=1 pytest -m hosts tests/integration`)")
    return unavailable()


def on_hosts(m: Machine, scenario: str, *args: str, timeout_s: float) -> Any:
    """Run ``scenario`` (``sys.argv[1:]`` = ``args``) and return the JSON it prints last: its
    nodes on hosts where ``no_hosts()`` is None, else on this one machine (``hosts_or_local``
    then says why)."""
    code = f"import sys; sys.argv = ['scenario', *{list(args)!r}]\n" + scenario
    if no_hosts() is not None:
        return m.python(code, timeout_s=timeout_s, RAY_ADDRESS="", CMX_HOSTS="0")
    with driver_network() as prefix:
        return m.python(code, timeout_s=timeout_s, RAY_ADDRESS="", prefix=prefix,
                        CMX_HOSTS="1" if prefix else "0")
