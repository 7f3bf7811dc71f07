"""The CPU meter of the serving benchmark: process trees grouped, exited processes counted."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from cmx.bench.harness.proc_cpu import REST, CpuMeter, CpuUse, machine_busy_s, process_table

# Burns ``seconds`` of its own CPU time (not wall time: a busy machine only makes it slower).
_BURN = ("import time,sys\nt=float(sys.argv[1])\n"
         "while time.process_time() < t: pass\n")


def _burn(seconds: float, *, child: bool = False) -> subprocess.Popen[bytes]:
    code = _BURN
    if child:  # the burn runs in a grandchild: the tree under the root must be followed
        code = ("import subprocess,sys\n"
                f"subprocess.run([sys.executable, '-c', {_BURN!r}, sys.argv[1]], check=True)\n")
    return subprocess.Popen([sys.executable, "-c", code, str(seconds)])


def test_a_tree_is_counted_in_its_group_and_an_exited_process_is_not_lost() -> None:
    with CpuMeter({"idle": []}, interval_s=0.05) as meter:
        proc = _burn(1.0, child=True)
        meter.add("burn", proc.pid)
        assert proc.wait(120) == 0  # the grandchild has exited and been reaped
    use = meter.use
    assert use is not None
    # The grandchild's second is counted though it exited; at most one interval lost.
    assert 0.5 <= use.groups["burn"] <= 1.5
    assert use.groups["idle"] == 0.0
    assert set(use.groups) == {"idle", "burn", REST}
    assert use.machine_busy_s >= use.groups["burn"] - 0.2


def test_a_process_outside_every_group_is_the_rest() -> None:
    with CpuMeter(interval_s=0.05) as meter:
        assert _burn(0.5).wait(120) == 0
    assert meter.use is not None and meter.use.groups[REST] >= 0.35


def test_stat_lines_are_read_after_the_command_name(tmp_path: Path) -> None:
    # A command name may hold spaces and parentheses.
    fields = ["S", "7", *["0"] * 9, "250", "50", "0", "0", *["0"] * 4, "12345"]
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text(f"42 (a) (b c) {' '.join(fields)}\n")
    (tmp_path / "self").mkdir()
    # user nice system idle iowait irq softirq steal: steal is another guest's time
    (tmp_path / "stat").write_text("cpu  100 0 100 700 100 0 0 50 0 0\n")
    import os

    tick = os.sysconf("SC_CLK_TCK")
    (row,) = process_table(tmp_path).values()
    assert (row.ppid, row.start, row.cpu_s) == (7, 12345, 300 / tick)
    assert machine_busy_s(tmp_path) == (200 / tick, 1050 / tick)


def test_uses_add_up_by_group() -> None:
    a = CpuUse(10.0, {"servers": 4.0, REST: 1.0}, 8.0, 2)
    b = CpuUse(10.0, {"servers": 6.0, "clients": 1.0}, 12.0, 2)
    total = a + b
    assert total.groups == {"servers": 10.0, REST: 1.0, "clients": 1.0}
    assert (total.wall_s, total.machine_busy_s, total.machine_share) == (20.0, 20.0, 0.5)


def test_a_process_added_later_counts_only_its_cpu_since_the_meter_opened(
    tmp_path: Path,
) -> None:
    # Outside this process's tree (its parent exits at once): a stranger until it is added.
    code = ("import os,sys,time\nd=sys.argv[1]\nwhile time.process_time() < 0.6: pass\n"
            "open(d+'/pid','w').write(str(os.getpid()))\n"
            "end=time.time()+60\n"
            "while not os.path.exists(d+'/stop') and time.time() < end: time.sleep(0.05)\n")
    spawn = ("import subprocess,sys; "
             f"subprocess.Popen([sys.executable, '-c', {code!r}, {str(tmp_path)!r}])")
    subprocess.run([sys.executable, "-c", spawn], check=True, timeout=60)
    pid_file = tmp_path / "pid"
    for _ in range(1200):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    try:
        with CpuMeter(interval_s=0.05) as meter:
            meter.add("late", pid)  # has burnt 0.6 CPU-s before the meter opened
            time.sleep(0.3)
    finally:
        (tmp_path / "stop").touch()
    assert meter.use is not None and meter.use.groups["late"] < 0.3
