"""A cluster in a process of its own, spoken to in JSON lines: one Ray cluster per process is
all Ray allows, and the serving tests' clusters need settings (slots, CPUs) of their own.

The script prints ``{"step": ...}`` lines as it starts, one ``{"ready": {...}}`` line once up,
then answers each command line with one line (``{"error": ...}`` where it failed); closing its
stdin stops it. Every read is bounded. The serving scripts answer ``{"lookup": {"salt": ...,
"ids": [...]}}`` with ``{"tokens": N}``: the cached prefix of ``ids`` in the replicas'
namespace for that salt.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

__all__ = ["AppProcess"]

HERE = os.path.dirname(__file__)


class AppProcess:
    """The script ``name`` (in this folder) started with ``env`` added to this environment;
    ``ready`` is its ready message, once it came within ``start_timeout_s``."""

    def __init__(self, name: str, start_timeout_s: float,
                 env: dict[str, str] | None = None) -> None:
        environ = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(
            p for p in (HERE, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, name)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=environ)
        try:
            self.ready: dict[str, Any] = self.read(start_timeout_s, until="ready")["ready"]
        except BaseException:
            self.stop()
            raise

    def read(self, timeout_s: float, until: str | None = None) -> dict[str, Any]:
        """The next message (the next with key ``until``); raises what an error message says."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the application exited (rc {self.proc.poll()})")
            try:
                message = json.loads(line)
            except ValueError:
                continue  # a library's own line on stdout
            if not isinstance(message, dict):
                continue
            if "error" in message:
                raise RuntimeError(message["error"])
            if until is None or until in message:
                return dict(message)
        raise TimeoutError(f"the application did not answer within {timeout_s:.0f} s")

    def ask(self, command: dict[str, Any], timeout_s: float = 60) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout_s)

    def lookup(self, ids: list[int], salt: str = "") -> int:
        return int(self.ask({"lookup": {"salt": salt, "ids": ids}})["tokens"])

    def wait_stored(self, ids: list[int], tokens: int, salt: str = "",
                    timeout_s: float = 60) -> None:
        """Wait until ``tokens`` of ``ids`` are listed in the directory (stores commit after
        the response that made them)."""
        deadline = time.monotonic() + timeout_s
        while self.lookup(ids, salt) < tokens:
            assert time.monotonic() < deadline, "the store never became visible"
            time.sleep(0.3)

    def stop(self, timeout_s: float = 120) -> int | None:
        """Close its stdin (it stops once up); interrupt it, then kill it, if it does not exit
        within ``timeout_s`` each time. Its exit status."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        for sig in (None, signal.SIGINT, signal.SIGKILL):
            if sig is not None:
                self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.poll()
