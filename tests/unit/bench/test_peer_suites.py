"""The "lmcache" and "prefetch" suites' own logic: time-to-ready, driver results, figures.

LMCache is never installed here: its driver is replaced by small scripts that write what the
real one would, or fail the way it might.
"""

from __future__ import annotations

import ast
import json
import stat
import time
from pathlib import Path

import numpy as np
import pytest

from cmx.bench.harness.core import BenchConfig, BenchContext, Figure, Verdict
from cmx.bench.suites.lmcache.lmcache_env import (
    DRIVER,
    REQUIRED_KEYS,
    Peer,
    PeerError,
    driver_env,
    ensure_peer,
    parse_result,
    run_driver,
)
from cmx.bench.suites.lmcache.peer import CHUNK_TOKENS, Samples, _disk_figures, run_lmcache
from cmx.bench.suites.lmcache.prefetch import ThreadLoad, prefix_tokens, time_to_ready
from cmx.bench.suites.lmcache.prefix import head_runs, llama_layout, prefix_keys
from cmx.policies.prefetch import PrefetchOutcome, make_prefetch


def context(tmp_path: Path) -> BenchContext:
    return BenchContext(BenchConfig(dir=tmp_path, reps=2, gib=0.01), tmp_path / "work")


def fake_python(tmp_path: Path, body: str) -> Path:
    """An executable standing in for LMCache's Python: ``$1`` driver, ``$2`` spec, ``$3`` out."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# -- time-to-ready ---------------------------------------------------------------------------


def test_preloading_hides_the_wait_and_no_preloading_pays_the_whole_load() -> None:
    assert time_to_ready(10.0, 4.0) == 6.0
    assert time_to_ready(10.0, 12.0) == 0.0  # done in the queue: ready at once
    assert time_to_ready(10.0, 12.0, residual_s=1.5) == 1.5  # a copy still follows
    assert time_to_ready(10.0, 12.0, preload=False) == 10.0
    assert time_to_ready(10.0, 0.0, residual_s=1.0, preload=False) == 11.0
    with pytest.raises(ValueError):
        time_to_ready(-1.0, 2.0)


def test_the_default_prefix_is_80k_tokens_and_a_smoke_run_is_small() -> None:
    assert prefix_tokens(2.0) == 81_920  # 10 GiB of Llama-3-8B KV
    assert prefix_tokens(2.0) * llama_layout(256).token_bytes == 10 * 2**30
    assert prefix_tokens(0.1) == 4_096
    assert prefix_tokens(0.001) == 256  # never less than one block
    assert all(prefix_tokens(g) % 256 == 0 for g in (0.01, 0.37, 1.0, 3.3))


def test_a_thread_load_is_waited_for_by_the_prefetch_policy() -> None:
    policy = make_prefetch("wait_complete", max_wait_s=5.0)
    load = ThreadLoad(lambda: time.sleep(0.05), time.perf_counter)
    waited = policy.wait(load, time.perf_counter)
    assert waited.outcome is PrefetchOutcome.DONE and 0.0 < waited.waited_s < 2.0
    assert policy.wait(load, time.perf_counter).waited_s == 0.0  # already there: no wait
    load.result()


def test_a_failed_thread_load_raises_in_the_waiter() -> None:
    def boom() -> None:
        raise AssertionError("lost block 3")

    load = ThreadLoad(boom, time.perf_counter)
    assert load.wait(5.0)
    with pytest.raises(AssertionError, match="lost block 3"):
        load.result()


# -- the driver and its results --------------------------------------------------------------


def test_the_driver_never_imports_cmx() -> None:
    tree = ast.parse(DRIVER.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert "lmcache.v1.cache_engine" in names
    assert not [n for n in names if n == "cmx" or n.startswith("cmx.")]


def test_results_are_parsed_and_incomplete_ones_refused() -> None:
    full = {k: 1 for k in REQUIRED_KEYS["restart"]}
    assert parse_result(json.dumps(full), "restart") == full
    with pytest.raises(PeerError, match="left out hit_chunks"):
        parse_result(json.dumps({k: 1 for k in REQUIRED_KEYS["restart"] if k != "hit_chunks"}),
                     "restart")
    with pytest.raises(PeerError, match="no JSON"):
        parse_result("Traceback (most recent call last):", "disk")
    with pytest.raises(PeerError, match="list"):
        parse_result("[1, 2]", "disk")


def test_driver_processes_get_a_fixed_hash_seed_and_none_of_our_path() -> None:
    env = driver_env({"PYTHONPATH": "/work/main", "PATH": "/usr/bin"})
    assert env["PYTHONHASHSEED"] == "0" and env["LMCACHE_TRACK_USAGE"] == "false"
    assert "PYTHONPATH" not in env and env["PATH"] == "/usr/bin"


def test_run_driver_hands_over_the_spec_and_reads_the_result(tmp_path: Path) -> None:
    python = fake_python(tmp_path, 'grep -q \'"op": "probe"\' "$2" && '
                                   'echo \'{"lmcache": "0.5.6", "torch": "2.13.0+cpu"}\' > "$3"')
    got = run_driver(Peer(python, "?", "?"), {"op": "probe"}, tmp_path / "w")
    assert got == {"lmcache": "0.5.6", "torch": "2.13.0+cpu"}


def test_a_failing_driver_is_a_peer_error_with_its_last_words(tmp_path: Path) -> None:
    python = fake_python(tmp_path, 'echo "RuntimeError: CUDA not available" >&2; exit 3')
    with pytest.raises(PeerError, match=r"exit 3\):\nRuntimeError: CUDA not available"):
        run_driver(Peer(python, "?", "?"), {"op": "disk"}, tmp_path / "w")
    silent = fake_python(tmp_path, "exit 0")
    with pytest.raises(PeerError, match="without writing"):
        run_driver(Peer(silent, "?", "?"), {"op": "disk"}, tmp_path / "w")


def test_an_unusable_peer_is_reported_once_and_the_suite_has_no_figures(
        tmp_path: Path) -> None:
    ctx = context(tmp_path)
    ctx.memo["lmcache_peer"] = PeerError("pip install 'lmcache==0.5.*' failed (exit 1)")
    with pytest.raises(PeerError):
        ensure_peer(ctx)
    result = run_lmcache(ctx)
    assert result.figures == []
    assert "lmcache==0.5.*' failed" in result.notes[0]


# -- figures ---------------------------------------------------------------------------------


def samples(**kv: tuple[float, ...]) -> Samples:
    s = Samples()
    for name, values in kv.items():
        for v in values:
            s.add(**{name: v})
    return s


def test_disk_figures_judge_parity_heads_and_restart() -> None:
    ours = {t: samples(store=(2.0, 2.1, 2.2), load=(1.0, 1.1, 1.2), head=(0.9, 0.95, 1.0),
                       hits=(1.0, 1.0, 1.0)) for t in CHUNK_TOKENS}
    theirs = {t: samples(store=(1.0, 1.0, 1.0), load=(1.5, 1.5, 1.5), head=(0.2, 0.2, 0.2),
                         hits=(0.0, 0.0, 0.0)) for t in CHUNK_TOKENS}
    figs = _disk_figures(ours, theirs, 2 << 30)

    def fig(start: str) -> Figure:
        return next(f for f in figs if f.name.startswith(start) and "256-token" in f.name)

    store, load, head = fig("store"), fig("load"), fig("one KV head of 8")
    assert (store.ratio, store.verdict) == (pytest.approx(2.1), Verdict.PASS)
    assert load.verdict is Verdict.MISS  # 1.1 / 1.5
    assert (head.ratio, head.verdict) == (pytest.approx(4.75), Verdict.PASS)
    assert fig("hit rate after a restart").verdict is Verdict.PASS
    theirs_hits = fig("LMCache hit rate after a restart")
    assert (theirs_hits.value, theirs_hits.verdict) == (0.0, Verdict.INFO)


# -- the prefix ------------------------------------------------------------------------------


def test_a_head_of_a_head_major_block_is_one_contiguous_run() -> None:
    layout = llama_layout(16)
    keys = prefix_keys(layout, 3, seed=1)
    runs = head_runs(layout, keys, head=5)
    head_bytes = layout.block_bytes // layout.num_kv_heads
    assert runs == [(k, 5 * head_bytes, head_bytes) for k in keys]
    assert prefix_keys(layout, 3, seed=1) == keys and prefix_keys(layout, 3, seed=2) != keys
    assert np.all([len(k) == 32 for k in keys])
