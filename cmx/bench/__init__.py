"""``cmx bench``: suites that measure the stores against the machine's own limits.

Two folders, imported one way (a suite imports the harness, never the reverse):

    harness  what every suite shares: figures, goals and settings (``harness.core``), paired
             repetitions and their intervals, the machine's own baselines, the local clusters
             and hosts the suites run on, and the runner and the reports it writes
    suites   the suites, one module per suite or one folder per family of suites, and
             ``SUITES``, the registry of suites by name that ``cmx bench`` runs

Every figure is a ratio to a baseline measured in the same run (see ``harness.core``).
"""

from __future__ import annotations

from cmx.bench.harness.core import BenchConfig, BenchContext, Figure, Goal, SuiteResult, Verdict
from cmx.bench.suites import NAMED_ONLY, SUITES

__all__ = ["NAMED_ONLY", "SUITES", "BenchConfig", "BenchContext", "Figure", "Goal", "SuiteResult",
           "Verdict"]
