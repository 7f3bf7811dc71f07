"""What the tests of a client's store share: the link they run over, and a way to act while
a client copies a block, right after its first piece landed."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cmx.buffers import Buffer
from cmx.checksum import ChecksumStream
from cmx.links import LocalLink


class StoreLink(LocalLink):
    """The in-process link a client's store runs over: its ``submit`` runs a commit at once
    and ``result`` hands its answer over, as ``ray.get`` does."""


def during_copy(monkeypatch: pytest.MonkeyPatch, act: Callable[[], None]) -> Callable[[], bool]:
    """Run ``act`` once while a client copies a block into its slot: after the first piece
    is copied, before it is hashed (``cmx.client.stores.copy_block`` hashes each piece as it
    lands). Returns whether it ran."""
    ran: list[bool] = []
    feed = ChecksumStream.feed

    def feed_after(self: ChecksumStream, data: Buffer) -> None:
        if not ran:
            ran.append(True)
            act()
        feed(self, data)

    monkeypatch.setattr(ChecksumStream, "feed", feed_after)
    return lambda: bool(ran)
