"""The soak as a suite: run only when named, its length on the command line, its kills spread
over the kinds, a replica killed only while every replica is up, the /dev/shm it counts as its
own, and the one outcome each stream ends as."""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import ray

from cmx.bench import NAMED_ONLY, SUITES
from cmx.bench.harness.core import BenchConfig, BenchContext
from cmx.bench.harness.runner import resolve_suites, suite_command
from cmx.bench.harness.serve_app import ServeApp
from cmx.bench.suites.soak import soak
from cmx.bench.suites.soak import soak_faults as faults
from cmx.bench.suites.soak.soak import SoakSettings
from cmx.bench.suites.soak.soak_figures import Outcome
from cmx.bench.suites.soak.soak_traffic import Prompt, ask


def test_the_soak_runs_only_when_named() -> None:
    assert "soak" in SUITES and "soak" in NAMED_ONLY
    assert "soak" not in resolve_suites([])
    assert resolve_suites(["soak"]) == ["soak"]


def test_the_command_carries_a_length_other_than_the_default() -> None:
    assert "--minutes" not in suite_command("soak", BenchConfig(dir=Path("/d")))
    assert suite_command("soak", BenchConfig(dir=Path("/d"), minutes=2)).endswith("--minutes 2")
    with pytest.raises(ValueError):
        BenchConfig(dir=Path("/d"), minutes=0)


def test_a_short_soak_kills_and_counts_in_shorter_steps() -> None:
    assert (SoakSettings().kill_gap_s, SoakSettings().window) == (90.0, 300.0)
    short = SoakSettings(minutes=2)
    assert (short.kill_gap_s, short.window) == (24.0, 30.0)


def run_killer(monkeypatch: pytest.MonkeyPatch, replicas_up: int, kills: int) -> faults.Killer:
    def kill_one(kind: str, app: str, rng: random.Random) -> tuple[str, bool]:
        return f"{app}:{kind}", True

    monkeypatch.setattr(faults, "kill_one", kill_one)
    killer = faults.Killer("app", 0.002, seed=1, clock=lambda: 0.0,
                           replicas_up=lambda: replicas_up, replicas=2, log=lambda _m: None)
    killer.start()
    deadline = time.monotonic() + 10
    while len(killer.kills) < kills and time.monotonic() < deadline:
        time.sleep(0.01)
    killer.stop()
    return killer


def test_each_round_kills_every_kind_once(monkeypatch: pytest.MonkeyPatch) -> None:
    killer = run_killer(monkeypatch, replicas_up=2, kills=8)
    first = killer.kills[:8]
    assert sorted(k.kind for k in first[:4]) == sorted(faults.KINDS)
    assert sorted(k.kind for k in first[4:]) == sorted(faults.KINDS)
    assert all(k.killed for k in first)


def test_the_last_replica_up_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    killer = run_killer(monkeypatch, replicas_up=1, kills=8)
    replicas = [k for k in killer.kills if k.kind == "replica"]
    assert replicas and not any(k.killed for k in replicas)
    assert all(k.killed for k in killer.kills if k.kind != "replica")


def test_only_the_applications_own_unmapped_files_count_as_left_behind() -> None:
    node = "c368374c6b6d5c8b962008cd"
    before = {"psm_old", f"cmx-dram-{node[:12]}-old"}
    mapped = {"/dev/shm/psm_live"}

    def left(name: str) -> bool:
        return faults.left_behind(name, node, before, mapped)

    assert left(f"cmx-dram-{node[:12]}-a03e1351") and left("psm_new") and left("sem.mp-x")
    assert not left("cmx-dram-6f4c9732db1b-a03e1351")  # another cluster's node
    assert not left("psm_live")  # an engine maps it
    assert not left("psm_old") and not left(f"cmx-dram-{node[:12]}-old")  # there before
    assert not left("someone-elses-file")


class _Client:
    """An OpenAI client whose stream yields ``tokens`` then, if given, raises ``error``."""

    def __init__(self, tokens: list[str], error: Exception | None, finish: bool) -> None:
        self.tokens, self.error, self.finish = tokens, error, finish
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **_body: object) -> Iterator[SimpleNamespace]:
        def choice(content: str | None, finish: str | None) -> SimpleNamespace:
            return SimpleNamespace(choices=[SimpleNamespace(
                delta=SimpleNamespace(content=content), finish_reason=finish)])

        for token in self.tokens:
            yield choice(token, None)
        if self.error is not None:
            raise self.error
        if self.finish:
            yield choice(None, "length")


@pytest.mark.parametrize(("error", "finish", "outcome"), [
    (None, True, Outcome.COMPLETED),
    (None, False, Outcome.CUT),
    (httpx.RemoteProtocolError("peer closed connection"), False, Outcome.CUT),
    (httpx.ReadTimeout("timed out"), False, Outcome.HUNG),
])
def test_a_stream_ends_as_one_outcome(error: Exception | None, finish: bool,
                                      outcome: Outcome) -> None:
    prompt = Prompt((("user", "hello"),))
    got, ttft, _total, text, _error = ask(_Client(["a", "b"], error, finish), "m", prompt, 2,
                                          bound_s=60)
    assert got is outcome and text == "ab" and ttft is not None


def test_a_start_that_times_out_is_still_stopped(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    stopped: list[bool] = []

    def start(self: ServeApp) -> str:
        raise subprocess.TimeoutExpired("cmx serve", 900)

    def stop(self: ServeApp) -> str:
        stopped.append(True)
        raise RuntimeError("--stop found nothing to stop")  # must not replace the start's error

    monkeypatch.setattr(ServeApp, "start", start)
    monkeypatch.setattr(ServeApp, "stop", stop)
    # The soak ends its own connection to Ray; this process's (a session cluster's) stays.
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    ctx = BenchContext(BenchConfig(dir=tmp_path), tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        soak.run_soak(ctx)
    assert stopped == [True]
