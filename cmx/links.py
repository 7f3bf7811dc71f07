"""How actors reach each other: by name in the ``cmx`` Ray namespace, with bounded waits, each
call a typed request (``cmx.doors``: the request names the method and types its answer).

Plain classes take a link object instead of Ray handles, so unit tests pass in local objects
(``LocalLink``) and the service passes ``RayLink``. Both have ``call`` (one call, waited for),
``call_many`` (several calls in flight at once, each waited for), ``submit`` and ``result``
(a call started now and waited for later) and ``tell`` (a call nobody waits for: releasing
pins a peer holds for us).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from cmx.doors.base import Pending, Request
from cmx.errors import UnavailableError
from cmx.protocol import RAY_NAMESPACE, actor_name

__all__ = ["RAY_NAMESPACE", "Call", "LocalLink", "RayLink", "actor_name"]

R = TypeVar("R")
Call = tuple[str, Request[Any]]  # (actor name, request)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Answered:
    """A call ``LocalLink.submit`` already ran: its answer, or its failure."""

    value: Any
    error: Exception | None


class LocalLink:
    """Calls plain objects in this process: for unit tests and single-process use."""

    def __init__(self, targets: Mapping[str, Any]) -> None:
        self._targets = targets  # looked up at each call: targets may be added later

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        target = self._targets.get(name)
        if target is None:
            raise UnavailableError(f"{name} is not running")
        answer: R = getattr(target, request.method)(**request.kwargs())
        return answer

    def call_many(self, calls: Sequence[Call], timeout_s: float | None = None,
                  return_exceptions: bool = False) -> list[Any]:
        results: list[Any] = []
        for name, request in calls:
            try:
                results.append(self.call(name, request))
            except Exception as exc:
                if not return_exceptions:
                    raise
                results.append(exc)
        return results

    def submit(self, name: str, request: Request[R]) -> Pending[R]:
        """Run the call now; ``result`` hands over its answer (or raises its failure)."""
        if name not in self._targets:
            raise UnavailableError(f"{name} is not running")
        try:
            return Pending(request, _Answered(self.call(name, request), None))
        except Exception as exc:  # noqa: BLE001 - raised where the answer is asked for
            return Pending(request, _Answered(None, exc))

    def result(self, pending: Pending[R], timeout_s: float | None = None) -> R:
        answered: _Answered = pending.ref
        if answered.error is not None:
            raise answered.error
        value: R = answered.value
        return value

    def ready(self, pending: Pending[Any]) -> bool:
        return True

    def tell(self, name: str, request: Request[Any]) -> None:
        try:
            self.call(name, request)
        except Exception as exc:  # noqa: BLE001 - nobody waits for a tell's answer
            log.warning("%s.%s failed: %s", name, request.method, exc)


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

    def submit(self, name: str, request: Request[R]) -> Pending[R]:
        """Start a call; ``result`` waits for its answer."""
        method = getattr(self.handle(name), request.method)
        return Pending(request, method.remote(**request.kwargs()))

    def result(self, pending: Pending[R], timeout_s: float | None = None) -> R:
        """The answer of a call ``submit`` started, waited for at most ``timeout_s``; the
        call's own failure is raised as it was raised there."""
        import ray
        from ray.exceptions import (
            ActorUnavailableError,
            ActorUnschedulableError,
            GetTimeoutError,
            RayActorError,
            RayTaskError,
        )

        try:
            answer: R = ray.get(pending.ref, timeout=timeout_s or self.timeout_s)
            return answer
        except (GetTimeoutError, RayActorError, ActorUnavailableError,
                ActorUnschedulableError) as exc:
            self._forget(exc)
            raise UnavailableError(f"a call did not answer: {exc}") from None
        except RayTaskError as exc:
            raise exc.as_instanceof_cause() from None

    def _forget(self, failure: Exception) -> None:
        """Drop the handle of the actor that failed a call, so the next call looks its name
        up again: an actor started anew under the name (a lost directory shard, a moved
        agent) is another actor, and the dead one's handle would fail every call. Ray does
        not say which actor cannot be scheduled (one pinned to a node that died): then every
        handle goes, each looked up again at its next call."""
        from ray.exceptions import ActorUnschedulableError

        if isinstance(failure, ActorUnschedulableError):
            self._handles.clear()
            return
        actor_id = getattr(failure, "actor_id", None)
        if not actor_id:
            return
        for name, handle in list(self._handles.items()):
            held = getattr(handle, "_actor_id", None)  # Ray's own; absent: looked up again
            if held is None or held.hex() == actor_id:
                self._handles.pop(name, None)  # another thread may have dropped it first

    def ready(self, pending: Pending[Any]) -> bool:
        """Whether the call ``submit`` started has answered."""
        import ray

        done, _ = ray.wait([pending.ref], timeout=0)
        return bool(done)

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        answer: R = self.call_many([(name, request)], timeout_s)[0]
        return answer

    def call_many(self, calls: Sequence[Call], timeout_s: float | None = None,
                  return_exceptions: bool = False) -> list[Any]:
        """Start every call, then wait for each (all within ``timeout_s``); results in order.
        The first failure is raised once every call has answered or timed out; with
        ``return_exceptions``, each failure takes its call's place in the results instead."""
        import ray
        from ray.exceptions import (
            ActorUnavailableError,
            ActorUnschedulableError,
            GetTimeoutError,
            RayActorError,
            RayTaskError,
        )

        refs: list[Any] = []
        for name, request in calls:
            try:
                refs.append(self.submit(name, request).ref)
            except UnavailableError as exc:
                refs.append(exc)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        results: list[Any] = []
        for (name, request), ref in zip(calls, refs):
            if isinstance(ref, BaseException):
                results.append(ref)
                continue
            try:
                results.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except (GetTimeoutError, RayActorError, ActorUnavailableError,
                    ActorUnschedulableError) as exc:
                self._handles.pop(name, None)
                results.append(UnavailableError(
                    f"{name}.{request.method} did not answer: {exc}"))
            except RayTaskError as exc:
                results.append(exc.as_instanceof_cause())
        if not return_exceptions:
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        return results

    def tell(self, name: str, request: Request[Any]) -> None:
        """Start a call and return; a failure is Ray's to log."""
        try:
            self.submit(name, request)
        except UnavailableError as exc:
            log.warning("%s.%s not sent: %s", name, request.method, exc)

    def __getstate__(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout_s, "_handles": {}}
