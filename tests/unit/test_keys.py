"""Namespace ids as callers give them: a Namespace, its 16-hex id or its 64-hex digest."""

from __future__ import annotations

import pytest

from cmx.errors import InvalidKeyError
from cmx.keys import Namespace, namespace_id
from cmx.layout import KVLayout

NS = Namespace("m", KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4), "t")


def test_every_documented_form_names_the_id_blocks_are_tagged_with() -> None:
    assert len(NS.id) == 16
    assert namespace_id(NS) == NS.id
    assert namespace_id(NS.id) == NS.id
    assert namespace_id(NS.id.upper()) == NS.id
    assert namespace_id(NS.digest.hex()) == NS.id
    assert namespace_id(NS.digest.hex().upper()) == NS.id


@pytest.mark.parametrize("bad", ["", NS.id[:-1], NS.id + "0", NS.digest.hex()[:-1],
                                 "g" * 16, " " + NS.id, NS.id + "\n", "0x" + NS.id[:14]])
def test_anything_else_is_refused_rather_than_matching_nothing(bad: str) -> None:
    with pytest.raises(InvalidKeyError, match="namespace id"):
        namespace_id(bad)


def test_a_non_string_is_refused() -> None:
    with pytest.raises(InvalidKeyError):
        namespace_id(NS.digest)  # type: ignore[arg-type]
