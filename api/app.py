"""The admin API application: ``create_app(make_backend, config)``.

It serves the JSON API under ``/api/v1``, ``/metrics``, ``/healthz`` and ``/readyz``, the
OpenAPI schema at ``/openapi.json``, and the dashboard at ``/`` (static files, no build step).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from cmx import __version__
from cmx.api import actions, routes
from cmx.api.backend import Backend
from cmx.api.limits import BodyLimit
from cmx.api.problems import install_problem_handlers
from cmx.api.state import ApiState
from cmx.config import AdminConfig

if TYPE_CHECKING:
    from cmx.api.ray_metrics import RayMetricsMirror

__all__ = ["MAX_BODY_BYTES", "STATIC_DIR", "create_app"]

STATIC_DIR = Path(__file__).parent / "static"
MAX_BODY_BYTES = 16 << 20  # a lookup of 2**20 token ids fits; chunked bodies are counted too

# The page and its script come from this server only; nothing inline, no framing.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


def create_app(
    make_backend: Callable[[], Backend], config: AdminConfig | None = None,
    mirror: RayMetricsMirror | None = None, sample_in_background: bool = True,
) -> FastAPI:
    """The admin app over the backend ``make_backend()`` returns (called on first use)."""
    config = config or AdminConfig.from_env()
    state = ApiState(make_backend, config, mirror)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if sample_in_background:
            state.start()
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(
        title="CMX admin API", version=__version__, lifespan=lifespan,
        description="Tiers, nodes, blocks and prefix lookups of a CMX context memory service; "
                    "pin, unpin, evict and drop (bearer token). Errors are RFC 7807 problem "
                    "details.",
    )
    app.state.cmx = state
    app.state.admin_config = config
    install_problem_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)  # inside guard: 413s get its headers

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]
                    ) -> Response:
        response = await call_next(request)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Cache-Control", "no-store")
        if request.url.path == "/" or request.url.path.startswith("/static/"):
            response.headers.update(_PAGE_HEADERS)
        return response

    app.include_router(routes.router)
    app.include_router(actions.router)

    @app.get("/", include_in_schema=False)
    def dashboard(request: Request) -> Response:
        # The page's links are relative: under a route prefix it must be ".../prefix/".
        if not request.url.path.endswith("/"):
            return RedirectResponse(request.url.path + "/", status_code=307)
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
