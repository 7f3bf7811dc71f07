"""Which tenant a request belongs to: the namespace salt from its API key and ``cache_salt``.

Requests with different salts never share a block (the salt seeds every block key), so a tenant
cannot see, through cached-token figures or time to first token, what another has sent. The salt
is derived, never stored or returned: BLAKE2b-128 over the deployment's salt, the bearer API key
and the request's ``cache_salt`` (vLLM's convention), each length-prefixed so that no two
different triples give the same input. No key and no ``cache_salt``: the deployment's salt.
"""

from __future__ import annotations

import hashlib

__all__ = ["bearer_key", "tenant_salt"]


def bearer_key(authorization: str | None) -> str | None:
    """The API key of an ``Authorization: Bearer <key>`` header, else None."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def tenant_salt(base: str, api_key: str | None, cache_salt: str | None) -> str:
    """The namespace salt of a request (hex); ``base`` alone when neither key nor salt is set."""
    if not api_key and not cache_salt:
        return base
    h = hashlib.blake2b(digest_size=16, person=b"cmx-tenant-v1")
    for part in (base, api_key or "", cache_salt or ""):
        raw = part.encode("utf-8")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()
