"""Serial tests of each compressor's own method in mpicomm.compress (no MPI), against
brute-force or closed-form references: top-k selection and its tie-break, sampled
top-k's recall and exactness, random-k's shared indices and unbiased rescaling, QSGD's
unbiased stochastic levels on every device and its bit packing, PowerSGD's low-rank
exactness, warm start and phases, and SignSGD's scale; over the array backends of
tests/arrays.py where the method depends on them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpicomm.compress import (
    QSGD,
    PowerSGD,
    RandomK,
    SampledTopK,
    SignSGD,
    TopK,
    k_for,
    recall,
)
from mpicomm.compress.bitpack import pack_bits, packed_nbytes, unpack_bits
from mpicomm.compress.randomk import random_indices

from .arrays import Backend, as_numpy, cases, gaussian


# ---------------------------------------------------------------------- TopK
def brute_topk(x: np.ndarray, k: int) -> np.ndarray:
    order = sorted(range(x.size), key=lambda i: (-abs(float(x[i])), i))
    return np.sort(np.array(order[:k], dtype=np.int64))


@pytest.mark.parametrize("backend,dtype", cases(["float32", "float64"]))
@pytest.mark.parametrize("k", [1, 3, 50, 299, 300])
def test_topk_matches_brute_force_with_ties(backend: Backend, dtype: str, k: int) -> None:
    rng = np.random.default_rng(k)
    data = rng.integers(-3, 4, size=300).astype(np.float64)  # many equal magnitudes
    x = backend.make(data, dtype)
    p = TopK(k=k).compress(x, name="t")
    idx = as_numpy(p.arrays["indices"])
    assert idx.dtype == np.int32
    np.testing.assert_array_equal(idx, brute_topk(data, k))
    np.testing.assert_array_equal(as_numpy(p.arrays["values"]), data[idx])
    dense = np.zeros(300)
    dense[idx] = data[idx]
    np.testing.assert_array_equal(as_numpy(TopK(k=k).decompress(p)), dense)


def test_topk_tie_break_is_by_index() -> None:
    x = np.array([1.0, -1.0] * 50, dtype=np.float32)
    p = TopK(k=10).compress(x)
    np.testing.assert_array_equal(p.arrays["indices"], np.arange(10))
    x[77] = 2.0
    p = TopK(k=3).compress(x)
    np.testing.assert_array_equal(p.arrays["indices"], [0, 1, 77])


def test_k_for_rule() -> None:
    assert k_for(1000, 0.001) == 1 and k_for(1000, 0.0001) == 1
    assert k_for(1001, 0.01) == 11 and k_for(10, 1.0) == 10
    assert TopK(density=0.5).k_for(3) == 2


def test_topk_nonfinite() -> None:
    x = np.array([1.0, np.nan, -5.0, np.inf, 0.5], dtype=np.float32)
    with pytest.raises(ValueError, match="grad.w"):
        TopK(k=2).compress(x, name="grad.w")
    p = TopK(k=3, allow_nonfinite=True).compress(x, name="grad.w")
    np.testing.assert_array_equal(p.arrays["indices"], [1, 2, 3])
    for c in (SampledTopK(0.5), QSGD(), SignSGD(), PowerSGD(rank=1)):
        with pytest.raises(ValueError, match="non-finite"):
            c.compress(np.full((8, 8), np.inf), name="w")


# ---------------------------------------------------------------------- SampledTopK
def test_sampled_topk_recall_heavy_tailed() -> None:
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_t(df=3, size=400_000).astype(np.float32))
    comp = SampledTopK(0.01, sample_fraction=0.01)
    k = k_for(x.numel(), 0.01)
    recalls = []
    for step in range(3):
        p = comp.compress(x, name="g", step=step)
        idx = p.arrays["indices"]
        assert idx.numel() <= k
        assert torch.all(idx[1:] > idx[:-1])  # sorted, distinct
        recalls.append(recall(x, idx, k))
        torch.testing.assert_close(p.arrays["values"], x[idx.long()])
    assert min(recalls) >= 0.9, recalls
    # deterministic for a given (seed, name, step)
    a = comp.compress(x, name="g", step=5).arrays["indices"]
    b = SampledTopK(0.01, sample_fraction=0.01).compress(x, name="g", step=5).arrays["indices"]
    assert torch.equal(a, b)


def test_sampled_topk_is_exact_when_full_or_small() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal(50_000).astype(np.float32)
    p = SampledTopK(0.02, sample_fraction=0.02).compress(x, name="a")
    k = k_for(x.size, 0.02)
    if p.arrays["indices"].size == k:
        np.testing.assert_array_equal(p.arrays["indices"], brute_topk_fast(x, k))
    else:  # a shortfall is still the exact top-m
        m = p.arrays["indices"].size
        np.testing.assert_array_equal(p.arrays["indices"], brute_topk_fast(x, m))
    small = rng.standard_normal(100)
    p = SampledTopK(0.1).compress(small)  # sample >= numel: plain exact top-k
    np.testing.assert_array_equal(p.arrays["indices"], brute_topk(small, 10))


def test_sampled_topk_shortfall_is_exact_top_m() -> None:
    x = np.random.default_rng(6).standard_normal(20_000).astype(np.float32)
    comp = SampledTopK(0.01, sample_fraction=0.05, oversample=1.0, refinements=0)
    k = k_for(x.size, 0.01)
    sizes = set()
    for step in range(12):
        idx = comp.compress(x, name="s", step=step).arrays["indices"]
        assert idx.size <= k
        np.testing.assert_array_equal(idx, brute_topk_fast(x, idx.size))
        sizes.add(idx.size == k)
    assert sizes == {True, False}  # both branches were exercised


def brute_topk_fast(x: np.ndarray, k: int) -> np.ndarray:
    order = np.lexsort((np.arange(x.size), -np.abs(x.astype(np.float64))))
    return np.sort(order[:k])


# ---------------------------------------------------------------------- RandomK
def test_randomk_indices_shared_and_step_dependent() -> None:
    x = gaussian((5000,))
    a = RandomK(density=0.01, seed=7).compress(x, name="w", step=4)
    b = RandomK(density=0.01, seed=7).compress(x * 2, name="w", step=4)
    c = RandomK(density=0.01, seed=7).compress(x, name="w", step=5)
    d = RandomK(density=0.01, seed=7).compress(x, name="v", step=4)
    e = RandomK(density=0.01, seed=8).compress(x, name="w", step=4)
    ia = a.ctx.indices
    assert torch.equal(ia, b.ctx.indices)
    for other in (c, d, e):
        assert not torch.equal(ia, other.ctx.indices)
    assert ia.numel() == 50 and torch.all(ia[1:] > ia[:-1])
    assert torch.equal(ia, RandomK(density=0.01, seed=7).indices(5000, name="w", step=4))
    # the same indices for a torch input (the draw is framework-independent)
    t = RandomK(density=0.01, seed=7).compress(torch.from_numpy(x), name="w", step=4)
    assert torch.equal(ia, t.ctx.indices)


@pytest.mark.parametrize("numel,k", [(10, 10), (10, 3), (1000, 200), (10**6, 1000)])
def test_random_indices_distinct_sorted(numel: int, k: int) -> None:
    g = torch.Generator().manual_seed(1)
    idx = random_indices(numel, k, g)
    assert idx.numel() == k and idx.dtype == torch.int64
    assert torch.all(idx[1:] > idx[:-1]) and int(idx[0]) >= 0 and int(idx[-1]) < numel


def test_random_indices_uniform() -> None:
    counts = np.zeros(40)
    for s in range(400):
        counts[random_indices(40, 4, torch.Generator().manual_seed(s)).numpy()] += 1
    # each position expected 40 times (binomial sd ~6); a gross bias would show
    assert counts.min() > 15 and counts.max() < 70


def test_randomk_rescale_unbiased() -> None:
    x = torch.from_numpy(gaussian((20,), seed=5))
    comp = RandomK(k=5, rescale=True)
    mean = sum(comp.decompress(comp.compress(x, name="w", step=s)) for s in range(4000)) / 4000
    # per element: value x*4 with probability 1/4, else 0 -> sd of the mean |x|*sqrt(3)/63
    assert torch.all((mean - x).abs() <= 5 * x.abs() * math.sqrt(3) / math.sqrt(4000) + 1e-12)


# ---------------------------------------------------------------------- QSGD
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_qsgd_unbiased(bits: int, dtype: type) -> None:
    x = torch.from_numpy(gaussian((48,), seed=11).astype(dtype))
    x[5] = 0.0
    comp = QSGD(bits=bits, bucket_size=16)
    n = 2000
    samples = torch.stack([comp.decompress(comp.compress(x, name="w", step=s)).double()
                           for s in range(n)])
    mean, sd = samples.mean(0), samples.std(0)
    err = (mean - x.double()).abs()
    assert torch.all(err <= 5 * sd / math.sqrt(n) + 1e-6 * x.abs().max()), (err, sd)
    assert float(samples[:, 5].abs().max()) == 0.0


def test_qsgd_bits8_close_and_deterministic() -> None:
    x = torch.from_numpy(gaussian((4096,), seed=12).astype(np.float32))
    comp = QSGD(bits=8, bucket_size=512)
    y = comp.decompress(comp.compress(x, name="w"))
    rel = float(torch.linalg.vector_norm(y - x) / torch.linalg.vector_norm(x))
    assert rel < 1.5 * math.sqrt(512) / (2 * 255), rel
    p1 = QSGD(bits=3).compress(x, name="w", step=1)
    p2 = QSGD(bits=3).compress(x, name="w", step=1)
    p3 = QSGD(bits=3, salt=1).compress(x, name="w", step=1)
    assert torch.equal(p1.arrays["levels"], p2.arrays["levels"])
    assert not torch.equal(p1.arrays["levels"], p3.arrays["levels"])
    zeros = QSGD(bits=2).compress(torch.zeros(100), name="z")
    assert torch.count_nonzero(QSGD(bits=2).decompress(zeros)) == 0


def test_qsgd_levels_bounded() -> None:
    x = torch.from_numpy(gaussian((300,), seed=13))
    comp = QSGD(bits=1, bucket_size=30)
    p = comp.compress(x, name="w")
    y = comp.decompress(p).view(10, 30)
    scales = p.arrays["scales"].double().view(10, 1)
    assert torch.all(y.abs() <= scales + 1e-12)
    assert torch.all((y == 0) | ((y.abs() - scales).abs() < 1e-6))  # ternary levels


DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[
               pytest.mark.gpu,
               pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
def test_qsgd_promise_on_every_device(device: str) -> None:
    """What QSGD promises across devices: the noise is drawn on
    the tensor's device, so CUDA and CPU give different *bits* (different generators);
    what holds everywhere is the *distribution*: the same scales, every decoded entry on
    one of the two grid levels around ``|x| / c * s`` (so at most one level from the
    CPU's), unbiased, and reproducible on a given device."""
    x = torch.from_numpy(gaussian((96,), seed=21)).to(device)
    comp = QSGD(bits=3, bucket_size=32)
    s = comp.levels
    p = comp.compress(x, name="w", step=4)
    assert torch.equal(p.arrays["levels"], comp.compress(x, name="w", step=4).arrays["levels"])
    cpu = comp.compress(x.cpu(), name="w", step=4)
    scales = p.arrays["scales"].cpu().double()
    torch.testing.assert_close(scales, cpu.arrays["scales"].double(), rtol=1e-6, atol=0)
    y = comp.decompress(p).cpu().double()
    step = scales.repeat_interleave(32)[:96] / s
    exact = x.cpu().double().abs() / step                   # |x| in units of one level
    level = y.abs() / step
    assert torch.all((level - level.round()).abs() < 1e-6)  # on the grid
    assert torch.all((level >= exact.floor() - 1e-6) & (level <= exact.ceil() + 1e-6))
    y_cpu = comp.decompress(cpu).double()
    assert torch.all((y - y_cpu).abs() <= step * (1 + 1e-6))
    n = 1000
    mean = torch.stack([comp.decompress(comp.compress(x, name="w", step=t)).cpu().double()
                        for t in range(n)]).mean(0)
    # per-entry sd <= step / 2 (a two-point distribution one level wide)
    assert torch.all((mean - x.cpu().double()).abs() <= 5 * step / (2 * math.sqrt(n)) + 1e-9)


@pytest.mark.parametrize("width", list(range(1, 17)))
def test_bitpack_round_trip(width: int) -> None:
    g = torch.Generator().manual_seed(width)
    for count in (0, 1, 7, 8, 1001):
        codes = torch.randint(0, 2**width, (count,), generator=g, dtype=torch.int32)
        packed = pack_bits(codes, width)
        assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(count, width)
        assert torch.equal(unpack_bits(packed, width, count), codes)
        shifts = np.arange(width - 1, -1, -1)
        msb_first = (codes.numpy()[:, None].astype(np.int64) >> shifts) & 1
        np.testing.assert_array_equal(packed.numpy(),
                                      np.packbits(msb_first.astype(np.uint8).ravel()))
        if width == 1:
            np.testing.assert_array_equal(packed.numpy(),
                                          np.packbits(codes.numpy().astype(np.uint8)))


# ---------------------------------------------------------------------- PowerSGD
def low_rank(n: int, m: int, r: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, r)) @ rng.standard_normal((r, m))


@pytest.mark.parametrize("backend,dtype", cases(["float32", "float64"]))
@pytest.mark.parametrize("matrix_rank", [1, 3, 4])
def test_powersgd_exact_for_low_rank(backend: Backend, dtype: str, matrix_rank: int) -> None:
    m = backend.make(low_rank(64, 48, matrix_rank), dtype)
    comp = PowerSGD(rank=4, min_compression_rate=1.0)
    y = comp.decompress(comp.compress(m, name="w"))
    rel = np.linalg.norm(as_numpy(y) - as_numpy(m)) / np.linalg.norm(as_numpy(m))
    assert rel < 1e-5, rel


def test_powersgd_should_compress_rule() -> None:
    c = PowerSGD(rank=4)  # (n + m) * 4 * 2 < n * m
    assert not c.should_compress((1000,))
    assert not c.should_compress((10, 10))  # 160 >= 100
    assert c.should_compress((100, 100))  # 1600 < 10000
    assert c.should_compress((64, 3, 3, 3))  # n=64, m=27: 728 < 1728
    assert not c.should_compress((16, 16))  # 256 == 256: not strictly smaller
    assert PowerSGD(rank=4, min_compression_rate=1.0).should_compress((16, 16))
    assert c.rank_for((3, 100)) == 3
    p = c.compress(torch.ones(10, 10), name="small")
    assert set(p.arrays) == {"values"}
    assert torch.equal(c.decompress(p), torch.ones(10, 10))
    with pytest.raises(ValueError, match="dense"):
        c.p_phase(torch.ones(10), "bias")


def test_powersgd_warm_start() -> None:
    rng = np.random.default_rng(3)
    u, _ = np.linalg.qr(rng.standard_normal((60, 60)))
    v, _ = np.linalg.qr(rng.standard_normal((40, 40)))
    s = 2.0 ** -np.arange(40)
    m = torch.from_numpy((u[:, :40] * s) @ v.T)
    best = float(np.sqrt(np.sum(s[2:] ** 2)))  # optimal rank-2 error (Eckart-Young)
    a, b = PowerSGD(rank=2, seed=5), PowerSGD(rank=2, seed=5)
    qs, errs = [], []
    for step in range(12):
        ya = a.decompress(a.compress(m, name="w", step=step))
        yb = b.decompress(b.compress(m, name="w", step=step))
        assert torch.equal(ya, yb)  # deterministic
        assert torch.equal(a.q_memory("w"), b.q_memory("w"))
        qs.append(a.q_memory("w").clone())
        errs.append(float(torch.linalg.matrix_norm(m - ya)))
    assert not torch.allclose(qs[0], qs[1])  # Q changes across steps
    assert errs[-1] <= best * (1 + 1e-3) and errs[-1] < errs[0]  # subspace iteration
    c = PowerSGD(rank=2, seed=6)
    c.compress(m, name="w")
    assert not torch.equal(c.q_memory("w"), qs[0])  # another seed, another start
    # checkpoint round trip
    d = PowerSGD(rank=2, seed=5)
    d.load_state_dict(a.state_dict())
    assert torch.equal(d.decompress(d.compress(m, name="w", step=12)),
                       a.decompress(a.compress(m, name="w", step=12)))
    a.reset()
    assert a.q_memory("w") is None


def test_powersgd_no_warm_start_draws_per_step() -> None:
    m = torch.from_numpy(gaussian((30, 20), seed=1))
    c = PowerSGD(rank=2, warm_start=False)
    y0 = c.decompress(c.compress(m, name="w", step=0))
    y1 = c.decompress(c.compress(m, name="w", step=1))
    assert c.q_memory("w") is None and not torch.allclose(y0, y1)
    assert torch.equal(y0, c.decompress(c.compress(m, name="w", step=0)))


def test_powersgd_phases_three_ranks() -> None:
    """Drive the phases like a strategy would (sums stand in for the allreduces)."""
    base = low_rank(50, 36, 3, seed=8)
    mats = [torch.from_numpy(base * (r + 1)) for r in range(3)]
    ranks = [PowerSGD(rank=3, min_compression_rate=1.0, seed=2) for _ in range(3)]
    ps = [c.p_phase(m, "w", 0) for c, m in zip(ranks, mats)]
    p_sum = sum(ps)
    qs = [c.q_phase(m, "w", p_sum) for c, m in zip(ranks, mats)]
    q_sum = sum(qs)
    outs = [c.reconstruct("w", p_sum, q_sum, 3) for c in ranks]
    mean = sum(mats) / 3
    for o in outs:
        torch.testing.assert_close(o, outs[0], rtol=0, atol=0)
        torch.testing.assert_close(o, mean, rtol=1e-9, atol=1e-9)
    assert all(torch.equal(c.q_memory("w"), ranks[0].q_memory("w")) for c in ranks)
    with pytest.raises(KeyError):
        ranks[0].reconstruct("never", p_sum, q_sum, 3)
    with pytest.raises(ValueError):
        ranks[0].reconstruct("w", p_sum, q_sum, 0)


# ---------------------------------------------------------------------- SignSGD
@pytest.mark.parametrize("backend,dtype", cases(["float32", "float64"]))
def test_sign_scale(backend: Backend, dtype: str) -> None:
    data = gaussian((1001,), seed=4)
    data[10] = 0.0
    x = backend.make(data, dtype)
    p = SignSGD().compress(x)
    assert as_numpy(p.arrays["signs"]).size == math.ceil(1001 / 8)
    scale = float(as_numpy(p.arrays["scale"])[0])
    assert scale == pytest.approx(np.abs(data).mean(), rel=1e-6)
    y = as_numpy(SignSGD().decompress(p))
    np.testing.assert_allclose(y, np.where(data < 0, -scale, scale), rtol=1e-6)
    y1 = as_numpy(SignSGD(scale=False).decompress(SignSGD(scale=False).compress(x)))
    np.testing.assert_array_equal(y1, np.where(data < 0, -1.0, 1.0))
