"""Errors as RFC 7807 problem details (``application/problem+json``).

Bad input is always a 4xx: malformed bodies and parameters 422, unknown nodes or blocks 404,
missing or wrong tokens 401, refused mutations 403. A part of the service that does not answer
is a 503 (the caller may retry); an operation the running service lacks is a 501.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cmx.errors import BlockTooLargeError, InvalidKeyError, LayoutMismatchError, UnavailableError

__all__ = ["PROBLEM_JSON", "ApiProblem", "install_problem_handlers", "problem_responses"]

log = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"

_TITLES = {
    400: "Bad request", 401: "Unauthorized", 403: "Forbidden", 404: "Not found",
    405: "Method not allowed", 409: "Conflict", 413: "Request too large",
    422: "Unprocessable request", 500: "Internal error", 501: "Not implemented",
    503: "Service unavailable",
}


class ApiProblem(Exception):
    """Raised by a route to answer with a problem document."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers


def problem(
    status: int, detail: str | None, request: Request | None = None,
    errors: list[dict[str, Any]] | None = None, headers: dict[str, str] | None = None,
    path: str | None = None,
) -> JSONResponse:
    """A problem document; ``instance`` is the request's path (``path`` where no Request is)."""
    body: dict[str, Any] = {"type": "about:blank", "title": _TITLES.get(status, "Error"),
                            "status": status, "detail": detail}
    instance = request.url.path if request is not None else path
    if instance is not None:
        body["instance"] = instance
    if errors is not None:
        body["errors"] = errors
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def problem_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for the problem codes a route may answer."""
    from cmx.api.models import Problem

    return {code: {"model": Problem, "description": _TITLES.get(code, "Error"),
                   "content": {PROBLEM_JSON: {}}} for code in codes}


def _field_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    return [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")),
             "type": str(e.get("type", ""))} for e in exc.errors()]


def install_problem_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiProblem)
    async def _api(request: Request, exc: ApiProblem) -> JSONResponse:
        return problem(exc.status, exc.detail, request, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return problem(422, "the request does not match the schema", request,
                       errors=_field_errors(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return problem(exc.status_code, str(exc.detail), request,
                       headers=getattr(exc, "headers", None))

    @app.exception_handler(InvalidKeyError)
    @app.exception_handler(LayoutMismatchError)
    @app.exception_handler(BlockTooLargeError)
    async def _bad_input(request: Request, exc: Exception) -> JSONResponse:
        return problem(422, str(exc), request)

    @app.exception_handler(UnavailableError)
    async def _unavailable(request: Request, exc: UnavailableError) -> JSONResponse:
        return problem(503, str(exc), request, headers={"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("admin API: %s %s failed", request.method, request.url.path)
        return problem(500, f"{type(exc).__name__}: the request failed; see the server log",
                       request)
