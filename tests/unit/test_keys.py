"""Namespace ids as callers give them: a Namespace, its 16-hex id or its 64-hex digest; block keys
chained in bulk exactly as ``block_hash`` defines them, one block at a time."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from cmx.errors import InvalidKeyError, LayoutMismatchError
from cmx.keys import (
    Namespace,
    as_token_array,
    block_hash,
    chain_keys,
    namespace_id,
    split_keys,
)
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


# -- chain_keys: the keys of block_hash, byte for byte (they are on disk) ----------------------


def reference_chain(seed: bytes, tokens: Any, block_tokens: int) -> list[bytes]:
    """``block_hash`` block after block, as the module's docstring defines the keys."""
    arr = np.asarray(tokens, dtype=np.int64).astype("<u4")
    keys, parent = [], seed
    for i in range(len(arr) // block_tokens):
        parent = block_hash(parent, arr[i * block_tokens : (i + 1) * block_tokens])
        keys.append(parent)
    return keys


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 16 * 7 + 5, 16 * 64])
@pytest.mark.parametrize("form", ["numpy", "list", "tuple", "torch"])
def test_chain_keys_are_the_chained_block_hashes_for_every_form_of_token_ids(
        n: int, form: str) -> None:
    tokens = np.random.default_rng(n).integers(0, 1 << 32, n, dtype=np.int64)
    given: Any = {"numpy": tokens, "list": tokens.tolist(), "tuple": tuple(tokens.tolist()),
                  "torch": torch.from_numpy(tokens)}[form]
    assert chain_keys(NS.digest, given, 16) == reference_chain(NS.digest, tokens, 16)
    assert len(chain_keys(NS.digest, given, 16)) == n // 16  # a partial tail has no key


def test_chain_keys_of_a_strided_view_are_those_of_its_tokens() -> None:
    tokens = np.random.default_rng(3).integers(0, 50_000, 64, dtype=np.int64)
    assert chain_keys(NS.digest, tokens[::2], 4) == reference_chain(NS.digest, tokens[::2], 4)


def test_the_keys_on_disk_stay_what_they_were() -> None:
    keys = chain_keys(bytes(range(32)), [0, 1, 2, 3, 2**32 - 1, 65536, 7, 8, 9], 4)
    assert [k.hex() for k in keys] == [
        "4647abdde0d871efde4d8b79f06dbe221455375d159f4cf75380ca7cba7e2062",
        "54f8fd5402d9208ef10b5b8ccac520d18a8ea01d525e846deaaa7f20fb966c04"]


@pytest.mark.parametrize("bad", [[1, -1], [1, 2**32], (1, 2.0), [[1, 2]], [True, False],
                                 ["1"]])
def test_token_ids_in_a_list_are_checked_as_an_array_is(bad: Any) -> None:
    with pytest.raises(LayoutMismatchError):
        as_token_array(bad)


def test_token_ids_of_a_list_are_little_endian_uint32() -> None:
    got = as_token_array([0, 5, 2**32 - 1])
    assert got.dtype == np.dtype("<u4") and got.tolist() == [0, 5, 2**32 - 1]
    assert as_token_array([]).tolist() == []


def test_keys_end_to_end_are_cut_apart_again() -> None:
    keys = chain_keys(NS.digest, list(range(40)), 4)
    assert split_keys(b"".join(keys)) == keys
    assert split_keys(b"") == []
    with pytest.raises(InvalidKeyError):
        split_keys(b"".join(keys)[:-1])
