"""Typed errors. Bad input raises one of these and changes nothing."""

from __future__ import annotations

__all__ = [
    "CmxError",
    "LayoutMismatchError",
    "InvalidKeyError",
    "BlockTooLargeError",
    "StoreFullError",
    "StoreClosedError",
    "StoreLockedError",
    "BlockStateError",
    "UnavailableError",
]


class CmxError(Exception):
    """Base of every error this package raises on purpose."""


class LayoutMismatchError(CmxError, ValueError):
    """A tensor or buffer does not match the KVLayout it is used with (dtype, shape or size)."""


class InvalidKeyError(CmxError, ValueError):
    """A block key of the wrong type or length."""


class BlockTooLargeError(CmxError, ValueError):
    """A block larger than the store's block size or its whole capacity."""


class StoreFullError(CmxError):
    """No space can be made: every resident block is pinned or uncommitted."""


class StoreClosedError(CmxError):
    """The store was closed."""


class BlockStateError(CmxError):
    """A two-phase call out of order: commit without reserve, unpin without pin, and the like."""


class UnavailableError(CmxError):
    """A part of the service did not answer within its bound; callers treat it as a miss."""


class StoreLockedError(CmxError):
    """The store's directory is already open in another store object or process."""
