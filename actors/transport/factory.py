"""The transport an agent or a pool node uses: NIXL over UCX where it loads, else the Ray
fallback. This module knows both; neither knows the other."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cmx.actors.transport.base import RayTransport, Transport

__all__ = ["make_transport"]


def make_transport(
    agent: str,
    prefer: str,
    fetch: Callable[[str, list[tuple[str, int]]], list[np.ndarray]],
) -> Transport:
    """NIXL where it loads (unless ``prefer == "ray"``), else the Ray fallback."""
    reason = None
    if prefer != "ray":
        try:
            from cmx.actors.transport.nixl_ucx import NixlTransport

            return NixlTransport(agent)
        except Exception as exc:  # noqa: BLE001 - any load failure means falling back
            if prefer == "nixl":
                raise
            reason = f"NIXL did not start: {exc}"
    return RayTransport(agent, fetch, reason)
