"""What the tests of a client's store share: the link they run over, and a way to act while
a client copies a block, right after its first piece landed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from cmx.buffers import Buffer
from cmx.checksum import ChecksumStream
from cmx.client import stores
from cmx.links import LocalLink


class StoreLink(LocalLink):
    """The in-process link a client's store runs over: its ``submit`` runs a commit at once
    and ``result`` hands its answer over, as ``ray.get`` does."""


def during_copy(monkeypatch: pytest.MonkeyPatch, act: Callable[[], None],
                before_write: bool = False) -> Callable[[], bool]:
    """Run ``act`` once while a client copies a block into its slot: after the first piece
    is copied, before it is hashed (``cmx.client.stores.copy_block`` hashes each piece as it
    lands); or, where blocks go a run at a time (hashed as they are gathered), once the run
    has landed in its slots (``before_write``: once it is gathered and hashed, before it is
    written to them). Returns whether it ran."""
    ran: list[bool] = []
    feed = ChecksumStream.feed
    write_run = stores._write_run

    def once() -> None:
        if not ran:
            ran.append(True)
            act()

    def feed_after(self: ChecksumStream, data: Buffer) -> None:
        once()
        feed(self, data)

    def write_run_then(arena: Any, slots: list[int], rows: np.ndarray) -> None:
        if before_write:
            once()
        write_run(arena, slots, rows)
        once()

    monkeypatch.setattr(ChecksumStream, "feed", feed_after)
    monkeypatch.setattr(stores, "_write_run", write_run_then)
    return lambda: bool(ran)
