"""OpenAI-style errors at the HTTP edge: every malformed request is a 4xx error object.

``ApiError`` is raised by the ingress for what it refuses; ``parse_body`` reads a body with a
bound on its bytes (whether or not it says its length) and validates it into a pydantic model on
a thread of the caller's pool, never on the event loop (8 MiB of token ids is ~4M of them:
about half a second of ``json.loads`` and validation that would hold every other request);
``install_handlers`` makes FastAPI answer both, and its own validation errors, in OpenAI's
format. A replica that refuses a request raises ``BadRequest``, which reaches the ingress as
the same type (Ray's task errors subclass their cause) and becomes a 400.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Executor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from cmx.deploy.openai_bodies import error_body

__all__ = ["MAX_BODY_BYTES", "ApiError", "BadRequest", "install_handlers", "parse_body"]

MAX_BODY_BYTES = 8 << 20  # a 16K-token prompt is well under 1 MiB of JSON


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


class BadRequest(ValueError):
    """A replica's refusal of a request that passed the ingress's checks (a 400)."""


def _response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.kind, exc.param),
                        status_code=exc.status)


def _validation_message(errors: list[Any]) -> str:
    return "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}"
                     for e in errors[:8])


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _response(exc)

    @app.exception_handler(BadRequest)
    async def _bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return _response(ApiError(400, str(exc)))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _response(ApiError(400, _validation_message(list(exc.errors()))))


async def _read(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body has {declared} bytes; at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():  # a chunked body says no length: count as it comes
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the body is over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[BaseModel], executor: Executor,
                     limit: int = MAX_BODY_BYTES) -> Any:
    """The body as ``model``, every error in OpenAI's format; decoded and validated on a thread
    of ``executor`` (its size bounds the bodies decoded at once), so the event loop serves
    other requests meanwhile."""
    raw = await _read(request, limit)
    return await asyncio.get_running_loop().run_in_executor(executor, _decode, raw, model)


def _decode(raw: bytes, model: type[BaseModel]) -> Any:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError(400, _validation_message(list(exc.errors()))) from None
