"""Whole runs of small clusters: invariants, determinism, and the policies at work."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from cmx.protocol import Priority
from cmx.simulate import CMX, LMCACHE_LIKE, SimConfig, Simulator
from cmx.simulate.agent import Job
from cmx.simulate.cluster import HBM
from cmx.simulate.hardware import H100
from cmx.simulate.scenarios import scenario

Configs = Callable[..., SimConfig]


def _run(config):  # type: ignore[no-untyped-def]
    sim = Simulator(config)
    return sim, sim.run()


def test_a_run_conserves_bytes_and_keeps_every_tier_within_its_capacity(
    make_config: Configs,
) -> None:
    sim, r = _run(make_config(dram_gib=24))  # DRAM far smaller than the prefixes: evictions
    sim.cluster.check_integrity()  # tiers == directory, used <= capacity, policies consistent
    assert r.completed == r.requests > 50
    unit_bytes = sim.mover.unit_bytes
    token_bytes = sim.config.model.kv_bytes_per_token
    # Every byte a load job moved belongs to a planned load, and nothing else was loaded.
    assert sum(r.loaded_bytes.values()) == sim.probe.planned_load.sum() * token_bytes
    assert (sim.probe.loaded <= sim.probe.planned_load).all()
    # Every computed block was handed to DRAM (no store was dropped in this run).
    assert r.dropped_jobs == 0
    computed = (sim.probe.context - sim.probe.loaded) // sim.unit
    assert r.stored_bytes == computed.sum() * unit_bytes
    for t in r.tiers:
        assert t.peak_bytes <= t.capacity_bytes
    dram = next(t for t in r.tiers if t.tier == "dram")
    assert dram.evictions > 0 and dram.peak_bytes > 0.9 * dram.capacity_bytes


def test_the_same_seed_gives_the_same_run_and_another_seed_another(
    make_config: Configs,
) -> None:
    def figures(seed: int) -> dict:  # type: ignore[type-arg]
        d = _run(make_config(seed=seed))[1].to_dict()
        d.pop("wall_s")
        d.pop("cpu_s")
        return d

    assert figures(3) == figures(3)
    assert figures(3) != figures(4)


def test_every_request_pays_at_least_its_own_prefill_and_nothing_is_negative(
    make_config: Configs,
) -> None:
    sim, r = _run(make_config())
    p = sim.probe
    done = ~np.isnan(p.ttft)
    cost = sim.breakeven.prefill
    for i in np.flatnonzero(done)[:50]:
        floor = cost.seconds(int(p.loaded[i]), int(p.context[i]))
        assert p.ttft[i] >= floor - 1e-9
        assert p.queue[i] >= 0 and p.io_wait[i] >= 0
    assert 0 <= r.io_wait_fraction < 1 and 0 < r.loaded_fraction <= r.cached_fraction <= 0.75


def test_blocks_seen_once_never_reach_nvme_with_frequency_admission_and_write_back(
    make_config: Configs,
) -> None:
    twice = replace(CMX, admission_min_count=2)
    _, r = _run(make_config(twice, shared=0.0, dram_gib=16))
    assert r.cached_fraction == 0
    # A count-min sketch may over-count a key that collides in every row: rare, never zero.
    assert r.demoted_bytes + r.pooled_bytes <= 0.01 * r.stored_bytes
    everything = replace(CMX, admission="always")
    _, r2 = _run(make_config(everything, shared=0.0, dram_gib=16))
    assert r2.demoted_bytes > 0.25 * r2.stored_bytes and r2.pooled_bytes > 0


def test_the_services_admission_counts_send_blocks_seen_once_to_nvme_not_the_pool(
    make_config: Configs,
) -> None:
    _, r = _run(make_config(shared=0.0, dram_gib=16))  # NVMe at 1 sighting, the pool at 2
    assert r.cached_fraction == 0
    assert r.demoted_bytes > 0.25 * r.stored_bytes
    assert r.pooled_bytes <= 0.01 * r.stored_bytes


def test_break_even_recomputes_rather_than_load_from_a_link_slower_than_the_gpu(
    make_config: Configs,
) -> None:
    slow = replace(CMX, peers=False, verify_bandwidth=1e6)  # 1 MB/s checksums: any NVMe or
    small_hbm = replace(H100, hbm_bytes=26 * 10**9)  # peer load is hopeless
    sim, r = _run(make_config(slow, dram_gib=8, gpu=small_hbm))
    assert r.cached_fraction > 0
    assert "nvme" not in r.loaded_bytes
    ungated = replace(slow, gating=False)
    _, r2 = _run(make_config(ungated, dram_gib=8, gpu=small_hbm))
    assert r2.loaded_bytes.get("nvme", 0) > 0 and r2.ttft_s.mean > r.ttft_s.mean


def test_prefetch_overlaps_loads_with_queueing(
    make_config: Configs,
) -> None:
    base = make_config(rate=10.0)  # queues form: prefetches have time to land
    _, ours = _run(base)
    _, no_prefetch = _run(replace(base, strategy=replace(CMX, prefetch=False)))
    assert ours.io_wait_s.mean < no_prefetch.io_wait_s.mean


def test_ours_beats_the_lmcache_like_strategy_on_the_seed_workload_shape(
    make_config: Configs,
) -> None:
    base = make_config()
    _, ours = _run(base)
    _, lm = _run(replace(base, strategy=LMCACHE_LIKE))
    assert ours.ttft_s.mean < lm.ttft_s.mean
    assert "dram@peer" not in lm.loaded_bytes and "hbm@peer" not in lm.loaded_bytes
    assert lm.pooled_bytes == 0


def test_hbm_keeps_loaded_and_computed_blocks_for_the_next_request(
    make_config: Configs,
) -> None:
    sim, r = _run(make_config())
    assert r.loaded_bytes.get("hbm", 0) > 0
    assert any(n.caches[HBM] and n.caches[HBM].used for n in sim.cluster.nodes)


def test_bad_configs_raise_typed_errors(
    make_config: Configs,
) -> None:
    with pytest.raises(ValueError, match="unit_tokens"):
        replace(make_config(), unit_tokens=0)
    with pytest.raises(ValueError, match="replicas"):
        make_config(gpus_per_replica=3)


def test_an_overwhelmed_agent_refuses_after_the_submit_timeout_and_every_request_completes(
    make_config: Configs,
) -> None:
    # One lane, one place per class, each 2 MiB I/O 20 ms of its lane's CPU (100 MB/s): the
    # queues stay full for minutes.
    slow = replace(CMX, lanes=1, queue_bound=1, gating=False, per_io_cpu_s=0.02)
    sim, r = _run(make_config(slow, dram_gib=8))
    refused = {p: sum(n.agent.refused[p] for n in sim.cluster.all_nodes) for p in Priority}
    assert refused[Priority.PREFETCH] > 0 and refused[Priority.LOAD] > 0
    assert r.dropped_jobs == refused[Priority.DEMOTE] > 0
    assert r.completed == r.requests
    assert r.cut >= refused[Priority.LOAD]  # a request whose load was refused recomputes
    assert all(not c.pins for n in sim.cluster.all_nodes for c in n.caches if c)
    sim.cluster.check_integrity()


def test_the_cpu_work_of_loads_on_a_nodes_few_cores_holds_the_requests_that_wait_on_them(
    make_config: Configs,
) -> None:
    # Each 2 MiB I/O costs its orchestrator 0.1 ms of a core: a 64K-token prefix 0.4 CPU-s,
    # loads at 20 GB/s alone, faster than recompute (the break-even policy loads them).
    costly = replace(CMX, per_io_cpu_s=1e-4)
    _, roomy = _run(make_config(costly, host_cores=112))
    sim, scarce = _run(make_config(costly, host_cores=1))
    sim.cluster.check_integrity()
    assert scarce.io_wait_s.mean > roomy.io_wait_s.mean
    assert scarce.ttft_s.mean > roomy.ttft_s.mean
    assert scarce.host_cpu_utilization > roomy.host_cpu_utilization
    assert scarce.completed == roomy.completed == scarce.requests  # the same trace, all done


def test_an_engines_host_work_on_busy_cores_makes_its_gpu_wait(make_config: Configs) -> None:
    # A forward pass costs 0.2 s of host work (a small model's share): beside the GPU's work,
    # it ends later than the GPU's only where the cores are shared by more than two pieces.
    slow_host = replace(H100, pass_s=0.2)
    costly = replace(CMX, per_io_cpu_s=1e-4)
    _, roomy = _run(make_config(costly, host_cores=112, gpu=slow_host))
    _, scarce = _run(make_config(costly, host_cores=1, gpu=slow_host))
    assert roomy.cpu_wait_fraction < 1e-9  # a core for every piece: the GPU's work is longer
    assert scarce.cpu_wait_fraction > 0.01


def test_without_a_per_io_cost_the_cores_do_not_change_a_run(make_config: Configs) -> None:
    free = replace(CMX, per_io_cpu_s=0.0)
    _, roomy = _run(make_config(free, host_cores=112))
    _, scarce = _run(make_config(free, host_cores=4))  # 4 GPUs: a core for each engine
    assert scarce.ttft_s == roomy.ttft_s and scarce.cpu_wait_fraction < 1e-9


def test_a_prefetch_still_queued_at_its_deadline_is_overtaken_by_the_requests_own_load(
    make_config: Configs,
) -> None:
    # The seed's shape on 2 nodes: some prefetches are still queued when their deadline comes.
    sim, r = _run(scenario("seed", nodes=2, duration_s=60, load=0.4))
    sim.cluster.check_integrity()  # every pin of an overtaken prefetch was let go
    assert r.late > 0
    # As the service's replica after its wait: it loads what the lookup found, at load
    # priority; nobody recomputes a prefix because its prefetch was slow.
    assert r.cut == 0
    assert (sim.probe.loaded == sim.probe.planned_load).all()
    # An overtaken prefetch moves nothing: every byte loaded is a planned load's, once.
    token_bytes = sim.config.model.kv_bytes_per_token
    assert sum(r.loaded_bytes.values()) == sim.probe.planned_load.sum() * token_bytes
    for node in sim.cluster.all_nodes:
        for cache in node.caches:
            assert cache is None or not cache.pins


def test_a_requests_own_load_is_never_overtaken_and_only_its_refusal_recomputes(
    make_config: Configs,
) -> None:
    # Queues full for minutes: prefetches are refused, their requests load at load priority,
    # and deadlines pass while those loads wait for a place.
    class Watched(Simulator):
        loads: list[Job] = []
        recomputed_on: list[Job | None] = []

        def _load_now(self, r):  # type: ignore[no-untyped-def]
            super()._load_now(r)
            self.loads.append(r.job)

        def _cut(self, r):  # type: ignore[no-untyped-def]
            if r.compute_start < 0:
                self.recomputed_on.append(r.job)
            super()._cut(r)

    slow = replace(CMX, lanes=1, queue_bound=1, gating=False, per_io_cpu_s=0.02)
    sim = Watched(make_config(slow, dram_gib=8))
    r = sim.run()
    assert r.completed == r.requests and r.late > 0 and r.cut > 0
    # A deadline overtakes prefetches only: the request's own load is never cancelled ...
    assert sim.loads and not any(job.cancelled for job in sim.loads)
    # ... and a request recomputes only when the load it is waiting on was refused.
    assert all(job is not None and not job.finished for job in sim.recomputed_on)
    assert all(not c.pins for n in sim.cluster.all_nodes for c in n.caches if c)
    sim.cluster.check_integrity()


def test_an_overtaken_prefetch_lets_its_pins_go_at_once() -> None:
    # Its blocks stay pinned by the request's own load, once: not twice until the prefetch's
    # turn comes, which would keep them from eviction for nothing.
    class Watched(Simulator):
        pins_kept: list[bool] = []

        def _late(self, r):  # type: ignore[no-untyped-def]
            def pins() -> list[int]:
                return [self.cluster.cache(c).pins.get(k, 0) for k, c in zip(r.load_keys,
                                                                            r.sources)]

            before, prefetch = pins(), r.job
            super()._late(r)
            if prefetch is not None and prefetch.cancelled:
                self.pins_kept.append(pins() == before)

    sim = Watched(scenario("seed", nodes=2, duration_s=60, load=0.4))
    r = sim.run()
    assert r.late == len(sim.pins_kept) > 0 and all(sim.pins_kept)
    sim.cluster.check_integrity()


def test_running_jobs_until_they_finish_is_bounded_by_the_events_left(
    make_config: Configs,
) -> None:
    sim = Simulator(make_config())
    node = sim.cluster.nodes[0]
    never_submitted = sim.mover.load_job(node.replicas[0], [], [], Priority.LOAD)
    with pytest.raises(RuntimeError, match="never finished"):
        sim.run_jobs([never_submitted])
