"""Which tenant a request belongs to, and its namespace salt.

Requests with different salts never share a block (the salt seeds every block key), so a tenant
cannot see, through cached-token figures or time to first token, what another has sent. The salt
is derived, never stored or returned: BLAKE2b-128 over the deployment's salt, who the tenant is
and the request's ``cache_salt`` (vLLM's convention), each length-prefixed so that no two
different triples give the same input.

Who the tenant is depends on ``Tenancy``:

- with a key file (``apikeys``), the key file's tenant of the bearer key; an unknown key, and a
  missing one unless ``anonymous`` is set, raise ``UnknownKeyError`` (a 401 at the ingress).
  All keys of one tenant share its salt; two tenants never do.
- without one, every request is served and the bearer key itself names the tenant.
- no key (where served): the anonymous tenant, whose salt is the deployment's own.
- an ``Authorization`` header that is not ``Bearer <key>`` (another scheme, a bare ``Bearer``, a
  tab for the space) is refused in every mode, never served as the anonymous tenant: a caller
  who sent a key meant to be someone.
"""

from __future__ import annotations

import enum
import hashlib
import re
from dataclasses import dataclass, field

from cmx.deploy.apikeys import KeyFile
from cmx.deploy.config import TenantOptions
from cmx.errors import CmxError

__all__ = ["ANONYMOUS", "Tenancy", "Tenant", "TenantKind", "UnknownKeyError", "bearer_key",
           "named_salt", "tenant_salt"]


class UnknownKeyError(CmxError):
    """A request without a key the key file holds, where one is required."""


class TenantKind(enum.Enum):
    NAMED = "named"  # a tenant of the key file
    KEY = "key"  # no key file: the bearer key is the tenant
    ANONYMOUS = "anonymous"  # no key: the deployment's salt


@dataclass(frozen=True)
class Tenant:
    kind: TenantKind
    id: str = field(default="", repr=False)  # NAMED: the tenant's name; KEY: the key; else ""


ANONYMOUS = Tenant(TenantKind.ANONYMOUS)


# The scheme (any case), one or more spaces (RFC 7235: not a tab), one key of visible ASCII.
_BEARER = re.compile(r"bearer +([!-~]+)", re.IGNORECASE)


def bearer_key(authorization: str | None) -> str | None:
    """The API key of an ``Authorization: Bearer <key>`` header; None without a header (or an
    empty one); ``UnknownKeyError`` for any other header."""
    if authorization is None or not authorization.strip(" "):
        return None
    match = _BEARER.fullmatch(authorization.strip(" "))
    if match is None:
        raise UnknownKeyError("the Authorization header is malformed: send 'Authorization: "
                              "Bearer <API key>'")
    return match.group(1)


def _derive(person: bytes, base: str, who: str, cache_salt: str) -> str:
    h = hashlib.blake2b(digest_size=16, person=person)
    for part in (base, who, cache_salt):
        raw = part.encode("utf-8")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()


def tenant_salt(base: str, api_key: str | None, cache_salt: str | None) -> str:
    """The namespace salt of a request without a key file (hex); ``base`` alone when neither key
    nor salt is set."""
    if not api_key and not cache_salt:
        return base
    return _derive(b"cmx-tenant-v1", base, api_key or "", cache_salt or "")


def named_salt(base: str, tenant: str, cache_salt: str | None) -> str:
    """The namespace salt of a key file's tenant (hex); a personalization of its own, so that
    no bearer key served without a key file gives the same salt."""
    return _derive(b"cmx-named-v1", base, tenant, cache_salt or "")


@dataclass(frozen=True)
class Tenancy:
    """Who a request is from (``who``) and its salt (``salt``), for one deployment."""

    base: str  # the deployment's salt
    keys: KeyFile | None = None  # None: no key is checked; each bearer key is its own tenant
    anonymous: bool = False  # with keys: a request without a key is the anonymous tenant

    @classmethod
    def load(cls, base: str, options: TenantOptions) -> Tenancy:
        """The deployment's tenancy; ``KeyFileError`` if its key file cannot be used."""
        keys = KeyFile.load(options.keys_file) if options.keys_file else None
        return cls(base, keys, options.anonymous)

    def who(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization`` header; ``UnknownKeyError`` if it is refused (a
        malformed header is, in every mode)."""
        key = bearer_key(authorization)
        if self.keys is None:
            return Tenant(TenantKind.KEY, key) if key else ANONYMOUS
        if key is None:
            if self.anonymous:
                return ANONYMOUS
            raise UnknownKeyError("this server needs an API key: send 'Authorization: Bearer "
                                  "<key>'")
        name = self.keys.tenant(key)
        if name is None:
            raise UnknownKeyError("the API key is not valid on this server")
        return Tenant(TenantKind.NAMED, name)

    def salt(self, tenant: Tenant, cache_salt: str | None) -> str:
        if tenant.kind is TenantKind.NAMED:
            return named_salt(self.base, tenant.id, cache_salt)
        return tenant_salt(self.base, tenant.id or None, cache_salt)
