"""Killing a tier actor, an agent or a directory shard while loads run.

No call hangs past its bound, no load returns wrong bytes (a shorter prefix is a miss), and
once Ray has restarted the actor the service serves the whole prefix again.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import ray
import torch
from support import LAYOUT

from cmx.links import RAY_NAMESPACE, actor_name

T = LAYOUT.block_tokens
BOUND_S = 45.0  # load_timeout_s (20) + a lookup + slack: no call may take longer


class Storm:
    """Loads the same prefix over and over from two threads, checking every answer."""

    def __init__(self, ns: Any, toks: np.ndarray, kv: torch.Tensor) -> None:
        self.ns, self.toks, self.kv = ns, toks, kv
        self.stop = threading.Event()
        self.calls = 0
        self.wrong: list[str] = []
        self.slowest = 0.0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]

    def _run(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            got = self.ns.load(self.toks)
            self.slowest = max(self.slowest, time.monotonic() - start)
            self.calls += 1
            n = got.shape[3]
            if n % T or not torch.equal(got, self.kv[:, :, :, :n]):
                self.wrong.append(f"{n} tokens, bytes differ")

    def __enter__(self) -> Storm:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=2 * BOUND_S)
        assert not any(t.is_alive() for t in self.threads), "a load hung"


def until(predicate: Any, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except Exception:  # noqa: BLE001 - a restarting actor may refuse a call: try again
            pass
        time.sleep(0.5)
    return False


@pytest.mark.parametrize("victim", ["dram", "agent", "dir:0", "nvme"])
def test_kill_during_load_storm(cm: Any, victim: str) -> None:
    ns = cm.namespace("m-fault", LAYOUT, f"kill-{victim}")
    toks = np.random.default_rng(7).integers(0, 50_000, 6 * T, dtype=np.uint32)
    kv = LAYOUT.random_kv(len(toks), seed=7)
    ns.store(toks, kv).wait()
    assert ns.lookup(toks).num_tokens == len(toks)

    kind, _, ident = victim.partition(":")
    name = actor_name(kind, ident or cm.node_id)
    with Storm(ns, toks, kv) as storm:
        time.sleep(1.0)
        ray.kill(ray.get_actor(name, namespace=RAY_NAMESPACE), no_restart=False)
        time.sleep(3.0)
    assert storm.calls > 0
    assert storm.wrong == []
    assert storm.slowest < BOUND_S

    # Served again after the restart: store anew (a restarted DRAM tier starts empty).
    def whole() -> bool:
        ns.store(toks, kv).wait()
        got = ns.load(toks)
        return got.shape == kv.shape and torch.equal(got, kv)

    # Ray restarts the actor within seconds on an idle machine; allow for a loaded one.
    assert until(whole, timeout_s=180), f"the service did not recover after {victim} was killed"
