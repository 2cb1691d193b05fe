"""(index, value) pairs for the tests of :mod:`mpicomm.sparse` (tests/test_sparse*.py):
every rank's input generated from a seed, so that each rank can compute the single-process
reference (:mod:`mpicomm.sparse.reference`) itself, and bit-for-bit comparisons of the
results with it and across ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import mpicomm

Pairs = tuple[np.ndarray, np.ndarray]


def rank_pairs(p: int, seed: int, d: int, counts: list[int], dtype: str = "float64",
               nonneg: bool = False, integer: bool = False) -> list[Pairs]:
    """Every rank's (indices, values): ``counts[r]`` distinct indices in [0, d)."""
    out = []
    for r in range(p):
        rng = np.random.default_rng(seed * 1009 + r)
        idx = rng.choice(d, size=counts[r], replace=False).astype(np.int64)
        if integer:
            val = rng.integers(1 if nonneg else -9, 10, size=counts[r]).astype(dtype)
        else:
            val = rng.standard_t(3, size=counts[r])
            val = (np.abs(val) if nonneg else val).astype(dtype)
        out.append((idx, val))
    return out


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def assert_same_bits(got: Pairs, want: Pairs) -> None:
    gi, gv = got
    wi, wv = want
    np.testing.assert_array_equal(np.asarray(gi, dtype=np.int64), wi)
    assert np.asarray(gv).dtype == wv.dtype
    assert bits(np.asarray(gv)) == bits(wv), (gv, wv)


def assert_identical_on_all_ranks(comm: mpicomm.Communicator, *arrays: Any) -> None:
    mine = tuple(bits(np.asarray(a)) for a in arrays)
    everyone = comm.allgather_object(mine)
    assert all(e == everyone[0] for e in everyone)
