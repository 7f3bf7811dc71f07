"""The block copy (exact bytes whether it runs on one thread or is split over several) and
the checksum of a block that arrives in pieces."""

from __future__ import annotations

import numpy as np
import pytest

from cmx.buffers import PARALLEL_MIN_BYTES, aligned_empty, copy_bytes
from cmx.checksum import ChecksumStream, checksum


@pytest.mark.parametrize("nbytes", [0, 1, 4097, PARALLEL_MIN_BYTES - 1, PARALLEL_MIN_BYTES,
                                    PARALLEL_MIN_BYTES + (1 << 20) + 123, 64 << 20])
def test_copy_bytes_copies_every_byte(nbytes):
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = aligned_empty(nbytes + 2)
    dst[:] = 7
    copy_bytes(dst[1:-1], src)
    np.testing.assert_array_equal(dst[1:-1], src)
    assert dst[0] == 7 and dst[-1] == 7  # nothing written outside the destination


def test_copy_bytes_refuses_sizes_that_differ():
    dst = np.zeros(PARALLEL_MIN_BYTES, np.uint8)
    with pytest.raises(ValueError, match="into"):
        copy_bytes(dst, np.ones(PARALLEL_MIN_BYTES + 1, np.uint8))
    assert not dst.any()


def test_a_checksum_fed_in_pieces_equals_the_checksum_of_the_whole():
    data = np.random.default_rng(3).integers(0, 256, 5 * 4096 + 17, dtype=np.uint8)
    stream = ChecksumStream()
    for start in range(0, data.nbytes, 4096):
        stream.feed(data[start:start + 4096])
    assert stream.value() == checksum(data)
    data[-1] ^= 1
    assert stream.value() != checksum(data)
