"""What ``cmx up`` started, for the commands after it: a JSON file only its owner can read.

It holds the admin token, so it is written with mode 0600 (atomically: a temporary file in the
same directory, then a rename) and its directory with 0700.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, fields

__all__ = ["ServiceState"]


@dataclass(frozen=True)
class ServiceState:
    admin_url: str  # http://127.0.0.1:PORT
    token: str  # the admin token of that API
    ray_address: str  # the cluster the service runs on
    started_ray: bool  # `cmx up` started that Ray head, so `cmx down` stops it
    ray_pid: int | None = None  # the `ray start --block` process, when started_ray
    ray_log: str | None = None  # its output
    ray_dashboard: str | None = None  # Ray's dashboard of that head, if it has one
    node_id: str | None = None  # the node the admin API runs on
    started_at: float = 0.0  # Unix time

    def __repr__(self) -> str:  # never print the token
        return f"ServiceState(admin_url={self.admin_url!r}, ray_address={self.ray_address!r}, " \
               f"started_ray={self.started_ray}, ray_pid={self.ray_pid})"

    def save(self, path: str) -> None:
        folder = os.path.dirname(path) or "."
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".state-", dir=folder)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(self), f, indent=2)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str) -> ServiceState | None:
        """The recorded state; None if there is none or it is unreadable."""
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, ValueError):
            return None
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in raw.items() if k in known})
        except TypeError:
            return None

    @staticmethod
    def clear(path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
