"""Every typed request (``cmx.doors``) fits the methods it calls: each class it names as
``served_by`` has its ``method``, and that method takes the request's fields as keyword
arguments and needs no other. A renamed parameter or a new required one fails here, not at
a call in a running cluster."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

import pytest

import cmx.doors
from cmx.doors import Request


def _requests() -> list[type[Request[Any]]]:
    return [getattr(cmx.doors, n) for n in cmx.doors.__all__
            if n not in ("Pending", "Request")]


def _served_by(name: str) -> type:
    module, _, cls = name.rpartition(".")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


@pytest.mark.parametrize("request_type", _requests(), ids=lambda r: r.__name__)
def test_a_request_fits_each_method_it_calls(request_type: type[Request[Any]]) -> None:
    assert dataclasses.is_dataclass(request_type)
    assert request_type.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert request_type.served_by, f"{request_type.__name__} names no class that serves it"
    fields = [f.name for f in dataclasses.fields(request_type)]
    for server in request_type.served_by:
        method = getattr(_served_by(server), request_type.method, None)
        assert callable(method), f"{server} has no method {request_type.method}"
        params = inspect.signature(method).parameters
        unknown = [f for f in fields if f not in params]
        assert not unknown, f"{server}.{request_type.method} takes no {unknown}"
        required = [p.name for p in params.values() if p.name != "self"
                    and p.default is inspect.Parameter.empty
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        missing = [p for p in required if p not in fields]
        assert not missing, f"{request_type.__name__} lacks {missing} of {server}"


def test_a_request_is_sent_as_the_keyword_arguments_it_was_made_with() -> None:
    request = cmx.doors.Pin(keys=[b"k"], owner="me")
    assert request.method == "pin"
    assert request.kwargs() == {"keys": [b"k"], "owner": "me"}


def test_every_request_type_has_a_name_of_its_own() -> None:
    names = [r.__name__ for r in _requests()]
    assert len(names) == len(set(names))


def test_no_link_call_names_its_method_by_a_string() -> None:
    """The links take requests only: a call by string fails at once, before any actor."""
    from cmx.links import LocalLink

    link = LocalLink({"a": object()})
    with pytest.raises(AttributeError):
        link.call("a", "pin")  # type: ignore[arg-type]
