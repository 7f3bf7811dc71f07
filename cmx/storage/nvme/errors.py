"""Typed errors of the NVMe store: its files failed, or its directory cannot be trusted."""

from __future__ import annotations

from cmx.errors import CmxError

__all__ = ["StoreDirectoryError", "StoreIOError"]


class StoreIOError(CmxError, OSError):
    """A write, read or sync of the store's files failed (``errno`` says why: ENOSPC, EIO...).

    The call that raises it changed nothing that was acknowledged before: the blocks of every
    earlier ``flush()`` stay durable. An OSError, so ``except OSError`` still catches it.
    """


class StoreDirectoryError(CmxError, PermissionError):
    """The store's directory is not safe to use: a symlink, not a directory, or owned by
    another user. Nothing is read from or written to it."""
