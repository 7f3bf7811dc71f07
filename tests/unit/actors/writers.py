"""What the tests of a client's store share: a link that runs a store's last commit at once,
and a way to act while a client copies a block, right after its first piece landed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from cmx.buffers import Buffer
from cmx.checksum import ChecksumStream
from cmx.links import LocalLink


class StoreLink(LocalLink):
    """LocalLink whose ``submit`` runs the call now and answers its result, as the ref a
    store's last commit is waited on by (``ray.get`` of it is the test's to stand in for)."""

    def submit(self, name: str, method: str, *args: Any) -> Any:
        return self.call(name, method, *args)


def during_copy(monkeypatch: pytest.MonkeyPatch, act: Callable[[], None]) -> Callable[[], bool]:
    """Run ``act`` once while a client copies a block into its slot: after the first piece
    is copied, before it is hashed (``cmx.stores.copy_block`` hashes each piece as it
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
