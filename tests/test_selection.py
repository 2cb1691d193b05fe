"""Deterministic top-k selection: the total order, the prefilter's exactness, both frameworks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpicomm.compress.topk_select import (
    PREFILTER_MIN_K,
    _sample_plan,
    index_dtype_for,
    topk_indices,
)


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


# ---------------------------------------------------------------------- threshold + compaction
from mpicomm.compress.topk_select import topk_indices_approx, topk_threshold  # noqa: E402

HAVE_CUDA = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[
               pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(50, 7), (5000, 1), (100_003, 700), (100_003, 4000),
                                 (100_003, 12_500), (20_000, 19_999)])
def test_threshold_compaction_is_exact(device, kind, n, k):
    x = make(kind, n, np.random.default_rng(3 * n + k))
    got = topk_threshold(torch.from_numpy(x).to(device), k)
    assert got.device.type == device and got.dtype == torch.int64
    np.testing.assert_array_equal(got.cpu().numpy(), brute_force(x, k))


@pytest.mark.parametrize("device", DEVICES)
def test_threshold_compaction_edges_and_dtypes(device):
    x = torch.tensor([3, -3, 1, 0, 2, -2, 5, 5, -1, 4], dtype=torch.float64, device=device)
    for k in (0, 3, 10, 11):
        np.testing.assert_array_equal(topk_threshold(x, k).cpu().numpy(),
                                      brute_force(x.cpu().numpy(), min(k, 10)))
    with pytest.raises(ValueError):
        topk_threshold(x, -1)
    h = make("student_t", 50_000, np.random.default_rng(5))
    for dtype in (torch.float16, torch.bfloat16):
        t = torch.from_numpy(h).to(dtype).to(device)
        want = brute_force(t.float().cpu().numpy(), 600)
        np.testing.assert_array_equal(topk_threshold(t, 600).cpu().numpy(), want)


def test_threshold_retries_then_falls_back(monkeypatch):
    """An estimate that is always too high: the widened retry, then the full selection,
    still give the exact answer."""
    from mpicomm.compress import topk_select as selection

    calls = []

    def too_high(mag, stride, rank):
        calls.append(rank)
        return mag.max() + 1

    monkeypatch.setattr(selection, "_sample_cut", too_high)
    x = make("student_t", 100_000, np.random.default_rng(9))
    got = topk_threshold(torch.from_numpy(x), 2000)
    np.testing.assert_array_equal(got.numpy(), brute_force(x, 2000))
    assert len(calls) == 2 and calls[1] > calls[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["student_t", "normal", "uniform", "few_values", "spike"])
@pytest.mark.parametrize("n,density", [(300_000, 0.003), (200_000, 0.05)])
def test_approximate_recall(device, kind, n, density):
    rng = np.random.default_rng(int(n * density))
    if kind == "normal":
        x = rng.standard_normal(n).astype(np.float32)
    elif kind == "uniform":
        x = rng.uniform(-1, 1, n).astype(np.float32)
    else:
        x = make(kind, n, rng)
    k = int(n * density)
    got = topk_indices_approx(torch.from_numpy(x).to(device), k).cpu().numpy()
    exact = brute_force(x, k)
    assert got.shape[0] <= k and np.all(np.diff(got) > 0)
    assert np.isin(got, exact).all()  # never a wrong entry: the exact top-m, m <= k
    assert got.shape[0] / k >= 0.95


def test_approximate_argument_checks():
    x = torch.ones(100)
    with pytest.raises(ValueError):
        topk_indices_approx(x, -1)
    with pytest.raises(ValueError):
        topk_indices_approx(x, 3, sample_rank=0)
    assert topk_indices_approx(x, 50).tolist() == list(range(50))  # k > n/8: exact


def test_selection_benchmark_suite_runs(tmp_path, capsys):
    """``python -m mpicomm.bench selection`` (tiny, on the CPU): every method timed, the
    exact ones checked against topk_indices, the approximate one's recall reported."""
    import json

    from mpicomm.bench.__main__ import main

    out = tmp_path / "sel.json"
    assert main(["selection", "--device", "cpu", "--sizes", "20000", "--densities", "0.01",
                 "--repeats", "1", "--warmup", "0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    # the machine it ran on, as every suite records it (BENCHMARKS.md's table of runs)
    assert result["machine"]["cpus"] and result["machine"]["gpu"] is None
    assert {r["method"] for r in rows} == {"torch.topk", "topk_indices", "prefilter",
                                           "threshold", "approx", "TopK.compress"}
    assert all(r["exact"] for r in rows if "exact" in r)
    assert [r["recall"] for r in rows if r["method"] == "approx"][0] >= 0.95
    assert "x_topk" in capsys.readouterr().out
