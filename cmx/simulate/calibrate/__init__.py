"""``cmx simulate --calibrate``: does the simulator predict the service on this machine?

1. This machine's tier speeds, measured without the service at the start of each repetition
   (the machine is shared; its speeds drift): the client's checked copy of blocks into a new
   tensor (``cmx.client.copy_out.copy_payloads``, on a thread; and each thread's speed with a
   thread on every core), O_DIRECT reads of a file in the NVMe directory (4 MiB, 8 in
   flight), XXH3 checksums, the agent's copy between arenas (``cmx.buffers.copy_bytes``,
   NIXL's stand-in), and NIXL (UCX) between two processes (``machine``, ``nixl``).
2. The service's own load times through the public client API (``ContextMemory`` and
   ``NamespaceClient.load``) on an embedded two-node Ray cluster (``service``): prefixes in
   this node's DRAM, in this node's NVMe and in the other node's DRAM, loaded by 1, 4 and 16
   clients at once (``clients``), each its own prefix; and prefixes of one and of eight tiny
   blocks, loaded alone, which measure the control path (a fixed cost per load and one per
   block).
3. The simulator, given only (1) and the control costs of the tiny loads of the same
   repetition, predicts the same N loads (``predict``): N load jobs through the ``Mover``,
   agent lanes and links of a two-node cluster with the measured speeds, then their CPU work
   on ``min(cores, N)`` threads; for N > 1, no load ends before the cores could supply N times
   one load's own CPU-seconds (measured in step 2 with one client: the machine's busy
   CPU-seconds over the load, less what it keeps busy with no load running; its copy out at
   the speed of ``min(cores, N)`` threads copying at once). Each cell (source, N) compares the
   median of every load measured with the median of every load predicted; the goal: within
   25%.

    result   the figures every step shares: speeds, control costs, rows, the result
    machine  step 1 (nixl: NIXL between two processes)
    service  step 2, on the benchmarks' embedded clusters (``cmx.bench.harness.cluster``)
    predict  step 3, through the simulator's own model
    run      the repetitions, each step in turn, and the rows
    docs     the calibration's section of docs/BENCHMARKS.md
"""

from __future__ import annotations

from cmx.simulate.calibrate.result import CalibrationResult, ControlCosts, MachineSpeeds
from cmx.simulate.calibrate.run import run_calibration, write_calibration

__all__ = ["CalibrationResult", "ControlCosts", "MachineSpeeds", "run_calibration",
           "write_calibration"]
