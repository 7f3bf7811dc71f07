"""What the tests of a client's store share: a link that runs a store's last commit at once,
and an engine's KV that lets a test act right after the first copy of a block."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cmx.links import LocalLink


class StoreLink(LocalLink):
    """LocalLink whose ``submit`` runs the call now and answers its result, as the ref a
    store's last commit is waited on by (``ray.get`` of it is the test's to stand in for)."""

    def submit(self, name: str, method: str, *args: Any) -> Any:
        return self.call(name, method, *args)


class LateWrite(torch.Tensor):
    """An engine's KV whose first copy is followed at once by ``late``: another writer's late
    copy landing on the slot just written, or a tier restarting under the store."""

    late: Callable[[], None] | None = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.Tensor.copy_ and LateWrite.late is not None:
            late, LateWrite.late = LateWrite.late, None
            late()
        return out
