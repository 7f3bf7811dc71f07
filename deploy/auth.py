"""The API key check where a tenant's prompt enters: a FastAPI dependency of the ingress.

``AUTHENTICATED`` is a dependency of each route that runs a prompt, solved before the body is
read: it sets ``request.state.tenant``, or answers 401 with an OpenAI error object for a key the
key file does not hold. The ``Tenancy`` it checks against is the one the replica's ingress loaded
when it started (``current_tenancy``: Serve runs a frozen copy of the app, so the replica's
object, not the app's state, holds it). ``request_salt`` is the namespace salt of a request
``AUTHENTICATED`` let through. Routes that describe the deployment (``/v1/models``,
``/cmx/info``, ``/cmx/replicas``) carry no tenant's data and answer without a key.
"""

from __future__ import annotations

from fastapi import Depends, Request

from cmx.deploy.errors import ApiError
from cmx.deploy.tenants import Tenancy, Tenant, UnknownKeyError

__all__ = ["AUTHENTICATED", "authenticate", "current_tenancy", "request_salt"]


def current_tenancy() -> Tenancy:
    """The tenancy of the ingress this replica runs (its ``tenancy`` attribute)."""
    from ray import serve

    tenancy = getattr(serve.get_replica_context().servable_object, "tenancy", None)
    if not isinstance(tenancy, Tenancy):  # fail closed: no prompt is served unchecked
        raise ApiError(503, "the server is not ready: it has no tenancy", "server_error")
    return tenancy


_TENANCY = Depends(current_tenancy)


def authenticate(request: Request, tenancy: Tenancy = _TENANCY) -> Tenant:
    """The request's tenant (also ``request.state.tenant``); a 401 ``ApiError`` if refused."""
    try:
        tenant = tenancy.who(request.headers.get("authorization"))
    except UnknownKeyError as exc:
        raise ApiError(401, str(exc), "invalid_request_error") from None
    request.state.tenant, request.state.tenancy = tenant, tenancy
    return tenant


AUTHENTICATED = Depends(authenticate)


def request_salt(request: Request, cache_salt: str | None) -> str:
    """The namespace salt of a request ``authenticate`` let through."""
    tenant = getattr(request.state, "tenant", None)
    tenancy = getattr(request.state, "tenancy", None)
    if not isinstance(tenant, Tenant) or not isinstance(tenancy, Tenancy):
        raise ApiError(500, "a route that runs a prompt was not authenticated", "server_error")
    return tenancy.salt(tenant, cache_salt)
