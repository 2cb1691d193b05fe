"""Deterministic top-k selection: the total order, the prefilter's exactness, both frameworks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpicomm.selection import PREFILTER_MIN_K, _sample_plan, index_dtype_for, topk_indices


def brute_force(x: np.ndarray, k: int) -> np.ndarray:
    """The definition: sort by (|x| descending, index ascending), keep k, sort by index."""
    order = np.lexsort((np.arange(x.shape[0]), -np.abs(x.astype(np.float64))))
    return np.sort(order[:k])


def make(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "student_t":
        return rng.standard_t(3, n).astype(np.float32)
    if kind == "few_values":        # massive ties
        return rng.integers(-4, 5, n).astype(np.float32)
    if kind == "constant":          # every entry ties
        return np.full(n, 2.5, np.float32)
    if kind == "ascending":         # a strided sample sees a skewed picture
        return np.arange(n, dtype=np.float32)
    if kind == "sparse":            # mostly exact zeros
        x = np.zeros(n, np.float32)
        x[::97] = rng.standard_normal(x[::97].shape[0])
        return x
    if kind == "spike":             # large values concentrated where the stride misses
        x = rng.standard_normal(n).astype(np.float32) * 1e-3
        x[1::64] = 1000 + rng.standard_normal(x[1::64].shape[0])
        return x
    raise AssertionError(kind)


KINDS = ["student_t", "few_values", "constant", "ascending", "sparse", "spike"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(50, 7), (5000, 1), (100_003, PREFILTER_MIN_K),
                                 (100_003, 4000), (100_003, 12_500), (300_000, 30_000)])
def test_matches_the_definition(kind, n, k):
    x = make(kind, n, np.random.default_rng(n + k))
    expected = brute_force(x, k)
    got_np = topk_indices(x, k)
    got_torch = topk_indices(torch.from_numpy(x), k)
    assert got_np.dtype == np.int64 and got_torch.dtype == torch.int64
    np.testing.assert_array_equal(got_np, expected)
    np.testing.assert_array_equal(got_torch.numpy(), expected)


def test_prefilter_is_used_only_where_it_pays():
    assert _sample_plan(1_000_000, PREFILTER_MIN_K - 1) is None
    assert _sample_plan(1_000_000, 200_000) is None          # k > n/8
    stride, rank = _sample_plan(25_000_000, 25_000)
    assert stride > 1 and rank >= 1


@pytest.mark.parametrize("k", [0, 3, 10, 11])
def test_edge_counts(k):
    x = np.array([3, -3, 1, 0, 2, -2, 5, 5, -1, 4], np.float64)
    got = topk_indices(x, k)
    np.testing.assert_array_equal(got, brute_force(x, min(k, 10)))


def test_negative_k_rejected():
    with pytest.raises(ValueError):
        topk_indices(np.ones(3), -1)


def test_index_dtype():
    assert index_dtype_for(2**31 - 1) == "int32"
    assert index_dtype_for(2**31) == "int64"
