"""Rendezvous (highest-random-weight) hashing: which pool nodes own a block.

Every node scores every (key, member) pair with BLAKE2b-64 and the ``replicas`` highest scores
own the block. A member that joins takes only the blocks it now wins; one that leaves gives up
only its own: no other block moves. Deterministic on every node and process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["owners", "score"]


def score(key: bytes, member: str) -> int:
    h = hashlib.blake2b(key, digest_size=8, person=b"cmx-rendezvous")
    h.update(member.encode())
    return int.from_bytes(h.digest(), "little")


def owners(key: bytes, members: Iterable[str], replicas: int) -> list[str]:
    """The ``replicas`` members that own ``key``, best first (fewer if fewer members)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    ranked = sorted(members, key=lambda m: score(key, m), reverse=True)
    return ranked[:replicas]
