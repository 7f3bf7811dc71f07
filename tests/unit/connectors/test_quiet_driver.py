"""An engine process the connector joined to Ray runs no poller of other workers' errors and
logs: the flag Ray's two driver threads loop on is set and their subscribers closed, so a
thread blocked in a poll that does not return on its own ends. Ray's driver is a stand-in here
(Ray's own ``global_worker``, replaced)."""

from __future__ import annotations

import threading
import time

import pytest
from ray._private import worker as ray_worker

from cmx.connectors.settings import quiet_driver


class _Subscriber:
    """A subscriber whose poll returns only once it is closed."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def poll(self) -> None:
        while not self.closed.is_set():
            time.sleep(0.001)

    def close(self) -> None:
        self.closed.set()


class _Driver:
    def __init__(self) -> None:
        self.threads_stopped = threading.Event()
        self.gcs_error_subscriber = _Subscriber()
        self.gcs_log_subscriber = _Subscriber()

    def poll_until_stopped(self) -> None:
        """What ``listen_error_messages`` does."""
        while not self.threads_stopped.is_set():
            self.gcs_error_subscriber.poll()


def test_the_drivers_pollers_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = _Driver()
    monkeypatch.setattr(ray_worker, "global_worker", driver)
    poller = threading.Thread(target=driver.poll_until_stopped, daemon=True)
    poller.start()
    assert quiet_driver() is True
    poller.join(timeout=10)
    assert not poller.is_alive() and driver.threads_stopped.is_set()
    assert driver.gcs_log_subscriber.closed.is_set()


def test_a_process_with_no_driver_threads_is_left_as_it_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_worker, "global_worker", object())
    assert quiet_driver() is False
