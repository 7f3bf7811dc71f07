"""The discrete-event loop: requests arrive, find their cached prefix, wait, load, compute.

One heap of (time, sequence, handler, argument); the sequence number breaks ties, so a run is
deterministic. A request's life:

1. arrival: routed to a replica by the run's routing (``routing.Router``); its shared prefix is
   looked up in the directory, each block's best copy chosen by the break-even policy's link
   costs, and the policy's plan says how much of it to load. With prefetch, the load is queued
   on the node's agent at once (and its copies pinned).
2. start, when its replica is free: the prefetch policy says how long to wait for a move still
   in flight (the patience of the plan caps it); a request that stops waiting recomputes.
3. compute: the prefill of the tokens not loaded, by the break-even policy's own cost model;
   its host work on its engine's process (``cores.Cores``: one interpreter's threads).
4. done: time to first token recorded; the blocks it computed are stored through the agent.
"""

from __future__ import annotations

import functools
import heapq
import random
import struct
import time
from collections.abc import Callable
from typing import Any

from cmx.policies.breakeven import BreakEven, Plan
from cmx.policies.prefetch import make_prefetch
from cmx.simulate.agent import Agent, Job, Priority
from cmx.simulate.cluster import HBM, NVME, Cluster, Node, Replica
from cmx.simulate.collector import collect_in_batches
from cmx.simulate.config import SimConfig
from cmx.simulate.hardware import prefill_cost
from cmx.simulate.lookup import Lookup
from cmx.simulate.movement import Mover
from cmx.simulate.probe import Probe
from cmx.simulate.request import Req
from cmx.simulate.routing import Router
from cmx.simulate.workload import generate

__all__ = ["Simulator"]

_KEY = struct.Struct("<QI")
_SUFFIX = 1 << 62  # suffix keys live above every shared prefix id


class _Pending:
    """A load in flight, as the prefetch policy sees one (``PendingPrefetch``)."""

    def __init__(self, job: Job, started_s: float) -> None:
        self.job = job
        self.started_s = started_s

    def done(self) -> bool:
        return self.job.finished

    def wait(self, timeout_s: float) -> bool:
        raise RuntimeError("a simulation never blocks: it asks the policy for its deadline")


class Simulator:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.strategy = config.strategy
        self.unit = config.unit_tokens
        self.trace = generate(config.workload, self.unit)
        self.cluster = Cluster(config.cluster, self.strategy, self._hbm_cache_bytes())
        for node in self.cluster.all_nodes:
            node.cpu.bind(self.at)
        self.mover = Mover(self.cluster, config.model, self.unit, self._submit)
        self.breakeven = BreakEven(prefill=prefill_cost(config.model, config.cluster.node),
                                   links=self.mover.link_priors(), enabled=self.strategy.gating)
        self.prefetch = make_prefetch(self.strategy.prefetch_policy)
        self.lookup = Lookup(self.cluster, self.mover, self.breakeven,
                             random.Random(config.workload.seed + 2).random)
        self.probe = Probe(self.trace.arrival_s, self.cluster, config)
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        self._kv_bytes = config.model.kv_bytes_per_token
        tr = self.trace
        self._rows = list(zip(tr.prefix.tolist(), tr.shared_tokens.tolist(),
                              tr.context_tokens.tolist()))
        self._prefix_keys: dict[int, list[bytes]] = {}
        # The break-even models are the priors throughout a run (nothing refits them), so a
        # plan is a function of its blocks' classes and the context alone.
        self._plans: dict[tuple[tuple[str, ...], int], Plan] = {}
        if config.warm_nvme:
            self._warm_nvme()

    # -- the loop ------------------------------------------------------------------------------

    def at(self, t: float, handler: Callable[[Any], None], arg: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, handler, arg))

    def run(self) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        # One arrival at a time in the heap, each with the sequence number it would have had
        # with all of them queued up front: the same order, a heap a fraction of the size.
        self._arrivals = self.trace.arrival_s.tolist()
        self._first_seq = self._seq + 1
        if self._arrivals:
            heapq.heappush(self._events, (self._arrivals[0], self._first_seq, self._arrive_next, 0))
        self._seq += len(self._arrivals)
        self.router = Router(self.cluster.replicas, self.config.routing, len(self.trace),
                             self.config.workload.seed + 1)
        self._step = self.config.workload.duration_s / (self.config.samples - 1)
        self.at(0.0, self._sample)
        events = 0
        queue, pop = self._events, heapq.heappop
        with collect_in_batches():
            while queue:
                self.now, _, handler, arg = pop(queue)
                handler(arg)
                events += 1
        return self.probe.result(self.now, self.mover.traffic, events, time.perf_counter() - t0,
                                 time.process_time() - c0)

    def run_jobs(self, jobs: list[Job]) -> None:
        """Run the events until every one of ``jobs`` (submitted) has finished, with no
        trace (the calibration's loads). RuntimeError if one never finishes (refused)."""
        while not all(job.finished for job in jobs):
            if not self._events:
                raise RuntimeError("a job was refused, or never finished")
            self.now, _, handler, arg = heapq.heappop(self._events)
            handler(arg)

    def _sample(self, _: Any) -> None:
        """Every ``step`` of simulated time while anything else is still to happen."""
        self.probe.sample(self.now)
        if self._events:
            self.at(self.now + self._step, self._sample)

    def _submit(self, agent: Agent, job: Job) -> None:
        agent.submit(job, self.now)
        self._pump(agent)

    def _pump(self, agent: Agent) -> None:
        while (job := agent.next_job(self.now)) is not None:
            arg = (agent, job)
            self.at(job.run(self.now), self._job_moved, arg)
            job.parts = 1
            if job.cpu is not None and job.cpu_s > 0:  # issuing the I/Os, beside the links
                job.parts = 2
                job.cpu.add(self.now, job.cpu_s, functools.partial(self._job_issued, arg),
                            job.process)
        for t in agent.alarms():
            self.at(t, self._expire, agent)

    def _expire(self, agent: Agent) -> None:
        agent.expire(self.now)
        self._pump(agent)

    def _job_issued(self, arg: tuple[Agent, Job], now: float) -> None:
        """A job's CPU work issuing its I/Os is done."""
        self._job_part(arg)

    def _job_moved(self, arg: tuple[Agent, Job]) -> None:
        """A job's links are done."""
        arg[1].moved_s = self.now
        self._job_part(arg)

    def _job_part(self, arg: tuple[Agent, Job]) -> None:
        """One of the lane's parts is done (its links, its CPU work issuing the I/Os): when
        both are, the lane goes to the next job, and the consumer's CPU work on the bytes (its
        copy out, the checksums), if any, runs on the cores without it."""
        agent, job = arg
        job.parts -= 1
        if job.parts:
            return
        after = job.cpu is not None and job.consumer_cpu_s > 0
        if not after:
            self._job_done(arg)
        agent.finish(job)
        self._pump(agent)
        if after:
            assert job.cpu is not None
            job.cpu.add(self.now, job.consumer_cpu_s, lambda now: self._job_done(arg),
                        job.consumer_process)

    def _job_done(self, arg: tuple[Agent, Job]) -> None:
        job = arg[1]
        job.finished = True
        job.done(self.now)
        if not job.cancelled:
            for waiter in job.waiters:
                waiter(self.now)

    # -- a request's life ----------------------------------------------------------------------

    def _arrive_next(self, i: int) -> None:
        if i + 1 < len(self._arrivals):
            heapq.heappush(self._events, (self._arrivals[i + 1], self._first_seq + i + 1,
                                          self._arrive_next, i + 1))
        self._arrive(i)

    def _arrive(self, i: int) -> None:
        prefix, shared, context = self._rows[i]
        replica = self.router.route(i, prefix)
        r = Req(i, replica, context)
        r.keys = self._keys(i)
        found = self.lookup.find(r.keys[:shared // self.unit], replica.node)
        plan = self._plan(found, replica.node, context)
        n_load = plan.load_tokens // self.unit
        r.sources, r.load_keys = found[:n_load], r.keys[:n_load]
        self.probe.planned(i, len(found) * self.unit, n_load * self.unit, plan.patience_s)
        self._split_in_place(r)
        if r.move_keys and self.strategy.prefetch:
            job = r.job = self.mover.load_job(replica, r.move_sources, r.move_keys,
                                              Priority.PREFETCH)
            job.refused.append(lambda now: self._prefetch_refused(r, job))
            self._submit(replica.node.agent, job)
        replica.queue.append(r)
        if replica.busy is None:
            self._start(replica)

    def _split_in_place(self, r: Req) -> None:
        """The blocks to load already in this node's HBM (vLLM's own prefix cache) are used
        where they are, pinned until the prefill starts: no job, no lane. The rest move."""
        here = r.replica.node.index * 4 + HBM
        if here not in r.sources:
            r.move_sources, r.move_keys = r.sources, r.load_keys
            return
        r.in_place = [k for k, c in zip(r.load_keys, r.sources) if c == here]
        r.move_keys = [k for k, c in zip(r.load_keys, r.sources) if c != here]
        r.move_sources = [c for c in r.sources if c != here]
        hbm = self.cluster.cache(here)
        for key in r.in_place:
            hbm.pin(key)

    def _keys(self, i: int) -> list[bytes]:
        prefix, shared, context = self._rows[i]
        n_shared, n_all = shared // self.unit, context // self.unit
        known = self._prefix_keys.get(prefix)
        if known is None or len(known) < n_shared:
            known = self._prefix_keys[prefix] = [_KEY.pack(prefix, j) for j in range(n_shared)]
        keys = known[:n_shared]
        keys += [_KEY.pack(_SUFFIX + i, j) for j in range(n_all - n_shared)]
        parent = self.cluster.parent
        for j, key in enumerate(keys):
            if key not in parent:
                parent[key] = keys[j - 1] if j else None
        return keys

    def _plan(self, found: list[int], here: Node, context: int) -> Plan:
        """The break-even policy's plan for the copies ``found``, seen from ``here``."""
        classes = tuple([self.mover.source_class(c, here) for c in found])
        plan = self._plans.get((classes, context))
        if plan is None:
            unit_bytes = self.mover.unit_bytes
            plan = self.breakeven.plan([(c, unit_bytes) for c in classes], self.unit, context)
            if len(self._plans) >= 1 << 16:
                self._plans.clear()
            self._plans[(classes, context)] = plan
        return plan

    def _start(self, replica: Replica) -> None:
        if replica.busy is not None or not replica.queue:
            return
        r: Req = replica.queue.popleft()
        replica.busy = r
        r.start = self.now
        replica.hbm_used = r.context * self._kv_bytes
        if not r.move_keys:
            self._compute(r)
            return
        if r.job is None:  # no prefetch (or it was refused): the load starts now
            self._load_now(r)
            return
        if r.job.finished:
            self._compute(r)
            return
        deadline = self.prefetch.deadline(_Pending(r.job, self.probe.arrival(r.i)), self.now,
                                          self.probe.patience(r.i))
        r.job.waiters.append(lambda now: self._loaded(r))
        if deadline <= self.now:
            self._late(r)
        else:
            self.at(deadline, self._late, r)

    def _load_now(self, r: Req) -> None:
        job = r.job = self.mover.load_job(r.replica, r.move_sources, r.move_keys, Priority.LOAD)
        job.waiters.append(lambda now: self._loaded(r))
        job.refused.append(lambda now: self._cut(r) if r.job is job else None)
        self._submit(r.replica.node.agent, job)

    def _prefetch_refused(self, r: Req, job: Job) -> None:
        """As the service's replica whose prefetch failed: it loads when it starts, or now
        if it is waiting already."""
        if job.cancelled or r.job is not job:
            return  # overtaken already by the request's own load
        r.job = None
        if r.replica.busy is r and r.compute_start < 0:
            self._load_now(r)

    def _late(self, r: Req) -> None:
        """The prefetch policy's deadline passed with the prefetch not done. As the service's
        replica, which then runs its engine and the connector loads the prefix at load
        priority from wherever the lookup found it: a prefetch still queued is overtaken by
        that load (and finds nothing to move when its turn comes); one already moving is the
        load's own bytes on their way, so the request waits for it."""
        job = r.job
        if (r.compute_start >= 0 or r.replica.busy is not r or job is None or job.finished
                or job.started or job.priority is not Priority.PREFETCH):
            return
        job.cancel(self.now)
        r.late = True
        self._load_now(r)

    def _loaded(self, r: Req) -> None:
        if r.compute_start < 0 and r.replica.busy is r:
            job = r.job
            if job is not None and job.moved_s >= 0:  # the wait past its bytes' arrival
                r.cpu_io_wait = self.now - max(job.moved_s, r.start)
            self._compute(r)

    def _cut(self, r: Req) -> None:
        """The agent refused the request's load: it recomputes its whole context."""
        if r.compute_start < 0:
            r.cut = True
            self._compute(r)

    def _compute(self, r: Req) -> None:
        """The prefill: its GPU's seconds, and beside them its engine's host work (a thread's
        ``per_pass_s`` a forward pass) on the node's cores; it ends when both have."""
        r.compute_start = self.now
        if r.in_place:
            self.mover.used_in_place(r.replica, r.in_place, hit=not r.cut)
        loaded = 0 if r.cut else len(r.load_keys) * self.unit
        prefill = self.breakeven.prefill
        r.gpu_s = prefill.seconds(loaded, r.context)
        r.parts = 2
        self.at(self.now + r.gpu_s, self._computed, r)
        host_s = prefill.per_pass_s * prefill.passes(loaded, r.context)
        r.replica.node.cpu.add(self.now, host_s, lambda now: self._computed(r), r.replica.index)

    def _computed(self, r: Req) -> None:
        r.parts -= 1
        if r.parts == 0:
            self._done(r)

    def _done(self, r: Req) -> None:
        replica = r.replica
        loaded = 0 if r.cut else len(r.load_keys)
        self.probe.request(r, self.now, loaded * self.unit)
        replica.busy = None
        replica.hbm_used = 0
        self.mover.keep_in_hbm(replica.node, r.keys[loaded:])
        self.mover.store(replica, r.keys[loaded:])
        self._start(replica)

    def _warm_nvme(self) -> None:
        """Every shared prefix of the trace on every GPU node's NVMe, as earlier traffic left
        it."""
        longest: dict[int, int] = {}  # prefix -> the request that shares most of it
        for i, (prefix, shared, _) in enumerate(self._rows):
            if shared >= self._rows[longest.setdefault(prefix, i)][1]:
                longest[prefix] = i
        unit_bytes = self.mover.unit_bytes
        for i in longest.values():
            keys = self._keys(i)[:self._rows[i][1] // self.unit]
            for node in self.cluster.nodes:
                for key in keys:  # None: it did not fit; victims: it evicted a prefix
                    if self.cluster.add_copy(key, node, NVME, unit_bytes) != []:
                        raise ValueError(f"{node.name}: its NVMe cannot hold every prefix")

    def _hbm_cache_bytes(self) -> int:
        """A node's HBM beyond every replica's weights and its longest context's KV; none
        where the run keeps no HBM cache."""
        cfg = self.config
        if not cfg.hbm_cache:
            return 0
        n = cfg.cluster.node
        longest = max(t.context_tokens[1] for t in cfg.workload.tenants)
        work = cfg.model.weight_bytes + longest * cfg.model.kv_bytes_per_token
        return max(0, n.gpu.hbm_bytes * n.gpus - n.replicas * work)
