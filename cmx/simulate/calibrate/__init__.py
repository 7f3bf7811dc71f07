"""``cmx simulate --calibrate``: does the simulator predict the service on this machine?

1. This machine's tier speeds, measured without the service at the start of each repetition
   (the machine is shared; its speeds drift): the client's checked copy of blocks into a new
   tensor (``cmx.client.copy_out.copy_payloads``, on a thread; and each thread's speed with a
   thread on every core), O_DIRECT reads of a file in the NVMe directory (4 MiB, 8 in
   flight; and one 4 KiB read at a time), XXH3 checksums, the agent's copy between arenas
   (``cmx.buffers.copy_bytes``, NIXL's stand-in), and NIXL (UCX) between two processes
   (``machine``, ``nixl``).
2. The service's own load times through the public client API (``ContextMemory`` and
   ``NamespaceClient.load``) on an embedded two-node Ray cluster (``service``): prefixes in
   this node's DRAM, in this node's NVMe and in the other node's DRAM, loaded by 1, 4 and 16
   clients at once (``clients``), each its own prefix; and prefixes of one and of eight tiny
   blocks, loaded alone, which measure the control path (a fixed cost per load and one per
   block).
3. The simulator, given only (1) and the control costs of the tiny loads of the same
   repetition, predicts the same N loads (``predict``): N load jobs through the ``Mover``,
   agent lanes and links of a two-node cluster with the measured speeds, then their CPU work
   on the node's cores, each client a thread. Each cell (source, N) compares the median of
   every load measured with the median of every load predicted; the goal: within 25%. Beside
   each, not judged, the CPU floor: N times one load's own CPU-seconds (measured in step 2
   with one client: the machine's busy CPU-seconds over the load, less what it keeps busy
   with no load running) over the cores.
4. The cluster scenarios' parameters against the same run (``parameters``): each value the
   scenarios take, the value measured here (the control costs of step 2, the agent's CPU per
   2 MiB moved, the speeds of step 1) and their ratio; for those that need a GPU or a NIC,
   why they cannot be measured here.

    result      the figures every step shares: speeds, control costs, rows, parameters
    machine     step 1 (nixl: NIXL between two processes)
    service     step 2, on the benchmarks' embedded clusters (``cmx.bench.harness.cluster``)
    predict     step 3, through the simulator's own model
    parameters  step 4
    run         the repetitions, each step in turn, and the rows
    docs        the calibration's section of docs/BENCHMARKS.md
"""

from __future__ import annotations

from cmx.simulate.calibrate.result import CalibrationResult, ControlCosts, MachineSpeeds
from cmx.simulate.calibrate.run import run_calibration, write_calibration

__all__ = ["CalibrationResult", "ControlCosts", "MachineSpeeds", "run_calibration",
           "write_calibration"]
