"""The serving process as the contended resource: an in-process library issues its I/Os on
its engine's threads, the agent on its own; per-I/O work overlaps the transfer; a hit in this
node's HBM moves nothing; and the seed's measurement (``tutti``) as a scenario."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from cmx.protocol import Priority
from cmx.simulate import CMX, SimConfig, Simulator, TierSpec
from cmx.simulate.agent import Job
from cmx.simulate.cluster import HBM, NVME
from cmx.simulate.hardware import GiB
from cmx.simulate.scenarios import scenario
from cmx.simulate.strategy import (
    LMCACHE_GDS_ASYNC_LIKE,
    LMCACHE_GDS_LIKE,
    LMCACHE_LIKE,
    Strategy,
)

Configs = Callable[..., SimConfig]


def _run(config: SimConfig):  # type: ignore[no-untyped-def]
    sim = Simulator(config)
    return sim, sim.run()


def test_an_in_process_library_shares_its_engines_threads_as_a_node_wide_pool_would_not(
    make_config: Configs,
) -> None:
    # Each 2 MiB I/O costs its issuer 0.1 ms. In process, a replica's write-through stores
    # and its next request's load take turns on its one interpreter: with as many threads as
    # the node has cores (a node-wide pool), they run side by side and requests wait less.
    costly = CMX.with_(name="in-process", in_process=True, per_io_cpu_s=1e-4,
                       placement="write_through", admission="always")
    _, one = _run(make_config(costly, host_cores=112, process_threads=1))
    _, pool = _run(make_config(costly, host_cores=112, process_threads=112))
    assert one.completed == pool.completed == one.requests
    assert one.io_cpu_wait_fraction > pool.io_cpu_wait_fraction > 0
    assert one.ttft_s.mean > pool.ttft_s.mean
    assert one.process_cpu_utilization > 0 and pool.host_cpu_utilization > 0


def test_the_agents_io_work_leaves_the_engines_threads_alone(make_config: Configs) -> None:
    # The same costs on the agent's threads: the engines' one thread each changes nothing,
    # and the engines' threads do no I/O work (only their passes' host work).
    costly = CMX.with_(per_io_cpu_s=1e-4, placement="write_through", admission="always")
    _, one = _run(make_config(costly, host_cores=112, process_threads=1))
    _, pool = _run(make_config(costly, host_cores=112, process_threads=112))
    assert one.ttft_s == pool.ttft_s
    in_process = costly.with_(in_process=True)
    _, theirs = _run(make_config(in_process, host_cores=112, process_threads=1))
    assert theirs.process_cpu_utilization > 10 * one.process_cpu_utilization


def _load_alone(strategy: Strategy, make_config: Configs, tier: int) -> tuple[Job, float]:
    """One load of two blocks from this node's ``tier``, alone: the job and when it ended."""
    sim = Simulator(make_config(strategy))
    node = sim.cluster.nodes[0]
    keys = [b"alone-0", b"alone-1"]
    for key in keys:
        sim.cluster.add_copy(key, node, tier, sim.mover.unit_bytes)
    job = sim.mover.load_job(node.replicas[0], [node.index * 4 + tier] * 2, keys, Priority.LOAD)
    ended: list[float] = []
    job.waiters.append(ended.append)
    sim.mover.submit(node.agent, job)
    sim.run_jobs([job])
    return job, ended[0]


def test_issuing_the_ios_overlaps_their_transfer_as_a_real_submission_does(
    make_config: Configs,
) -> None:
    # Two 512 MiB blocks from this node's NVMe (7 GB/s): 153 ms of links. At 0.6 ms an I/O,
    # 512 I/Os of 2 MiB are 307 ms of one thread's work, begun with the first I/O: the load
    # ends when the work does, not 153 ms later.
    slow_issue = CMX.with_(per_io_cpu_s=0.6e-3)
    job, end = _load_alone(slow_issue, make_config, NVME)
    assert job.cpu_s == pytest.approx(512 * 0.6e-3)
    assert job.moved_s == pytest.approx(CMX.control_s + 2 * (512 << 20) / 7e9, rel=0.05)
    assert end == pytest.approx(job.cpu_s)  # not moved_s + cpu_s: 0.46 s


def test_a_hit_in_this_nodes_hbm_makes_no_io_and_costs_no_cpu(make_config: Configs) -> None:
    costly = LMCACHE_GDS_LIKE.with_(verify_bandwidth=1e9, copy_out_bandwidth=1e9)
    job, _ = _load_alone(costly, make_config, HBM)
    assert job.cpu_s == 0 and job.consumer_cpu_s == 0
    job, _ = _load_alone(costly, make_config, NVME)
    assert job.cpu_s > 0 and job.consumer_cpu_s > 0


def test_the_seeds_measurement_every_request_finds_three_quarters_on_the_drive() -> None:
    ours = scenario("tutti", load=0.05, duration_s=120)
    sim, result = _run(ours)
    sim.cluster.check_integrity()
    assert result.cached_fraction == pytest.approx(0.75) == result.loaded_fraction
    assert set(result.loaded_bytes) == {"nvme"}  # no HBM or DRAM copy: every hit from the drive
    _, gds = _run(replace(ours, strategy=LMCACHE_GDS_LIKE))
    _, issued = _run(replace(ours, strategy=LMCACHE_GDS_ASYNC_LIKE))
    # Ours waits on the drive alone; the GDS-like path's 64 KiB reads at 4 in flight wait on
    # the drive's latency; kept 64 in flight, on the serving process's thread issuing them.
    assert result.io_cpu_wait_fraction == 0
    assert gds.ttft_s.p50 > issued.ttft_s.p50 > result.ttft_s.p50
    assert issued.io_cpu_wait_fraction > 0.1 > gds.io_cpu_wait_fraction


def test_a_block_in_this_nodes_hbm_is_never_moved_by_a_job(make_config: Configs) -> None:
    # One lane, and stores that hold it: a hit in this node's HBM (vLLM's own prefix cache)
    # is used where it is, so it neither waits for the lane nor takes it.
    strategy = LMCACHE_LIKE.with_(lanes=1)
    sim = Simulator(make_config(strategy))
    moved: list[tuple[int, list[int]]] = []
    load_job = sim.mover.load_job

    def recording(replica, sources, keys, priority):  # type: ignore[no-untyped-def]
        moved.append((replica.node.index, list(sources)))
        return load_job(replica, sources, keys, priority)

    sim.mover.load_job = recording  # type: ignore[method-assign]
    result = sim.run()
    sim.cluster.check_integrity()
    assert result.loaded_bytes.get("hbm", 0) > 0 and moved
    assert all(code != node * 4 + HBM for node, sources in moved for code in sources)


def test_everything_an_in_process_library_writes_it_issues_itself(make_config: Configs) -> None:
    # Stores, NVMe writes and pool writes alike: with the library in the serving process,
    # no job's I/O work is the agent's. (Every block is pooled as it is stored, so no pool
    # write waits for a lookup's sighting, which its holder's agent would make.)
    in_process = CMX.with_(name="in-process", in_process=True, per_io_cpu_s=1e-4,
                           admission="always", pool_admission_min_count=1)
    sim = Simulator(make_config(in_process))
    issuers: list[int | None] = []
    submit = sim.mover.submit

    def recording(agent, job):  # type: ignore[no-untyped-def]
        issuers.append(job.process)
        submit(agent, job)

    sim.mover.submit = recording  # type: ignore[method-assign]
    result = sim.run()
    assert result.pooled_bytes > 0 and issuers and None not in issuers


def test_a_warm_nvme_too_small_for_every_prefix_is_refused(make_config: Configs) -> None:
    config = make_config()
    small = replace(config.cluster.node, nvme=TierSpec(8 * GiB, 7e9, 300e-6))
    with pytest.raises(ValueError, match="cannot hold every prefix"):
        Simulator(replace(config, cluster=replace(config.cluster, node=small), warm_nvme=True))
