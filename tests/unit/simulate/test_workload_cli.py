"""Traces from a seed, the scenarios, the command line, and the prefetch policy's hook."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cmx.cli import app
from cmx.policies.prefetch import make_prefetch
from cmx.simulate import Simulator, TenantSpec, WorkloadSpec, scenario
from cmx.simulate.workload import generate


def _spec(**kw: object) -> WorkloadSpec:
    tenants = (TenantSpec("a", 3.0, (8192, 32_768), 0.5, prefixes=10),
               TenantSpec("b", 1.0, (65_536, 65_536), 0.75, prefixes=4))
    return WorkloadSpec(tenants, **{"rate_per_s": 20.0, "duration_s": 200.0, **kw})  # type: ignore[arg-type]


def test_a_trace_is_a_function_of_its_spec_and_seed() -> None:
    a, b = generate(_spec(seed=1), 1024), generate(_spec(seed=1), 1024)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prefix, b.prefix)
    assert not np.array_equal(generate(_spec(seed=2), 1024).arrival_s[:10], a.arrival_s[:10])


def test_a_trace_keeps_its_tenants_lengths_shares_and_prefixes_apart() -> None:
    t = generate(_spec(), 1024)
    assert 0.85 * 4000 < len(t) < 1.15 * 4000
    assert np.all(np.diff(t.arrival_s) >= 0)
    assert np.all(t.context_tokens % 1024 == 0) and np.all(t.shared_tokens % 1024 == 0)
    a, b = t.tenant == 0, t.tenant == 1
    assert 0.7 < a.mean() < 0.8
    assert t.context_tokens[a].min() >= 8192 and t.context_tokens[a].max() <= 32_768
    assert np.all(t.context_tokens[b] == 65_536) and np.all(t.shared_tokens[b] == 49_152)
    assert set(t.prefix[a]) <= set(range(10)) and set(t.prefix[b]) <= set(range(10, 14))
    assert np.bincount(t.prefix[a]).argmax() == 0  # Zipf: the first prefix is the hottest


def test_bursts_raise_the_arrival_rate_inside_their_windows() -> None:
    t = generate(_spec(burst_every_s=50.0, burst_len_s=10.0, burst_factor=4.0), 1024)
    inside = np.mod(t.arrival_s, 50.0) < 10.0
    per_s_in, per_s_out = inside.sum() / 40.0, (~inside).sum() / 160.0
    assert 3.0 < per_s_in / per_s_out < 5.0


@pytest.mark.parametrize("bad", [dict(rate_per_s=0.0), dict(burst_factor=0.5),
                                 dict(burst_every_s=10.0, burst_len_s=20.0)])
def test_bad_workloads_raise(bad: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError):
        _spec(**bad)
    with pytest.raises(ValueError):
        TenantSpec("x", context_tokens=(10, 5))


def test_the_prefetch_policies_deadline_is_what_wait_waits_for() -> None:
    class Pending:
        started_s = 10.0

        def done(self) -> bool:
            return False

        def wait(self, timeout_s: float) -> bool:
            return False

    p = Pending()
    assert make_prefetch("timeout", timeout_s=0.5).deadline(p, 10.2) == pytest.approx(10.5)
    assert make_prefetch("timeout", timeout_s=0.5).deadline(p, 11.0) == 11.0  # already past
    assert make_prefetch("best_effort").deadline(p, 12.0) == 12.0
    assert make_prefetch("wait_complete", max_wait_s=30).deadline(p, 12.0, cap_s=2.0) == 14.0


def test_a_thousand_nodes_simulate_and_keep_their_invariants() -> None:
    config = scenario("scale", duration_s=20.0)
    assert config.cluster.gpus == 8000
    sim = Simulator(config)
    r = sim.run()
    assert r.completed == r.requests > 100
    sim.cluster.check_integrity()


def test_unknown_scenarios_and_models_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown scenario"):
        scenario("nope")
    with pytest.raises(ValueError, match="unknown model"):
        scenario("seed", model="gpt-9")


def test_the_command_prints_both_strategies_and_writes_json(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["simulate", "seed", "--nodes", "1", "--duration", "30",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "lmcache-like" in result.output and "GPU waiting on KV I/O" in result.output
    doc = json.loads((tmp_path / "simulate-seed.json").read_text())
    assert [r["strategy"] for r in doc["results"]] == ["cmx", "lmcache-like"]
    assert doc["results"][0]["completed"] == doc["results"][0]["requests"] > 0
    assert (tmp_path / "simulate-seed.png").stat().st_size > 10_000
    bad = CliRunner().invoke(app, ["simulate", "seed", "--strategy", "nope"])
    assert bad.exit_code == 2 and "unknown strategy" in bad.output


@pytest.mark.parametrize("clients", ["0", "1,x", "", "4,-1"])
def test_calibration_refuses_client_counts_that_are_not_positive_numbers(clients: str) -> None:
    result = CliRunner().invoke(app, ["simulate", "--calibrate", "--clients", clients])
    assert result.exit_code == 2
    assert "--clients takes positive whole numbers" in result.output


def test_an_ablation_turns_its_parts_off_and_is_named_so() -> None:
    from cmx.simulate.strategy import CMX, without

    assert without(CMX, ()) is CMX
    off = without(CMX, ("peers", "pool", "prefetch", "admission", "gating"))
    assert off.name == "cmx without peers,pool,prefetch,admission,gating"
    assert (off.peers, off.pool, off.prefetch, off.gating) == (False, False, False, False)
    assert off.admission == "always" and CMX.peers and CMX.pool and CMX.prefetch
    with pytest.raises(ValueError, match="unknown parts"):
        without(CMX, ("peers", "nope"))


def test_the_command_runs_an_ablation_and_refuses_unknown_parts(tmp_path: Path) -> None:
    args = ["simulate", "seed", "--nodes", "2", "--duration", "60", "--strategy", "cmx",
            "--out", str(tmp_path)]
    whole = CliRunner().invoke(app, args)
    assert whole.exit_code == 0, whole.output
    full = json.loads((tmp_path / "simulate-seed.json").read_text())["results"][0]
    result = CliRunner().invoke(app, [*args, "--without", "peers,pool"])
    assert result.exit_code == 0, result.output
    (run,) = json.loads((tmp_path / "simulate-seed.json").read_text())["results"]
    assert run["strategy"] == "cmx without peers,pool"
    assert run["completed"] == run["requests"] > 0
    # Nothing crosses the network without peers or the pool; the whole strategy's run does.
    assert run["network_bytes"] == run["pooled_bytes"] == 0
    assert full["network_bytes"] > 0
    bad = CliRunner().invoke(app, [*args, "--without", "peers,nope"])
    assert bad.exit_code == 2 and "unknown parts" in bad.output


def test_the_command_takes_host_cores_and_a_routing_and_refuses_a_routing_not_known(
    tmp_path: Path,
) -> None:
    args = ["simulate", "seed", "--nodes", "1", "--duration", "30", "--strategy",
            "lmcache-gds-like", "--out", str(tmp_path)]
    roomy = CliRunner().invoke(app, args)
    assert roomy.exit_code == 0, roomy.output
    (wide,) = json.loads((tmp_path / "simulate-seed.json").read_text())["results"]
    scarce = CliRunner().invoke(app, [*args, "--host-cores", "1", "--routing", "prefix",
                                      "--process-threads", "2"])
    assert scarce.exit_code == 0, scarce.output
    assert ("1 host cores a node, 2 thread(s) a serving process, prefix routing"
            in " ".join(scarce.output.split()))
    (one,) = json.loads((tmp_path / "simulate-seed.json").read_text())["results"]
    assert one["strategy"] == "lmcache-gds-like" and one["completed"] == one["requests"]
    # The serving processes' per-I/O work of 64 KiB writes shares one core: it is busier; each
    # process has two threads for the same work, so they are each busy half as much.
    assert one["host_cpu_utilization"] > 10 * wide["host_cpu_utilization"]
    assert one["process_cpu_utilization"] < 0.75 * wide["process_cpu_utilization"]
    bad = CliRunner().invoke(app, [*args, "--routing", "nearest"])
    assert bad.exit_code == 2 and "unknown routing" in bad.output
