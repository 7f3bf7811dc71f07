"""A replica's link to the context memory service: started or joined, its slots checked.

A replica never assumes the service: it starts the service's actors where none run (the same
call every client makes, idempotent), within ``ServeOptions.service_wait_s``. Slots must hold
one block of the served model: a service this application starts gets slots of exactly that
size (unless ``CMX_BLOCK_BYTES`` or ``ServeOptions.service`` says otherwise); a running one
with smaller slots makes the replica fail at startup, saying which number to set.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cmx.config import ServiceConfig
from cmx.deploy.config import ServeOptions
from cmx.deploy.model import ModelInfo
from cmx.errors import CmxError

__all__ = ["MemoryLink", "RefPrefetch", "check_slots", "join_service", "service_config"]


def service_config(options: ServeOptions, model: ModelInfo) -> ServiceConfig:
    """The config to start the service with: slots of one model block unless set explicitly."""
    if options.service is not None:
        return options.service
    config = ServiceConfig.from_env()
    if "CMX_BLOCK_BYTES" not in os.environ:
        config = config.replace(block_bytes=model.layout.block_bytes)
    return config


def check_slots(slot_bytes: int, model: ModelInfo) -> None:
    """Raise, with the numbers to set, if a slot cannot hold one of the model's blocks."""
    layout = model.layout
    if slot_bytes >= layout.block_bytes:
        return
    fits = slot_bytes // layout.token_bytes // 32 * 32  # vLLM's CPU blocks: multiples of 32
    raise CmxError(
        f"the context memory's slots hold {slot_bytes} bytes, a block of {model.name} "
        f"({layout.block_tokens} tokens of {layout.token_bytes} bytes, {layout.dtype}) is "
        f"{layout.block_bytes}: start the service with CMX_BLOCK_BYTES={layout.block_bytes} "
        f"(ServiceConfig.block_bytes)"
        + (f" or serve with engine.block_size <= {fits}" if fits else ""))


@dataclass
class MemoryLink:
    """The replica's ``ContextMemory`` and what the connector needs to reach the same service."""

    cm: Any
    model: ModelInfo
    config: ServiceConfig
    ray_address: str

    def prefetch(self, salt: str, token_ids: Sequence[int]) -> RefPrefetch | None:
        """Start moving the cached prefix of ``token_ids`` (tenant ``salt``) to this node."""
        m = self.model
        ns = self.cm.namespace(m.name, m.layout, salt, m.weights)
        started = time.monotonic()
        ref = ns.prefetch(list(token_ids))
        return None if ref is None else RefPrefetch(ref, started)


def join_service(options: ServeOptions, model: ModelInfo) -> MemoryLink:
    """Start or join the service (bounded), check its slots; raises ``CmxError`` if unusable."""
    import ray

    from cmx.client import ContextMemory
    from cmx.doors import ArenaInfoOf
    from cmx.links import actor_name

    config = service_config(options, model)
    deadline = time.monotonic() + options.service_wait_s
    while True:
        try:
            cm = ContextMemory.connect(config=config, start_service=True)
            info = cm.link.call(actor_name("dram", cm.node_id), ArenaInfoOf())
            break
        except Exception as exc:  # noqa: BLE001 - retried until the bound, then said
            if time.monotonic() > deadline:
                raise CmxError(f"the context memory service did not answer within "
                               f"{options.service_wait_s:.0f} s: {exc}") from exc
            time.sleep(2.0)
    check_slots(int(info.slot_bytes), model)
    config = config.replace(block_bytes=int(info.slot_bytes))
    address = ray.get_runtime_context().gcs_address
    return MemoryLink(cm, model, config, address)


class RefPrefetch:
    """A prefetch in flight: the agent call's ObjectRef (``PendingPrefetch`` for the policies)."""

    def __init__(self, ref: Any, started_s: float) -> None:
        self.ref = ref
        self.started_s = started_s  # time.monotonic() when it was asked for

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def wait(self, timeout_s: float) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=max(0.0, timeout_s))
        return bool(ready)
