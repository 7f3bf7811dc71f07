"""Block keys: chained BLAKE2b-256, deterministic on every node and process.

    seed   = BLAKE2b-256(person="cmx-namespace-v1", len-prefixed(model, weights, layout, salt))
    h_0    = BLAKE2b-256(person="cmx-block-v1", seed || tokens_0)
    h_i    = BLAKE2b-256(person="cmx-block-v1", h_{i-1} || tokens_i)

``tokens_i`` is the i-th full block of token ids as little-endian uint32. A key therefore names
the whole prefix up to and including its block. Python's ``hash()`` is never used: it differs
between processes, and a weak hash lets one tenant poison another's prefix cache.

``block_hash`` is the definition, one block at a time; ``chain_keys`` computes the same keys for
a whole sequence at once (each block's tokens cut out in one numpy call, each hash a copy of one
prepared BLAKE2b state), and ``split_keys`` cuts keys sent end to end in one buffer apart again.
"""

from __future__ import annotations

import array
import hashlib
from dataclasses import dataclass
from typing import NewType, cast

import numpy as np

from cmx.errors import InvalidKeyError, LayoutMismatchError
from cmx.layout import KVLayout

__all__ = [
    "KEY_BYTES",
    "BlockHash",
    "Namespace",
    "as_token_array",
    "block_hash",
    "chain_keys",
    "check_key",
    "namespace_id",
    "split_keys",
]

KEY_BYTES = 32
BlockHash = NewType("BlockHash", bytes)

_BLOCK_PERSON = b"cmx-block-v1"
_NS_PERSON = b"cmx-namespace-v1"
# The array type code of a 4-byte unsigned int: a list of token ids becomes an array in one C
# loop that refuses a negative, a too large or a non-integer id, as the checks below do.
_U32 = next(code for code in "IL" if array.array(code).itemsize == 4)


@dataclass(frozen=True)
class Namespace:
    """Who may share a block: same model weights, same layout, same tenant salt."""

    model: str  # model id, e.g. "meta-llama/Meta-Llama-3-8B"
    layout: KVLayout  # geometry of the KV cache
    salt: str = ""  # tenant salt; different salts never share a block
    weights: str = ""  # weights fingerprint (revision or checksum); "" means the model id alone

    @property
    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=_NS_PERSON)
        for field in (self.model.encode(), self.weights.encode(), self.layout.describe(),
                      self.salt.encode()):
            h.update(len(field).to_bytes(8, "little"))
            h.update(field)
        return h.digest()

    @property
    def id(self) -> str:
        """Short printable namespace id (first 8 bytes of the digest, hex)."""
        return self.digest[:8].hex()


NAMESPACE_ID_CHARS = 16  # hex characters of Namespace.id


def namespace_id(namespace: Namespace | str) -> str:
    """The id blocks are tagged with, from a Namespace, its 16-hex id or its 64-hex digest.

    Anything else raises InvalidKeyError: a drop by a malformed id would silently find nothing.
    """
    if isinstance(namespace, Namespace):
        return namespace.id
    if not isinstance(namespace, str):
        raise InvalidKeyError(f"a namespace is a Namespace or a hex id, got "
                              f"{type(namespace).__name__}")
    text = namespace.lower()
    if len(text) not in (NAMESPACE_ID_CHARS, 2 * KEY_BYTES) or not _is_hex(text):
        raise InvalidKeyError(
            f"a namespace id is {NAMESPACE_ID_CHARS} hex digits, or the full digest of "
            f"{2 * KEY_BYTES}; got {len(namespace)} characters")
    return text[:NAMESPACE_ID_CHARS]


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def as_token_array(token_ids: object) -> np.ndarray:
    """Token ids as a 1-D little-endian uint32 array; raise on anything else."""
    if isinstance(token_ids, (list, tuple)) and token_ids and type(token_ids[0]) is not bool:
        try:  # an engine's prompt: ids in [0, 2**32) pass in one C loop
            ids = np.frombuffer(array.array(_U32, token_ids), dtype=np.uint32)
            return ids.astype("<u4", copy=False)
        except (TypeError, OverflowError):
            pass  # the checks below say what is wrong
    if hasattr(token_ids, "detach"):  # torch tensor
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise LayoutMismatchError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise LayoutMismatchError(f"token ids must be integers, got {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise LayoutMismatchError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False)


def block_hash(parent: bytes, tokens: np.ndarray) -> BlockHash:
    """Key of a block from its parent's key (or the namespace seed) and its token ids."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=_BLOCK_PERSON)
    h.update(np.ascontiguousarray(tokens, dtype="<u4").tobytes())
    return BlockHash(h.digest())


def chain_keys(seed: bytes, token_ids: object, block_tokens: int) -> list[BlockHash]:
    """Keys of every full block of ``token_ids``; a partial tail block has no key.

    The keys of ``block_hash`` chained from ``seed``, byte for byte (keys are on disk): each
    block's tokens are cut out as bytes in one numpy call, and each hash is a copy of one
    state made with the block person, fed its parent and its tokens at once."""
    tokens = np.ascontiguousarray(as_token_array(token_ids))
    full = len(tokens) // block_tokens * block_tokens
    blocks: list[bytes] = tokens[:full].view(f"V{4 * block_tokens}").tolist()
    copy = hashlib.blake2b(digest_size=KEY_BYTES, person=_BLOCK_PERSON).copy
    keys: list[bytes] = []
    append = keys.append
    parent = seed
    for block in blocks:
        h = copy()
        h.update(parent + block)
        parent = h.digest()
        append(parent)
    return cast("list[BlockHash]", keys)


def split_keys(keys: bytes) -> list[BlockHash]:
    """The keys of ``keys``, ``KEY_BYTES`` each end to end (as ``b"".join`` of them sends
    them: one object through a link, not one a key)."""
    if len(keys) % KEY_BYTES:
        raise InvalidKeyError(f"keys end to end are a multiple of {KEY_BYTES} bytes, got "
                              f"{len(keys)}")
    # numpy's void items come back as bytes, every byte kept (an "S" item drops trailing zeros)
    return cast("list[BlockHash]", np.frombuffer(keys, f"V{KEY_BYTES}").tolist())


def check_key(key: object) -> BlockHash:
    """``key`` as a BlockHash; InvalidKeyError unless it is exactly KEY_BYTES bytes."""
    if isinstance(key, (bytearray, memoryview)):
        key = bytes(key)
    if not isinstance(key, bytes):
        raise InvalidKeyError(f"a block key is {KEY_BYTES} bytes, got {type(key).__name__}")
    if len(key) != KEY_BYTES:
        raise InvalidKeyError(f"a block key is {KEY_BYTES} bytes, got {len(key)}")
    return BlockHash(key)
