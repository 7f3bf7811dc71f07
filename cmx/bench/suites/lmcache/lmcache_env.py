"""LMCache, the peer of the "lmcache" and "prefetch" suites, in a virtual environment of its own.

LMCache is no dependency of cmx. The first suite that needs it creates ``DIR/lmcache-venv``
(``DIR`` is ``--dir``), installs the CPU build of torch into it first (the wheel this machine
holds; any other torch spec would pull gigabytes of CUDA builds), then ``lmcache==0.5.*``, and
later runs reuse it; delete the directory to reinstall. Each measurement runs
``lmcache_driver.py`` with that environment's Python, one operation per process, and reads back
the JSON object it writes. Anything that goes wrong becomes a ``PeerError`` whose message says
what and where, so a suite can report it instead of figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cmx.bench.harness.core import BenchContext
from cmx.errors import CmxError

__all__ = [
    "DRIVER",
    "LMCACHE_SPEC",
    "REQUIRED_KEYS",
    "TORCH_SPEC",
    "Peer",
    "PeerError",
    "driver_env",
    "ensure_peer",
    "parse_result",
    "run_driver",
]

LMCACHE_SPEC = "lmcache==0.5.*"
TORCH_SPEC = "torch==2.13.0"  # the CPU wheel on this machine's disk
VENV_NAME = "lmcache-venv"
DRIVER = Path(__file__).with_name("lmcache_driver.py")
_INSTALL_TIMEOUT_S = 1800.0
_MEMO = "lmcache_peer"

# What each driver operation must report; anything less is a failed run.
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "probe": ("lmcache", "torch"),
    "disk": ("bytes", "store_s", "load_s", "loaded_tokens", "head_s", "verified", "files"),
    "restart": ("chunks", "hit_chunks", "hit_tokens", "files_before"),
    "cpu": ("bytes", "store_s", "load_s", "loaded_tokens", "verified"),
    "prefetch": ("bytes", "store_s", "cold_s", "waits", "ready_s", "verified"),
}


class PeerError(CmxError):
    """LMCache could not be installed, started or measured; the message says why."""


@dataclass(frozen=True)
class Peer:
    python: Path  # the interpreter of LMCache's virtual environment
    lmcache: str  # installed version
    torch: str

    def describe(self) -> str:
        return f"LMCache {self.lmcache} (torch {self.torch}) in {self.python.parent.parent}"


def driver_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a driver process.

    LMCache keys chunks with Python's ``hash()``: without a fixed PYTHONHASHSEED a new process
    computes other keys, and a restart would miss for that reason rather than for its index.
    Its usage telemetry is switched off (this machine reaches no such service).
    """
    env = dict(os.environ if base is None else base)
    env.update({"PYTHONHASHSEED": "0", "LMCACHE_LOG_LEVEL": "WARNING",
                "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"})
    env.pop("PYTHONPATH", None)  # nothing of cmx's environment leaks into LMCache's
    return env


def parse_result(text: str, op: str) -> dict[str, Any]:
    """The driver's JSON object for ``op``; PeerError if it is not one or lacks a field."""
    try:
        result = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PeerError(f"LMCache driver ({op}) wrote no JSON object: {exc}") from exc
    if not isinstance(result, dict):
        raise PeerError(f"LMCache driver ({op}) wrote {type(result).__name__}, not an object")
    missing = [k for k in REQUIRED_KEYS[op] if k not in result]
    if missing:
        raise PeerError(f"LMCache driver ({op}) left out {', '.join(missing)}")
    return result


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run(cmd: list[str], timeout: float, what: str) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=driver_env(), check=False)
    except subprocess.TimeoutExpired as exc:
        raise PeerError(f"{what} did not finish in {timeout:g} s") from exc
    except OSError as exc:
        raise PeerError(f"{what} could not start: {exc}") from exc
    if proc.returncode != 0:
        raise PeerError(f"{what} failed (exit {proc.returncode}):\n"
                        f"{_tail(proc.stderr or proc.stdout)}")
    return proc


def run_driver(peer: Peer, spec: Mapping[str, Any], work: Path,
               timeout: float = 1800.0) -> dict[str, Any]:
    """Run one driver operation (``spec["op"]``) in LMCache's environment; its JSON result."""
    op = str(spec["op"])
    work.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = work / f"{op}-spec.json", work / f"{op}-result.json"
    spec_path.write_text(json.dumps(dict(spec)))
    out_path.unlink(missing_ok=True)
    _run([str(peer.python), str(DRIVER), str(spec_path), str(out_path)], timeout,
         f"LMCache driver ({op})")
    if not out_path.exists():
        raise PeerError(f"LMCache driver ({op}) exited without writing {out_path}")
    return parse_result(out_path.read_text(), op)


def _probe(python: Path, work: Path) -> Peer:
    got = run_driver(Peer(python, "?", "?"), {"op": "probe"}, work, timeout=300)
    if not str(got["lmcache"]).startswith("0.5."):
        raise PeerError(f"{python} has lmcache {got['lmcache']}, not {LMCACHE_SPEC}")
    return Peer(python, str(got["lmcache"]), str(got["torch"]))


def _install(venv: Path, ctx: BenchContext) -> None:
    ctx.log(f"lmcache: creating {venv} and installing {TORCH_SPEC}, then {LMCACHE_SPEC} "
            "(minutes, once)")
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], 300, f"python -m venv {venv}")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    # torch first: lmcache's own requirement would otherwise resolve to a CUDA build.
    _run([*pip, TORCH_SPEC], _INSTALL_TIMEOUT_S, f"pip install {TORCH_SPEC}")
    _run([*pip, LMCACHE_SPEC], _INSTALL_TIMEOUT_S, f"pip install '{LMCACHE_SPEC}'")


def ensure_peer(ctx: BenchContext) -> Peer:
    """LMCache's environment under ``--dir``, installed on first use; PeerError if impossible.

    The outcome, either way, is kept for the rest of the run, so a failed install is tried once.
    """
    memo = ctx.memo.get(_MEMO)
    if isinstance(memo, Peer):
        return memo
    if isinstance(memo, PeerError):
        raise memo
    venv = ctx.config.dir / VENV_NAME
    python = venv / "bin" / "python"
    work = ctx.scratch("lmcache-driver")
    try:
        try:
            peer = _probe(python, work) if python.exists() else None
        except PeerError as exc:
            ctx.log(f"lmcache: existing {venv} unusable ({exc}); reinstalling")
            peer = None
        if peer is None:
            _install(venv, ctx)
            peer = _probe(python, work)
    except PeerError as exc:
        ctx.memo[_MEMO] = exc
        raise
    ctx.memo[_MEMO] = peer
    ctx.log(f"lmcache: {peer.describe()}")
    return peer
