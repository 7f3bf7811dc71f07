"""How actors reach each other: by name in the ``cmx`` Ray namespace, with bounded waits.

Plain classes take a link object instead of Ray handles, so unit tests pass in local objects
(``LocalLink``) and the service passes ``RayLink``; both have one method, ``call``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cmx.errors import UnavailableError

__all__ = ["LocalLink", "RayLink", "actor_name"]

RAY_NAMESPACE = "cmx"


def actor_name(kind: str, ident: str | int) -> str:
    """``cmx:dram:<node id>``, ``cmx:agent:<node id>``, ``cmx:dir:3`` and so on."""
    return f"cmx:{kind}:{ident}"


class LocalLink:
    """Calls plain objects in this process: for unit tests and single-process use."""

    def __init__(self, targets: Mapping[str, Any]) -> None:
        self._targets = targets  # looked up at each call: targets may be added later

    def call(self, name: str, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        target = self._targets.get(name)
        if target is None:
            raise UnavailableError(f"{name} is not running")
        return getattr(target, method)(*args)


class RayLink:
    """Calls named Ray actors; every wait is bounded and every failure is UnavailableError."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self._handles: dict[str, Any] = {}

    def handle(self, name: str) -> Any:
        import ray

        handle = self._handles.get(name)
        if handle is None:
            try:
                handle = ray.get_actor(name, namespace=RAY_NAMESPACE)
            except ValueError as exc:
                raise UnavailableError(f"{name} is not running") from exc
            self._handles[name] = handle
        return handle

    def submit(self, name: str, method: str, *args: Any) -> Any:
        """Start a call; returns its ObjectRef."""
        return getattr(self.handle(name), method).remote(*args)

    def call(self, name: str, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        import ray
        from ray.exceptions import (
            ActorUnavailableError,
            GetTimeoutError,
            RayActorError,
            RayTaskError,
        )

        try:
            ref = self.submit(name, method, *args)
            return ray.get(ref, timeout=timeout_s or self.timeout_s)
        except (GetTimeoutError, RayActorError, ActorUnavailableError) as exc:
            self._handles.pop(name, None)
            raise UnavailableError(f"{name}.{method} did not answer: {exc}") from exc
        except RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            raise cause from None

    def __getstate__(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout_s, "_handles": {}}
