"""Suite "transfer-hosts": the cross-node load of ``transfer``, between two hosts that share
nothing but a TCP network, against one plain TCP stream between the same two hosts.

``transfer`` runs its nodes on one machine, where UCX may move bytes by shared memory; here
host b is a host of its own (``cmx.bench.harness.hosts``: its own network, mount, UTS and IPC
namespaces, a veth into a bridge), so the service's transport crosses TCP as it would between
machines. The bound it is held to is that network's own: the same bytes over one TCP stream
between the two namespaces, with Python's sockets (``cmx.bench.suites.xhost.tcp_copy``),
measured in the same run and alternated with the loads, each load followed by one copy. Each
repetition gives a pair, and the ratio of medians comes with a bootstrap interval over the
pairs (``cmx.bench.harness.intervals.ratio_interval``).

The hosts harness refuses to plumb in this machine's own network namespace, so the measuring
runs in a process of its own (``cmx.bench.suites.xhost.xhost_run``) inside a namespace made for
the driver (``own_network``); this process starts it and turns its samples into figures. Needs root,
``ip`` and ``unshare``, and CMX_HOSTS=1; elsewhere the suite says why and gives no figures.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence

from cmx.bench.harness.core import BenchContext, Figure, MiB, SuiteResult, Table
from cmx.bench.harness.intervals import ratio_interval
from cmx.bench.suites.xhost.xhost_run import LOG_MARK, Samples

__all__ = ["SUITE", "blocks_for", "child_command", "figure", "rep_table", "run_transfer_hosts"]

SUITE = "transfer-hosts"
BLOCK_BYTES = 32 * MiB  # the Llama-3-8B block of ``transfer`` (cmx.bench.harness.cluster.LLAMA)
CHILD_TIMEOUT_S = 1800.0  # the measuring process, hosts started and stopped, on a busy machine
STOP_GRACE_S = 60.0  # after SIGINT, for its hosts to be stopped, before SIGKILL
TCP_NAME = "one TCP stream, host b to host a, same bytes (Python sockets)"
HOSTS_NOTE = ("hosts a (the head and the loading client) and b (the blocks), each in its own "
              "network, mount, UTS and IPC namespace, joined by veths over a bridge: between "
              "them only TCP")
TCP_NOTE = ("the TCP copy runs right after each load (A B A B): one stream, sendall and "
            "recv_into of 64 MiB, into a buffer faulted in beforehand")


def blocks_for(nbytes: int, block_bytes: int = BLOCK_BYTES) -> int:
    """Whole blocks nearest ``nbytes``, at least one."""
    if nbytes <= 0 or block_bytes <= 0:
        raise ValueError(f"bytes and block size must be > 0, got {nbytes} and {block_bytes}")
    return max(1, round(nbytes / block_bytes))


def child_command(prefix: Sequence[str], blocks: int, reps: int, nvme_dir: str) -> list[str]:
    """The measuring process, run after ``prefix`` (the driver's namespace)."""
    return [*prefix, sys.executable, "-m", "cmx.bench.suites.xhost.xhost_run",
            "--blocks", str(blocks), "--reps", str(reps), "--dir", nvme_dir]


def figure(s: Samples) -> Figure:
    """The load against the TCP copies; the ratio's interval in its note."""
    if len(s.load) != len(s.tcp) or not s.load:
        raise ValueError(f"one load and one copy per repetition, got {len(s.load)} and "
                         f"{len(s.tcp)}")
    iv = ratio_interval(s.load, s.tcp)
    return Figure(
        SUITE, f"cross-host load of {s.nbytes / MiB:.0f} MiB (32 MiB blocks) by "
        f"ContextMemory.load, {s.via} over TCP, verified", "GB/s", tuple(s.load), TCP_NAME,
        tuple(s.tcp), None,
        note=f"ratio to TCP {iv}: bootstrap over {len(s.tcp)} alternated pairs, as coarse as "
             "so few pairs make it")


def rep_table(s: Samples) -> Table:
    rows = tuple((str(i + 1), f"{load:.2f}", f"{tcp:.2f}", f"{load / tcp:.2f}")
                 for i, (load, tcp) in enumerate(zip(s.load, s.tcp)))
    return Table("Each repetition, load then copy, in the order run",
                 ("rep", "load GB/s", "TCP GB/s", "load / TCP"), rows)


def run_transfer_hosts(ctx: BenchContext) -> SuiteResult:
    from cmx.bench.harness.hosts import own_network, unavailable

    result = SuiteResult(SUITE, command="")
    why = unavailable()
    if why is not None:
        result.notes.append(f"no figures: two hosts cannot be made here ({why})")
        return result
    blocks = blocks_for(ctx.config.nbytes)
    with own_network() as prefix:
        samples = _measure(child_command(prefix, blocks, ctx.config.reps,
                                         str(ctx.scratch(SUITE))), ctx)
    result.figures.append(figure(samples))
    result.tables.append(rep_table(samples))
    result.notes += [HOSTS_NOTE, TCP_NOTE, f"hostnames, as each host sees its own: a "
                     f"{samples.hosts[0]!r}, b {samples.hosts[1]!r}; run as root with "
                     "CMX_HOSTS=1"]
    return result


def _measure(cmd: list[str], ctx: BenchContext) -> Samples:
    """Run the measuring process, its progress lines into ``ctx.log``; its samples."""
    # Its Ray cluster's files (and current-cluster record) are its own; socket paths stay short.
    ray_tmp = tempfile.mkdtemp(prefix="cmxx-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(CMX_HOSTS="1", RAY_TMPDIR=ray_tmp)
    tail: collections.deque[str] = collections.deque(maxlen=30)
    try:
        with tempfile.TemporaryFile("w+") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env)
            watchdog = threading.Timer(CHILD_TIMEOUT_S, _stop, (proc,))
            watchdog.start()
            try:
                assert proc.stderr is not None
                for line in proc.stderr:
                    if line.startswith(LOG_MARK):
                        ctx.log(f"{SUITE}: {line[len(LOG_MARK):].rstrip()}")
                    else:
                        tail.append(line.rstrip())
                rc = proc.wait()
            finally:
                watchdog.cancel()
                if proc.poll() is None:
                    _stop(proc)
            out.seek(0)
            lines = out.read().strip().splitlines()
        if rc != 0 or not lines:
            raise RuntimeError(f"the measuring process exited {rc}: " + "\n".join(tail))
        return Samples.from_json(lines[-1])
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGINT first: the process's own cleanup stops host b (its namespace's processes)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
