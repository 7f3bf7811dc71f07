"""The block copy: exact bytes whether it runs on one thread or is split over several."""

from __future__ import annotations

import numpy as np
import pytest

from cmx.buffers import PARALLEL_MIN_BYTES, aligned_empty, copy_bytes


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
