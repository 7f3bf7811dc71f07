"""Shared pieces of the lifecycle tests: a machine of their own for `cmx` and client processes.

Every process gets a HOME of its own (with a Ray token in it, as any earlier ``ray.init()``
leaves one: then ``ray start`` turns token authentication on) and RAY_TMPDIR (so Ray's
current-cluster file is this test's, never the machine's), free ports, small tiers.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Machine:
    env: dict[str, str]
    root: Path  # HOME, state and NVMe directories
    ray_tmp: Path  # RAY_TMPDIR: Ray's sessions and its current-cluster file

    @property
    def current_cluster_file(self) -> Path:
        return self.ray_tmp / "ray" / "ray_current_cluster"

    def cmx(self, *args: str, timeout_s: float = 300) -> Any:
        result = subprocess.run([sys.executable, "-m", "cmx.cli", *args], env=self.env,
                                capture_output=True, text=True, timeout=timeout_s)
        assert result.returncode == 0, \
            f"cmx {' '.join(args)}:\n{result.stdout}\n{result.stderr[-4000:]}"
        return json.loads(result.stdout)

    def python(self, code: str, timeout_s: float = 240, prefix: Sequence[str] = (),
               **env: str) -> Any:
        """Run ``code`` in a new interpreter (after ``prefix``: ``ip netns exec NAME``, say);
        it prints one JSON line last. A bound: a hang fails the test instead of stalling it."""
        result = subprocess.run([*prefix, sys.executable, "-c", code], env={**self.env, **env},
                                capture_output=True, text=True, timeout=timeout_s)
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
        return json.loads(result.stdout.strip().splitlines()[-1])


def new_machine(tmp_path: Path, with_token: bool = True) -> Machine:
    home = tmp_path / "home"
    home.mkdir()
    # Unix socket paths under RAY_TMPDIR must stay short: not under pytest's tmp_path.
    ray_tmp = Path(tempfile.mkdtemp(prefix="cmxl-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CMX_", "RAY_"))}
    env.update({
        "HOME": str(home), "RAY_TMPDIR": str(ray_tmp),
        "CMX_STATE_DIR": str(tmp_path / "state"), "CMX_NVME_DIR": str(tmp_path / "nvme"),
        "CMX_HBM_BYTES": str(16 << 20), "CMX_DRAM_BYTES": str(32 << 20),
        "CMX_NVME_BYTES": str(256 << 20), "CMX_NVME_SEGMENT_BYTES": str(32 << 20),
        "CMX_STAGING_BYTES": str(16 << 20), "CMX_BLOCK_BYTES": str(64 << 10),
        "CMX_DIRECTORY_SHARDS": "1", "CMX_HEARTBEAT_S": "0.5",
        "RAY_DISABLE_USAGE_STATS": "1",
    })
    if with_token:
        subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env,
                       capture_output=True, check=True, timeout=60)
        assert (home / ".ray" / "auth_token").exists()
    return Machine(env, tmp_path, ray_tmp)


# A client process: store and find 4 blocks, print where it ran, disconnect.
CLIENT = """
import json, sys, torch, ray
from cmx import ContextMemory, KVLayout
address = sys.argv[1] if len(sys.argv) > 1 else None
own = {} if address else {"num_cpus": 1, "include_dashboard": False}
cm = ContextMemory.connect(address=address, **own)
layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, dtype="float16", block_tokens=16)
ns = cm.namespace("m", layout)
tokens = list(range(64))
stored = ns.store(tokens, torch.randn(layout.shape(64)).to(torch.float16)).wait()
found = ns.lookup(tokens).num_tokens
gcs = ray.get_runtime_context().gcs_address
cm.shutdown()
print(json.dumps({"gcs": gcs, "stored": stored, "found": found,
                  "ray_after": ray.is_initialized()}))
"""


def client_code(address: str | None) -> str:
    if address is None:
        return CLIENT
    return f"import sys; sys.argv = ['client', {address!r}]\n" + CLIENT
