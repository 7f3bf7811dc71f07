"""One trace, two agents: the service's scheduler (threads) and the simulator's (simulated time)
start the same jobs at the same steps and refuse the same ones.

A trace is a list of events: submit a job of a class needing some staging bytes, finish a
running job, or let every wait begun so far pass its deadline. Each side runs the trace one
event at a time; after each, what started and what was refused is recorded against the
event's step. The service's jobs block on a ``threading.Event`` each, so the test decides
when each ends; after each event the test waits (bounded) until the scheduler has settled:
every thread either blocked on its job's event, waiting in the scheduler, or idle with
nothing queued. The lanes on each side are each side's own default (the service's
``agent_workers``, the simulator's ``CMX.lanes``).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cmx.actors.agent.scheduler import BusyError, Scheduler
from cmx.config import ServiceConfig
from cmx.protocol import Priority
from cmx.simulate import CMX, ClusterSpec
from cmx.simulate.agent import Agent, Job
from cmx.simulate.cluster import Cluster

L, P, D = Priority.LOAD, Priority.PREFETCH, Priority.DEMOTE
BOUND = 2  # places per class: small, so the trace fills one
STAGING = 100  # bytes
WAIT_S = 2.0  # each side's bound on a wait: real seconds there, simulated here
SETTLE_S = 20.0  # how long the test waits for the scheduler to settle before it fails


@dataclass(frozen=True)
class Submit:
    name: str
    priority: Priority
    nbytes: int = 10


@dataclass(frozen=True)
class Finish:
    name: str


@dataclass(frozen=True)
class Expire:
    """Every wait begun so far passes its deadline."""


Event = Submit | Finish | Expire
Steps = list[tuple[list[str], list[str]]]  # per event: jobs started, jobs refused (sorted)

TRACE: list[Event] = [
    # Four lanes: four background jobs start at once.
    Submit("a1", D), Submit("a2", D), Submit("a3", D), Submit("a4", D),
    # The lanes busy: two fill the demotion class, the third waits for a place.
    Submit("d1", D), Submit("d2", D), Submit("d3", D),
    Submit("p1", P), Submit("l1", L), Submit("l2", L),
    # Each freed lane takes the head of the first class that holds anything.
    Finish("a1"), Finish("a2"), Finish("l1"),
    Finish("l2"),  # d1 starts; its place goes to d3, the waiting submitter
    Submit("s1", D), Expire(),  # the demotion class stays full: s1 is refused
    Finish("p1"),
    # Staging: 80 bytes do not fit beside 30; the job waits for them on its lane.
    Submit("big", L, 80), Finish("a3"),
    Submit("l3", L, 5),
    Finish("a4"),  # big gets its bytes; l3 takes the freed lane and waits for 5
    Finish("d1"),  # l3 gets its bytes; d3 takes the freed lane and waits for 10
    Expire(),  # d3 is refused its bytes, and gives its lane back
    Finish("d2"), Finish("big"), Finish("l3"),
]


def _note(log: list[str], name: str, now: float) -> None:
    log.append(name)


def run_simulated(trace: list[Event], lanes: int = CMX.lanes) -> Steps:
    agent = Agent(lanes=lanes, bound=BOUND, staging_bytes=STAGING, timeout_s=WAIT_S)
    now = 0.0
    jobs: dict[str, Job] = {}
    refusals: list[str] = []
    steps: Steps = []
    for event in trace:
        started: list[str] = []
        before = len(refusals)
        if isinstance(event, Submit):
            job = Job(event.priority, run=lambda t: t, done=lambda t: None,
                      staging_bytes=event.nbytes)
            job.refused.append(functools.partial(_note, refusals, event.name))
            jobs[event.name] = job
            agent.submit(job, now)
        elif isinstance(event, Finish):
            if jobs[event.name].started:  # a trace for other lanes may finish one never run
                agent.finish(jobs[event.name])
        else:
            now += WAIT_S
            agent.expire(now)
        while (ready := agent.next_job(now)) is not None:
            started += [n for n, j in jobs.items() if j is ready]
        agent.check_integrity()
        steps.append((sorted(started), sorted(refusals[before:])))
    return steps


class ServiceRun:
    """The trace against the real ``Scheduler``, one thread per submitter."""

    def __init__(self, config: ServiceConfig) -> None:
        self.workers = config.agent_workers
        self.sched = Scheduler(self.workers, BOUND, STAGING)
        self.lock = threading.Lock()
        self.step = 0
        self.gates: dict[str, threading.Event] = {}
        self.started: list[tuple[int, str]] = []
        self.refused: list[tuple[int, str]] = []
        self.submitting: set[str] = set()  # submitter threads not yet returned
        self.accepted = 0
        self.entered: set[str] = set()  # jobs whose function a worker called
        self.on_gate: set[str] = set()  # started, blocked on their gate
        self.returned: set[str] = set()

    def run(self, trace: list[Event]) -> Steps:
        try:
            for self.step, event in enumerate(trace):
                self._apply(event)
                self._settle()
            return [(sorted(n for s, n in self.started if s == i),
                     sorted(n for s, n in self.refused if s == i)) for i in range(len(trace))]
        finally:
            for gate in self.gates.values():
                gate.set()
            self.sched.close()

    def _apply(self, event: Event) -> None:
        if isinstance(event, Submit):
            self.gates[event.name] = threading.Event()
            with self.lock:
                self.submitting.add(event.name)
            threading.Thread(target=self._submit, args=(event,), daemon=True).start()
        elif isinstance(event, Finish):
            self.gates[event.name].set()
            self._until(lambda: event.name in self.returned, f"{event.name} to return")
        else:
            with self.lock:  # settled: a job on a lane off its gate waits for bytes
                waits = self.submitting | (self.entered - self.on_gate - self.returned)
            self._until(lambda: waits <= {n for _, n in self.refused}, f"{waits} refused")

    def _submit(self, event: Submit) -> None:
        try:
            self.sched.submit(event.priority, self._job(event), timeout_s=WAIT_S)
            with self.lock:
                self.accepted += 1
        except BusyError:
            with self.lock:
                self.refused.append((self.step, event.name))
        finally:
            with self.lock:
                self.submitting.discard(event.name)

    def _job(self, event: Submit) -> Callable[[], None]:
        def work() -> None:
            with self.lock:
                self.entered.add(event.name)
            try:
                with self.sched.staging(event.nbytes, timeout_s=WAIT_S):
                    with self.lock:
                        self.started.append((self.step, event.name))
                        self.on_gate.add(event.name)
                    assert self.gates[event.name].wait(SETTLE_S), f"{event.name} never finished"
                    with self.lock:
                        self.on_gate.discard(event.name)
            except BusyError:
                with self.lock:
                    self.refused.append((self.step, event.name))
            finally:
                with self.lock:
                    self.returned.add(event.name)
        return work

    def _settled(self) -> bool:
        waiting = self.sched.waiting()
        queued = sum(self.sched.depths().values())
        with self.lock:
            on_lanes = len(self.entered - self.returned)
            return (
                # every submitter returned or waits for a place
                len(self.submitting) == sum(v for k, v in waiting.items() if k != "staging")
                # every job taken off a queue is in its function
                and self.accepted - queued == len(self.entered)
                # no lane idle while work is queued
                and (on_lanes == self.workers or queued == 0)
                # every job on a lane blocks on its gate or waits for staging bytes
                and on_lanes == len(self.on_gate) + waiting["staging"]
            )

    def _until(self, cond: Callable[[], bool], what: str) -> None:
        end = time.monotonic() + SETTLE_S
        while not cond():
            assert time.monotonic() < end, f"step {self.step}: waited {SETTLE_S} s for {what}"
            time.sleep(0.002)

    def _settle(self) -> None:
        # Twice, a moment apart: the figures are read under three locks, one after another.
        for _ in range(2):
            self._until(self._settled, "the scheduler to settle")
            time.sleep(0.005)


def test_the_service_and_the_simulator_start_and_refuse_the_same_jobs() -> None:
    simulated = run_simulated(TRACE)
    service = ServiceRun(ServiceConfig()).run(TRACE)
    for i, (event, mine, theirs) in enumerate(zip(TRACE, simulated, service)):
        assert mine == theirs, f"step {i} {event}: simulated {mine}, service {theirs}"
    # What the trace is for, spelled out on the simulated side.
    by_step = dict(zip(TRACE, simulated))
    assert [by_step[Finish(n)][0] for n in ("a1", "a2", "l1", "l2")] == [
        ["l1"], ["l2"], ["p1"], ["d1"]]  # loads, prefetches, demotions; first come first
    assert by_step[Submit("d3", D)] == ([], [])  # waits for a place, is not refused
    assert by_step[Finish("p1")][0] == ["d2"]  # d3 got d1's place, behind d2
    assert [refused for _, refused in simulated if refused] == [["s1"], ["d3"]]
    assert by_step[Finish("a3")][0] == []  # big waits for its bytes on the freed lane
    assert by_step[Finish("a4")][0] == ["big"]
    assert by_step[Finish("d1")][0] == ["l3"]


def test_eight_lanes_would_start_what_the_service_queues() -> None:
    assert run_simulated(TRACE, lanes=8) != run_simulated(TRACE)


def test_the_simulators_agents_and_admission_are_the_services_defaults() -> None:
    config = ServiceConfig()
    node = Cluster(ClusterSpec(nodes=1), CMX).nodes[0]
    assert (node.agent.lanes, node.agent.bound) == (config.agent_workers,
                                                     config.agent_queue_bound)
    assert node.agent.queues.staging_bytes == config.staging_bytes
    assert CMX.admission_min_count == config.nvme_admission_min_count
    assert CMX.pool_admission_min_count == config.pool_admission_min_count
