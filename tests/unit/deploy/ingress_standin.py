"""What the ingress's unit tests share: a stand-in for the ``LLMServer`` handle the real
``OpenAIIngress`` calls, and the dependency through which Serve hands a route its replica."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from cmx.deploy.ingress import app
from cmx.deploy.messages import Delta, GenerateRequest, ReplicaInfo, Summary


class _Remote:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.remote = fn


class ReplicaStandIn:
    """The ``LLMServer`` handle as the ingress calls it: ``info`` and a streamed ``generate``
    that records each request and answers one token, ``token`` read as ``text``."""

    def __init__(self, info: ReplicaInfo, token: int, text: str) -> None:
        self.requests: list[GenerateRequest] = []
        self.info = _Remote(self._info)
        self.generate = _Remote(self._generate)
        self._answer = info, token, text

    def options(self, **_: Any) -> ReplicaStandIn:
        return self

    async def _info(self) -> ReplicaInfo:
        return self._answer[0]

    async def _generate(self, req: GenerateRequest) -> AsyncIterator[Any]:
        self.requests.append(req)
        _, token, text = self._answer
        yield [Delta(0, (token,), text, "length")]
        yield Summary(prompt_tokens=len(req.prompt_ids), cached_tokens=0, loaded_tokens=0,
                      ttft_s=0.0, total_s=0.0, prefetch="none", replica="r1", node="n1")


def servable_dependency() -> Callable[..., Any]:
    """Serve's dependency that hands a route its replica's ingress object."""
    from fastapi.routing import APIRoute

    for route in app.routes:
        if isinstance(route, APIRoute):
            for dep in route.dependant.dependencies:
                if dep.name == "self" and dep.call is not None:
                    return dep.call
    raise AssertionError("no route of the ingress takes the replica's object")
