"""The one traffic generator of the fault tests: threads that store and load overlapping prefixes
through ``ContextMemory`` and check every answer, while a test kills the service's actors.

Every load must return the stored bytes of some whole-block prefix (possibly empty: a miss);
anything else is a wrong answer. Every call is timed against a bound.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from support import LAYOUT

from cmx.doors import TierStatsOf
from cmx.links import RAY_NAMESPACE, actor_name
from cmx.tiers import Tier

T = LAYOUT.block_tokens


def held(cm: Any, node: str) -> dict[str, tuple[int, int]]:
    """(pinned, reserved) of each tier of ``node`` that answers."""
    out = {}
    for tier in (Tier.HBM, Tier.DRAM, Tier.NVME):
        try:
            s = cm.link.call(actor_name(tier.value, node), TierStatsOf())
        except Exception:  # noqa: BLE001 - a tier restarting now is asked again later
            continue
        out[tier.value] = (s.pinned, s.reserved)
    return out


def nothing_held(cm: Any, node: str) -> bool:
    counts = held(cm, node)
    return len(counts) == 3 and all(c == (0, 0) for c in counts.values())


def until(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except Exception:  # noqa: BLE001 - an actor restarting now is asked again later
            pass
        time.sleep(0.5)
    return False


def kill(name: str) -> bool:
    """Kill a service actor by name and let Ray restart it; False if it is between lives."""
    try:
        ray.kill(ray.get_actor(name, namespace=RAY_NAMESPACE), no_restart=False)
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class Shape:
    """What the traffic looks like: ``prefixes`` prompts of ``shared + own`` blocks, the first
    ``shared`` blocks common to all (a system prompt), loaded by ``loaders`` threads and stored
    by ``storers`` threads."""

    prefixes: int = 3
    shared: int = 0
    own: int = 4
    loaders: int = 2
    storers: int = 1
    seed: int = 11


class Traffic:
    """Threads that store and load; each checks its answers and times its calls."""

    def __init__(self, cm: Any, bound_s: float, shape: Shape = Shape()) -> None:
        self.ns = cm.namespace("m-storm", LAYOUT, uuid.uuid4().hex[:8])
        self.bound_s = bound_s
        rng = np.random.default_rng(shape.seed)
        # Equal tokens have equal KV (one model), so the shared head's KV is shared too.
        head_toks = rng.integers(0, 50_000, shape.shared * T, dtype=np.uint32)
        head_kv = LAYOUT.random_kv(shape.shared * T, seed=shape.seed)
        self.prefixes = []
        for i in range(shape.prefixes):
            toks = rng.integers(0, 50_000, shape.own * T, dtype=np.uint32)
            kv = LAYOUT.random_kv(shape.own * T, seed=shape.seed + 1 + i)
            self.prefixes.append((np.concatenate([head_toks, toks]),
                                  torch.cat([head_kv, kv], dim=3)))
        self.stop = threading.Event()
        self.wrong: list[str] = []
        self.errors: list[str] = []
        self.slowest = 0.0
        self.loads = self.hits = self.stores = 0
        self.threads = [threading.Thread(target=self._load, args=(shape.seed + i,), daemon=True)
                        for i in range(shape.loaders)]
        self.threads += [threading.Thread(target=self._store, args=(i,), daemon=True)
                         for i in range(shape.storers)]

    def _timed(self, call: Any) -> Any:
        start = time.monotonic()
        try:
            return call()
        finally:
            self.slowest = max(self.slowest, time.monotonic() - start)

    def _store(self, offset: int) -> None:
        while not self.stop.is_set():
            for i in range(len(self.prefixes)):
                toks, kv = self.prefixes[(i + offset) % len(self.prefixes)]
                try:
                    self._timed(lambda t=toks, k=kv: self.ns.store(t, k).wait(self.bound_s))
                    self.stores += 1
                except Exception:  # noqa: BLE001 - a store the storm cut short is not stored
                    pass

    def _load(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not self.stop.is_set():
            toks, kv = self.prefixes[int(rng.integers(len(self.prefixes)))]
            try:
                got = self._timed(lambda t=toks: self.ns.load(t))
            except Exception as exc:  # noqa: BLE001 - a load must answer a miss, not raise
                self.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            n = got.shape[3]
            self.loads += 1
            self.hits += n > 0
            if n % T or not torch.equal(got, kv[:, :, :, :n]):
                self.wrong.append(f"{n} tokens, bytes differ")

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=2 * self.bound_s)
        assert not any(t.is_alive() for t in self.threads), "a call hung"
