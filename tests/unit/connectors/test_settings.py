"""The connector's settings as vLLM hands them over: a JSON dict of plain values, typed here."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cmx.connectors.settings import ConnectorSettings, LoadMode, SaveMode, SettingError


def test_the_fast_paths_are_the_defaults() -> None:
    settings = ConnectorSettings.from_extra({})
    assert settings.load_mode is LoadMode.ASYNC and settings.save_mode is SaveMode.ASYNC
    assert settings.async_loads and settings.async_saves and settings.prefetch


def test_the_sync_modes_are_there_when_told() -> None:
    settings = ConnectorSettings.from_extra({"load_mode": "sync", "save_mode": "sync"})
    assert settings.load_mode is LoadMode.SYNC and settings.save_mode is SaveMode.SYNC
    assert not settings.async_loads and not settings.async_saves


def test_the_modes_come_as_strings_from_the_engines_json_and_become_members() -> None:
    extra = json.loads('{"load_mode": "async", "save_mode": "async"}')
    settings = ConnectorSettings.from_extra(extra)
    assert settings.load_mode is LoadMode.ASYNC and settings.save_mode is SaveMode.ASYNC
    assert settings.async_loads and settings.async_saves
    # A copy keeps its members, and a member is also accepted as given.
    assert dataclasses.replace(settings).load_mode is LoadMode.ASYNC
    assert ConnectorSettings(save_mode=SaveMode.ASYNC).async_saves


@pytest.mark.parametrize("field,value", [("load_mode", "asynch"), ("save_mode", "ASYNC"),
                                         ("load_mode", "")])
def test_a_mode_it_does_not_know_is_refused_naming_the_choices(field: str, value: str) -> None:
    with pytest.raises(SettingError, match=f"{field} is one of 'sync', 'async', not {value!r}"):
        ConnectorSettings.from_extra({field: value})
