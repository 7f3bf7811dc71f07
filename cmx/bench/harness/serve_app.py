"""``cmx serve`` and ``cmx serve --stop`` run as a user runs them, each application in a state
of its own (state directory, NVMe directory, Ray head and HTTP port), so that several can run
on one machine at once and none finds another's prefixes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ServeApp", "replicas_up", "wait_replicas"]


class ServeApp:
    """One ``cmx serve`` application: ``replicas`` LLM replicas (and ``prefill_replicas``
    prefill ones), float32, an API key per tenant in ``tenants`` (none: no key file)."""

    def __init__(self, work: Path, log: Callable[[str], None], replicas: int = 2,
                 prefill_replicas: int = 0, tenants: Sequence[str] = ()) -> None:
        from cmx.deploy.apikeys import add_key

        self.work = work
        self.log = log
        self.replicas = replicas
        self.prefill_replicas = prefill_replicas
        self.env = {**os.environ, "CMX_STATE_DIR": str(work / "state"),
                    "CMX_NVME_DIR": str(work / "nvme")}
        self.keys: dict[str, str] = {}
        self.env.pop("CMX_API_KEY_FILE", None)  # no tenants: no key file, whatever is set here
        if tenants:
            keys = str(work / "keys")
            self.keys = {t: add_key(keys, t) for t in tenants}
            self.env["CMX_API_KEY_FILE"] = keys
        self.address = ""  # its Ray head and HTTP port, chosen as it starts (``start``)
        self.port = 0

    @property
    def args(self) -> tuple[str, ...]:
        """What ``cmx serve`` is given besides where it runs."""
        split = ("--prefill-replicas", str(self.prefill_replicas)) if self.prefill_replicas \
            else ()
        return ("--replicas", str(self.replicas), *split, "--dtype", "float32")

    def _cmx(self, *args: str, timeout_s: float) -> str:
        cmd = [sys.executable, "-m", "cmx.cli", "serve", *args]
        # Run from the work directory: ``-m`` puts the directory it runs in on the path first.
        done = subprocess.run(cmd, env=self.env, cwd=self.work, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args) or 'cmx serve'} exited {done.returncode}: "
                               f"{done.stderr[-2000:]}")
        return done.stdout.strip()

    def start(self) -> str:
        """Start it; its OpenAI base URL (``http://127.0.0.1:PORT/v1``). Its ports are chosen
        now: one chosen long before could have been taken by then."""
        from cmx.deploy.local import free_port

        self.address, self.port = f"127.0.0.1:{free_port()}", free_port()
        self.log(f"cmx serve {' '.join(self.args)} (Ray at {self.address})")
        return self._cmx(*self.args, "--address", self.address, "--port", str(self.port),
                         timeout_s=900).splitlines()[-1]

    def state(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.work / "state" / "serve.json").read_text())
        return data

    def stop(self) -> str:
        return self._cmx("--stop", timeout_s=600)


def replicas_up(base: str) -> int:
    """Replicas the application routes to now; 0 where it does not answer."""
    import httpx

    try:
        return len(httpx.get(f"{base.removesuffix('/v1')}/cmx/replicas", timeout=30)
                   .json()["replicas"])
    except (httpx.HTTPError, ValueError, KeyError):
        return 0


def wait_replicas(base: str, count: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while (seen := replicas_up(base)) < count and time.monotonic() < deadline:
        time.sleep(2)
    return seen
