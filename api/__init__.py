"""The admin REST API of the service, its ``/metrics`` and its dashboard page.

    from cmx.api import create_app, ServiceBackend
    app = create_app(lambda: ServiceBackend.connect("auto", ServiceConfig.from_env()))

Run it standalone with ``python -m cmx.api --port 8470``, in the cluster as a detached actor
(``cmx up``, see ``cmx.api.server``) or as a Ray Serve ingress (``cmx.api.serve``).
"""

from __future__ import annotations

__all__ = ["ServiceBackend", "create_app"]


def __getattr__(name: str) -> object:
    # FastAPI and Ray load only when the app is asked for.
    if name == "create_app":
        from cmx.api.app import create_app

        return create_app
    if name == "ServiceBackend":
        from cmx.api.backend import ServiceBackend

        return ServiceBackend
    raise AttributeError(f"module 'cmx.api' has no attribute {name!r}")
