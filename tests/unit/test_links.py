"""RayLink forgets the handle of an actor that failed a call, and only that one, whatever
another thread did to its handles meanwhile; stop_service stops what the controller started
while it was being stopped. Ray's calls are stand-ins here: no cluster."""

from __future__ import annotations

from typing import Any

import pytest
import ray
from ray.exceptions import RayActorError

from cmx.actors import stop
from cmx.links import RayLink


class _Id:
    def __init__(self, hex_id: str) -> None:
        self._hex = hex_id

    def hex(self) -> str:
        return self._hex


class _Handle:
    def __init__(self, hex_id: str) -> None:
        self._actor_id = _Id(hex_id)


class _DroppedMeanwhile:
    """A handle another thread drops from the link while ``_forget`` reads it."""

    def __init__(self, link: RayLink, name: str, hex_id: str) -> None:
        self.link, self.name, self.hex_id = link, name, hex_id

    @property
    def _actor_id(self) -> _Id:
        self.link._handles.pop(self.name, None)
        return _Id(self.hex_id)


def test_the_failed_actors_handle_goes_and_the_others_stay() -> None:
    link = RayLink()
    link._handles = {"cmx:dir:0": _Handle("ab"), "cmx:dir:1": _Handle("cd")}
    link._forget(RayActorError(actor_id="ab"))
    assert list(link._handles) == ["cmx:dir:1"]
    link._forget(RayActorError())  # a failure naming no actor: nothing to forget
    assert list(link._handles) == ["cmx:dir:1"]


def test_a_handle_dropped_by_another_thread_meanwhile_is_no_key_error() -> None:
    link = RayLink()
    link._handles = {"cmx:dir:0": _DroppedMeanwhile(link, "cmx:dir:0", "ab")}
    link._forget(RayActorError(actor_id="ab"))
    assert link._handles == {}


def test_a_handle_without_rays_actor_id_is_looked_up_again_not_an_attribute_error() -> None:
    link = RayLink()
    link._handles = {"cmx:agent:a": object(), "cmx:dir:1": _Handle("cd")}
    link._forget(RayActorError(actor_id="ab"))
    assert list(link._handles) == ["cmx:dir:1"]


def test_what_the_controller_starts_while_it_is_stopped_is_stopped_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    running: dict[str, Any] = {"cmx:controller": object(), "cmx:hbm:a": object()}
    killed: list[str] = []

    def get_actor(name: str, namespace: str = "") -> Any:
        if name not in running:
            raise ValueError(f"no actor {name}")
        return running[name]

    def kill(handle: Any, no_restart: bool = True) -> None:
        name = next(n for n, h in running.items() if h is handle)
        killed.append(name)
        del running[name]
        if name == "cmx:controller":  # its last round started a lost shard as it died
            running["cmx:dir:0"] = object()

    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(ray, "kill", kill)
    monkeypatch.setattr(ray.util, "list_named_actors", lambda all_namespaces=False: [
        {"name": n, "namespace": "cmx"} for n in running])
    monkeypatch.setattr(stop, "_closable", set)  # stand-ins have no close to call
    assert stop.stop_service(timeout_s=1.0) == 3
    assert killed[0] == "cmx:controller" and sorted(killed[1:]) == ["cmx:dir:0", "cmx:hbm:a"]
    assert running == {}
