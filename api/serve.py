"""The admin API as a Ray Serve ingress deployment, beside the service.

    from ray import serve
    from cmx.api.serve import admin_deployment
    serve.run(admin_deployment(service_config).bind(), name="cmx-admin", route_prefix="/admin")

or, from a Serve config file or ``serve run``: ``cmx.api.serve:build_app`` (arguments: none; the
configs come from the replica's ``CMX_*`` environment). One replica is enough: every figure comes
from the service's actors, and the replica keeps the samples its bandwidth and history need.
"""

from __future__ import annotations

from typing import Any

from cmx.config import AdminConfig, ServiceConfig

__all__ = ["admin_deployment", "build_app"]


def admin_deployment(
    service: ServiceConfig | None = None, admin: AdminConfig | None = None,
    name: str = "cmx-admin",
) -> Any:
    """A Serve deployment class whose ingress is the admin app."""
    from ray import serve

    from cmx.api.app import create_app
    from cmx.api.backend import ServiceBackend
    from cmx.api.ray_metrics import RayMetricsMirror

    service = service or ServiceConfig.from_env()
    admin = admin or AdminConfig.from_env()
    app = create_app(lambda: ServiceBackend.connect(None, service), admin,
                     mirror=RayMetricsMirror())

    @serve.deployment(name=name, num_replicas=1, ray_actor_options={"num_cpus": 0})
    @serve.ingress(app)
    class AdminIngress:
        """Serve's replica of the admin app; the routes are the app's."""

    return AdminIngress


def build_app(args: dict[str, Any] | None = None) -> Any:
    """Application builder for Serve config files and ``serve run``."""
    return admin_deployment().bind()
