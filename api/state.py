"""What one admin API server holds: its backend, its sampler, and the background sampling loop.

The backend is made on first use, so the server starts (and answers health checks) before the
service is reachable. The loop samples the service every ``sample_s`` seconds: the dashboard's
history and the Ray metrics need samples even when nobody is looking.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from cmx.api.backend import Backend
from cmx.api.figures import figures
from cmx.api.models import TiersView
from cmx.api.stats_samples import Sample, StatsSampler
from cmx.api.views import pool_view, tiers_view
from cmx.config import AdminConfig
from cmx.errors import UnavailableError

if TYPE_CHECKING:
    from cmx.api.ray_metrics import RayMetricsMirror

__all__ = ["ApiState"]

log = logging.getLogger(__name__)


class ApiState:
    def __init__(
        self, make_backend: Callable[[], Backend], config: AdminConfig,
        mirror: RayMetricsMirror | None = None,
    ) -> None:
        self.config = config
        self._make_backend = make_backend
        self._backend: Backend | None = None
        self._lock = threading.Lock()
        self.sampler = StatsSampler(lambda: self.backend.stats(), config.history_s)
        self.mirror = mirror
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def backend(self) -> Backend:
        with self._lock:
            if self._backend is None:
                try:
                    self._backend = self._make_backend()
                except Exception as exc:  # noqa: BLE001 - any failure to connect is a 503
                    raise UnavailableError(f"cannot reach the service: {exc}") from exc
            return self._backend

    def view(self) -> tuple[Sample, TiersView]:
        """A sample at most ``sample_s`` old, and its view (bandwidth from the one before)."""
        latest = self.sampler.fresh(self.config.sample_s)
        return latest, tiers_view(latest, self.sampler.previous(latest))

    # -- background sampling -------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="cmx-api-sampler",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                latest = self.sampler.sample()
                if self.mirror is not None:
                    view = tiers_view(latest, self.sampler.previous(latest))
                    pool = pool_view(latest.stats.pool)
                    self.mirror.update(figures(view, pool))
            except Exception:  # noqa: BLE001 - the next round tries again
                log.debug("sampling the service failed", exc_info=True)
            self._stop.wait(self.config.sample_s)
