"""A local pin whose answer is lost: the DRAM tier pinned the blocks (or pins them after the
release the reader sent behind it, as a threaded Ray actor may), the reader stopped waiting;
the load still returns the stored bytes and the tier holds nothing for it after."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import TypeVar

import pytest
import torch
from plane import Plane, make_plane, namespace_client
from scenarios import LAYOUT, check, held, small_config

from cmx.doors import Pin, PinColumns, ReleaseOwner, Request
from cmx.errors import UnavailableError
from cmx.links import LocalLink
from cmx.tiers import Tier

R = TypeVar("R")
NODE = f"pinlate-{uuid.uuid4().hex[:6]}"  # arenas named apart from other suites' on this host
T = LAYOUT.block_tokens


class LateLink(LocalLink):
    """While ``late``, a reader's pin in DRAM runs but its answer comes after the bound."""

    late = False

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        answer = super().call(name, request)
        if self.late and isinstance(request, (Pin, PinColumns)) and name == f"cmx:dram:{NODE}" \
                and str(request.owner).startswith("client:"):
            raise UnavailableError(f"{name}.{request.method} did not answer: Get timed out")
        return answer


class ReorderedLink(LocalLink):
    """While ``late``, a reader's pin in DRAM times out before it runs, and runs only after
    the ``release_owner`` the reader sends behind it: the order a threaded actor may take."""

    late = False

    def __init__(self, targets: dict[str, object]) -> None:
        super().__init__(targets)
        self.held_back: list[tuple[str, Pin | PinColumns]] = []

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        if self.late and isinstance(request, (Pin, PinColumns)) and name == f"cmx:dram:{NODE}" \
                and str(request.owner).startswith("client:"):
            self.held_back.append((name, request))
            raise UnavailableError(f"{name}.{request.method} did not answer: Get timed out")
        return super().call(name, request)

    def tell(self, name: str, request: Request[object]) -> None:
        super().tell(name, request)
        if isinstance(request, ReleaseOwner):
            late = [(n, r) for n, r in self.held_back if r.owner == request.owner]
            for held_name, pin in late:
                self.held_back.remove((held_name, pin))
                super().call(held_name, pin)


@pytest.fixture(params=[LateLink, ReorderedLink], ids=["pin-then-release", "release-then-pin"])
def plane(tmp_path, request) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path), nodes=(NODE,), link_type=request.param)
    yield p
    p.close()


def test_a_late_local_pin_leaves_no_pin_behind(plane: Plane) -> None:
    ns = namespace_client(plane, NODE, LAYOUT, "t")
    tokens = list(range(3 * T))
    kv = LAYOUT.random_kv(3 * T, seed=1)
    assert ns.store(tokens, kv).wait() == 3
    assert held(plane, NODE, Tier.DRAM) == (0, 0)

    plane.link.late = True  # type: ignore[attr-defined]
    out = ns.load(tokens)
    plane.link.late = False  # type: ignore[attr-defined]

    assert out.shape[3] == 3 * T and torch.equal(out, kv)
    assert not getattr(plane.link, "held_back", [])  # each late pin ran, after its release
    for tier in (Tier.DRAM, Tier.HBM):
        assert held(plane, NODE, tier) == (0, 0), tier
    assert plane.tiers[(NODE, Tier.DRAM)].leases.stats().released >= 3
    check(plane)
