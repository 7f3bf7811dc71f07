"""A process that joins a cluster running without token authentication, on a machine where a
Ray token exists (as every engine process of a replica does): what it ``ray.put``s is read on
another node. In token mode it would refuse the other raylet's calls for the object's location,
and that node would see the object's owner as dead (a store's payload lost, every time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

JOINER = """
import json, sys
import numpy as np
import ray
from ray._private.authentication.authentication_utils import is_token_auth_enabled
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from cmx.operate.ray_cluster import join

join(sys.argv[1])
here = ray.get_runtime_context().get_node_id()
other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)

@ray.remote(num_cpus=0)
def total(a):
    return float(a.sum())

far = NodeAffinitySchedulingStrategy(other, soft=False)
ref = total.options(scheduling_strategy=far).remote(ray.put(np.ones(1 << 20)))
try:
    answer = ray.get(ref, timeout=120)
except Exception as exc:
    answer = type(exc).__name__
print(json.dumps({"token": is_token_auth_enabled(), "sum": answer}))
"""


def test_a_joined_process_owns_objects_another_node_reads(cluster: Any, tmp_path: Path) -> None:
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    env["HOME"] = str(tmp_path)  # a token on this machine, as `ray.init()` leaves one
    done = subprocess.run([sys.executable, "-c", JOINER, cluster.address], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"token": False, "sum": float(1 << 20)}, done.stderr[-4000:]


UP_AUTH = """
import json, sys
from cmx.operate.lifecycle import match_auth_for

print(json.dumps(match_auth_for(sys.argv[1])))
"""


def test_cmx_up_at_a_running_cluster_without_tokens_joins_it_without_one(
    cluster: Any, tmp_path: Path,
) -> None:
    """`cmx up --address` at a cluster that runs without token authentication, from a machine
    where a token exists: it must not turn token mode on, or this process would refuse the
    cluster's calls, which carry no token (as in the test above)."""
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    env["HOME"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", UP_AUTH, cluster.address], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) is False, done.stderr[-4000:]
