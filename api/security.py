"""Bearer-token checks of the admin API.

- Mutating endpoints (pin, unpin, evict, drop a namespace) need ``Authorization: Bearer <token>``.
  A server started with no token refuses them all (403): nothing changes the cache by accident.
- Queries that reveal what is cached (a block's copies, a prefix lookup) need it too: whoever can
  ask "is this prompt cached?" learns what other tenants sent. ``open_queries`` opens them.
- With ``token_all``, every endpoint needs the token, reads included. The dashboard's page
  shell (HTML, script, style) carries no data and stays open; the page asks for the token.
- Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from cmx.api.problems import ApiProblem
from cmx.config import AdminConfig

__all__ = ["bearer", "require_admin", "require_query", "require_read"]

bearer = HTTPBearer(auto_error=False, description="The admin token (CMX_ADMIN_TOKEN).")

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="cmx"'}


def _config(request: Request) -> AdminConfig:
    return request.app.state.admin_config


def _check(config: AdminConfig, creds: HTTPAuthorizationCredentials | None) -> None:
    if config.token is None:
        raise ApiProblem(403, "no admin token is configured on this server (CMX_ADMIN_TOKEN), "
                              "so it refuses every request that needs one")
    if creds is None or creds.scheme.lower() != "bearer":
        raise ApiProblem(401, "this endpoint needs 'Authorization: Bearer <admin token>'",
                         _CHALLENGE)
    if not hmac.compare_digest(creds.credentials.encode(), config.token.encode()):
        raise ApiProblem(401, "the admin token is not valid", _CHALLENGE)


Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def require_read(request: Request, creds: Credentials) -> None:
    config = _config(request)
    if config.token_all:
        _check(config, creds)


def require_admin(request: Request, creds: Credentials) -> None:
    _check(_config(request), creds)


def require_query(request: Request, creds: Credentials) -> None:
    config = _config(request)
    if config.token_all or not config.open_queries:
        _check(config, creds)
