"""Serial tests of mpicomm.compress (no MPI): every compressor over every array backend.

Backends follow mpi4py's arrayimpl idea: each round-trip test runs for numpy, torch CPU,
torch CUDA and cupy (the last two are skipped with a reason where unavailable), and for
float16, bfloat16 (torch only), float32 and float64.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pytest
import torch

from mpicomm.buffers import inspect
from mpicomm.compress import (
    BF16,
    FP16,
    QSGD,
    Compressor,
    ErrorFeedback,
    NoCompression,
    Payload,
    PowerSGD,
    RandomK,
    SampledTopK,
    SignSGD,
    TopK,
    k_for,
    make,
    recall,
)
from mpicomm.compress.bitpack import pack_bits, packed_nbytes, unpack_bits
from mpicomm.compress.randomk import random_indices

# ---------------------------------------------------------------------- backends
try:  # pragma: no cover - only on GPU machines
    import cupy

    HAVE_CUPY = bool(cupy.cuda.is_available())
except Exception:  # ImportError, or a CUDA runtime error
    cupy = None
    HAVE_CUPY = False

HAVE_CUDA = torch.cuda.is_available()

BACKENDS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("torch", id="torch-cpu"),
    pytest.param("torch-cuda", id="torch-cuda", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device")]),
    pytest.param("cupy", id="cupy", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUPY, reason="cupy/CUDA unavailable")]),
]
DTYPES = ["float16", "bfloat16", "float32", "float64"]
TORCH_ONLY = {"bfloat16"}


def backend_dtype_params(dtypes: list[str] = DTYPES) -> list[Any]:
    """backend x dtype, without the combinations a framework cannot hold (bfloat16)."""
    out = []
    for b in BACKENDS:
        for d in dtypes:
            if d in TORCH_ONLY and not b.values[0].startswith("torch"):
                continue
            out.append(pytest.param(b.values[0], d, id=f"{b.id}-{d}", marks=b.marks))
    return out


def make_array(backend: str, data: np.ndarray, dtype: str) -> Any:
    if backend == "numpy":
        return np.ascontiguousarray(data.astype(dtype))
    if backend.startswith("torch"):
        t = torch.tensor(data, dtype=getattr(torch, dtype))
        return t.cuda() if backend == "torch-cuda" else t
    return cupy.asarray(data.astype(dtype))


def to_np(a: Any) -> np.ndarray:
    """Any array as a float64 (or integer) numpy array."""
    if isinstance(a, np.ndarray):
        return a.astype(np.float64) if a.dtype.kind == "f" else a
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        return a.double().numpy() if a.is_floating_point() else a.numpy()
    out = cupy.asnumpy(a)
    return out.astype(np.float64) if out.dtype.kind == "f" else out


def shares_memory(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.shares_memory(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.device != b.device or a.numel() == 0 or b.numel() == 0:
            return False
        a0, b0 = a.data_ptr(), b.data_ptr()
        return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes
    if cupy is not None and isinstance(a, cupy.ndarray):
        return bool(cupy.shares_memory(a, b))
    return False


def gaussian(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


# ---------------------------------------------------------------------- compressors
FACTORIES: dict[str, Callable[[], Compressor]] = {
    "topk-density": lambda: TopK(density=0.1),
    "topk-k": lambda: TopK(k=5),
    "sampled_topk": lambda: SampledTopK(0.1, min_sample=16),
    "randomk": lambda: RandomK(density=0.2, seed=3),
    "randomk-rescale": lambda: RandomK(k=7, rescale=True),
    "qsgd-4": lambda: QSGD(bits=4, bucket_size=32),
    "qsgd-1": lambda: QSGD(bits=1, bucket_size=7),
    "qsgd-8": lambda: QSGD(bits=8),
    "fp16": FP16,
    "bf16": BF16,
    "powersgd": lambda: PowerSGD(rank=2),
    "sign": SignSGD,
    "sign-unscaled": lambda: SignSGD(scale=False),
    "none": NoCompression,
}
SHAPES = [(12, 10), (37,), (3, 4, 5)]


def compressor_params() -> list[Any]:
    return [pytest.param(k, id=k) for k in FACTORIES]


@pytest.mark.parametrize("cname", compressor_params())
@pytest.mark.parametrize("backend,dtype", backend_dtype_params())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_round_trip(backend: str, dtype: str, cname: str, shape: tuple[int, ...]) -> None:
    if cname == "bf16" and not backend.startswith("torch"):
        pytest.skip("bfloat16 payloads exist only in torch (TypeError tested separately)")
    comp = FACTORIES[cname]()
    x = make_array(backend, gaussian(shape, seed=1), dtype)
    before = to_np(x).copy()
    payload = comp.compress(x, name="w", step=3)
    assert isinstance(payload, Payload)
    xi = inspect(x)
    for key, arr in payload.arrays.items():
        ai = inspect(arr)
        assert (ai.framework, ai.device) == (xi.framework, xi.device), key
        assert len(ai.shape) in (1, 2), key
        assert not shares_memory(arr, x), f"payload {key!r} aliases the input"
    y = comp.decompress(payload)
    yi = inspect(y)
    assert (yi.framework, yi.dtype, yi.shape, yi.device) == (xi.framework, xi.dtype,
                                                             xi.shape, xi.device)
    np.testing.assert_array_equal(to_np(x), before)  # input untouched
    xs, ys = to_np(x), to_np(y)
    if cname == "none":
        np.testing.assert_array_equal(ys, xs)
    elif cname.startswith(("topk", "sampled")):
        kept = ys != 0
        np.testing.assert_array_equal(ys[kept], xs[kept])
        assert kept.sum() <= k_for(xs.size, 0.1) if cname != "topk-k" else kept.sum() <= 5
    elif cname in ("fp16", "bf16"):
        np.testing.assert_allclose(ys, xs, rtol=1e-2, atol=1e-3)
    elif cname.startswith("sign"):
        assert np.all(np.sign(ys) == np.where(xs < 0, -1.0, 1.0))
    elif cname.startswith("qsgd"):
        assert np.all((ys == 0) | (np.sign(ys) == np.sign(xs)))
        assert np.linalg.norm(ys - xs) <= 2.0 * np.linalg.norm(xs)


# ---------------------------------------------------------------------- wire sizes
@pytest.mark.parametrize("cname", compressor_params())
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("shape", [(1,), (7,), (1000,), (4099,), (40, 30), (64, 3, 3, 3)],
                         ids=lambda s: "x".join(map(str, s)))
def test_wire_bytes_match_payload(cname: str, dtype: str, shape: tuple[int, ...]) -> None:
    comp = FACTORIES[cname]()
    numel = math.prod(shape)
    if cname == "topk-k" and numel < 5 or cname == "randomk-rescale" and numel < 7:
        pytest.skip("k exceeds numel")
    x = make_array("torch", gaussian(shape, seed=2), dtype)
    payload = comp.compress(x, name="w")
    itemsize = x.element_size()
    expected = comp.wire_bytes(numel, itemsize, shape=shape)
    if comp.fixed_size:
        assert payload.nbytes == expected
    else:
        assert payload.nbytes <= expected


def test_wire_bytes_formulas() -> None:
    n = 10_000
    assert TopK(density=0.01).wire_bytes(n) == 100 * 8
    assert TopK(density=0.01).wire_bytes(2**31, 2) == k_for(2**31, 0.01) * (2 + 8)
    assert RandomK(k=100).wire_bytes(n, 2) == 200
    assert QSGD(bits=4, bucket_size=512).wire_bytes(n) == math.ceil(n * 5 / 8) + 4 * 20
    assert SignSGD().wire_bytes(n) == math.ceil(n / 8) + 4
    assert FP16().wire_bytes(n, 8) == 2 * n
    assert NoCompression().wire_bytes(n, 8) == 8 * n
    assert PowerSGD(rank=4).wire_bytes(100 * 100, 4, shape=(100, 100)) == 200 * 4 * 4
    assert PowerSGD(rank=4).wire_bytes(100 * 100, 8, shape=(100, 100)) == 200 * 4 * 8
    assert PowerSGD(rank=4).wire_bytes(100, 4, shape=(100,)) == 400
    assert PowerSGD(rank=4).wire_bytes(100 * 100) == 200 * 4 * 4  # square guess


def test_capabilities_and_registry() -> None:
    flags = {n: (make(n, **({"density": 0.1} if "k" in n else {})))
             for n in ("topk", "sampled_topk", "randomk", "qsgd", "fp16", "bf16", "powersgd",
                       "sign", "none")}
    assert {n: c.allreduce_compatible for n, c in flags.items()} == {
        "topk": False, "sampled_topk": False, "randomk": True, "qsgd": False, "fp16": True,
        "bf16": True, "powersgd": True, "sign": False, "none": True}
    assert {n for n, c in flags.items() if not c.fixed_size} == {"sampled_topk"}
    assert flags["powersgd"].phases == 2 and flags["topk"].phases == 1
    for n, c in flags.items():
        assert c.name == n
    assert "TopK(density=0.1" in repr(flags["topk"])


# ---------------------------------------------------------------------- TopK
def brute_topk(x: np.ndarray, k: int) -> np.ndarray:
    order = sorted(range(x.size), key=lambda i: (-abs(float(x[i])), i))
    return np.sort(np.array(order[:k], dtype=np.int64))


@pytest.mark.parametrize("backend,dtype", backend_dtype_params(["float32", "float64"]))
@pytest.mark.parametrize("k", [1, 3, 50, 299, 300])
def test_topk_matches_brute_force_with_ties(backend: str, dtype: str, k: int) -> None:
    rng = np.random.default_rng(k)
    data = rng.integers(-3, 4, size=300).astype(np.float64)  # many equal magnitudes
    x = make_array(backend, data, dtype)
    p = TopK(k=k).compress(x, name="t")
    idx = to_np(p.arrays["indices"])
    assert idx.dtype == np.int32
    np.testing.assert_array_equal(idx, brute_topk(data, k))
    np.testing.assert_array_equal(to_np(p.arrays["values"]), data[idx])
    dense = np.zeros(300)
    dense[idx] = data[idx]
    np.testing.assert_array_equal(to_np(TopK(k=k).decompress(p)), dense)


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


@pytest.mark.parametrize("cname", ["randomk", "randomk-rescale", "fp16", "none"])
def test_allreduce_compatible_sum(cname: str) -> None:
    """Summing payload arrays of 3 'ranks' decompresses to the sum of decompressions."""
    comp = FACTORIES[cname]()
    xs = [torch.from_numpy(gaussian((64,), seed=r)) for r in range(3)]
    payloads = [comp.compress(x, name="w", step=2) for x in xs]
    summed = Payload({k: sum(p.arrays[k] for p in payloads) for k in payloads[0].arrays},
                     payloads[0].ctx)
    expected = sum(comp.decompress(p) for p in payloads)
    tol = 1e-2 if cname == "fp16" else 1e-12
    torch.testing.assert_close(comp.decompress(summed), expected, rtol=tol, atol=tol)


def test_randomk_rescale_unbiased() -> None:
    x = torch.from_numpy(gaussian((20,), seed=5))
    comp = RandomK(k=5, rescale=True)
    mean = sum(comp.decompress(comp.compress(x, name="w", step=s)) for s in range(4000)) / 4000
    # per element: value x*4 with probability 1/4, else 0 -> sd of the mean |x|*sqrt(3)/63
    assert torch.all((mean - x).abs() <= 5 * x.abs() * math.sqrt(3) / math.sqrt(4000) + 1e-12)


# ---------------------------------------------------------------------- global RNG
def test_global_rng_untouched() -> None:
    torch_state = torch.random.get_rng_state()
    np_state = np.random.get_state()
    x = gaussian((50, 40), seed=9)
    for cname in FACTORIES:
        if cname == "bf16":
            continue
        comp = FACTORIES[cname]()
        for step in range(2):
            comp.decompress(comp.compress(x, name="w", step=step))
    PowerSGD(rank=2, warm_start=False).compress(torch.from_numpy(x), name="w", step=1)
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    after = np.random.get_state()
    assert after[0] == np_state[0] and np.array_equal(after[1], np_state[1])
    assert after[2:] == np_state[2:]


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
               pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device")])]


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


@pytest.mark.parametrize("backend,dtype", backend_dtype_params(["float32", "float64"]))
@pytest.mark.parametrize("matrix_rank", [1, 3, 4])
def test_powersgd_exact_for_low_rank(backend: str, dtype: str, matrix_rank: int) -> None:
    m = make_array(backend, low_rank(64, 48, matrix_rank), dtype)
    comp = PowerSGD(rank=4, min_compression_rate=1.0)
    y = comp.decompress(comp.compress(m, name="w"))
    rel = np.linalg.norm(to_np(y) - to_np(m)) / np.linalg.norm(to_np(m))
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
@pytest.mark.parametrize("backend,dtype", backend_dtype_params(["float32", "float64"]))
def test_sign_scale(backend: str, dtype: str) -> None:
    data = gaussian((1001,), seed=4)
    data[10] = 0.0
    x = make_array(backend, data, dtype)
    p = SignSGD().compress(x)
    assert to_np(p.arrays["signs"]).size == math.ceil(1001 / 8)
    scale = float(to_np(p.arrays["scale"])[0])
    assert scale == pytest.approx(np.abs(data).mean(), rel=1e-6)
    y = to_np(SignSGD().decompress(p))
    np.testing.assert_allclose(y, np.where(data < 0, -scale, scale), rtol=1e-6)
    y1 = to_np(SignSGD(scale=False).decompress(SignSGD(scale=False).compress(x)))
    np.testing.assert_array_equal(y1, np.where(data < 0, -1.0, 1.0))


# ---------------------------------------------------------------------- ErrorFeedback
@pytest.mark.parametrize("backend,dtype", backend_dtype_params(["float16", "float32",
                                                                "float64"]))
def test_error_feedback_conservation(backend: str, dtype: str) -> None:
    ef = ErrorFeedback()
    comp = TopK(density=0.05)
    residual_expected = np.zeros((10, 20))
    for step in range(3):
        g = make_array(backend, gaussian((10, 20), seed=step), dtype)
        gc = ef.compensate("w", g)
        # the float64 sum is exact here; rounding it to dtype is the dtype's own addition
        expected = (to_np(g) + residual_expected).astype(dtype)
        np.testing.assert_array_equal(to_np(gc), expected)
        assert not shares_memory(gc, g)
        sent = comp.decompress(comp.compress(gc, name="w", step=step))
        ef.update("w", gc, sent)
        r = ef.residual("w")
        assert inspect(r) == inspect(g)
        np.testing.assert_array_equal(to_np(sent) + to_np(r), to_np(gc))  # exact
        residual_expected = to_np(r)
    assert ef.norm() == pytest.approx(np.linalg.norm(residual_expected), rel=1e-12)
    assert ef.norm("w") == ef.norm()


@pytest.mark.parametrize("backend,dtype", backend_dtype_params(["float32"]))
def test_error_feedback_update_sparse(backend: str, dtype: str) -> None:
    dense_ef, sparse_ef = ErrorFeedback(), ErrorFeedback()
    comp = TopK(k=17)
    for step in range(3):
        g = make_array(backend, gaussian((300,), seed=step), dtype)
        a, b = dense_ef.compensate("w", g), sparse_ef.compensate("w", g)
        p = comp.compress(b, name="w")
        dense_ef.update("w", a, comp.decompress(comp.compress(a, name="w")))
        sparse_ef.update_sparse("w", b, p.arrays["indices"])
        assert shares_memory(sparse_ef.residual("w"), b)  # kept in place, no copy
        assert np.all(to_np(b)[to_np(p.arrays["indices"])] == 0)
        np.testing.assert_array_equal(to_np(sparse_ef.residual("w")),
                                      to_np(dense_ef.residual("w")))
    g = torch.ones(5)
    ef = ErrorFeedback()
    c = ef.compensate("x", g)
    ef.update_sparse("x", c, torch.tensor([1, 3]), inplace=False)
    assert torch.equal(c, torch.ones(5))
    assert torch.equal(ef.residual("x"), torch.tensor([1.0, 0, 1, 0, 1]))
    with pytest.raises(ValueError, match="out of range"):
        ef.update_sparse("x", c, torch.tensor([5]))


@pytest.mark.parametrize("backend,dtype", backend_dtype_params(["float32", "float64"]))
def test_error_feedback_tracks_the_sent_mass(backend: str, dtype: str) -> None:
    """``track_sent``: ``sent_sq`` is ``||compensated[indices]||²`` of the last sparse
    update (taken once), and with the residual's squared norm it makes up the
    compensated one (disjoint entries); off by default, nothing after a dense update."""
    ef = ErrorFeedback()
    ef.track_sent = True
    comp = TopK(k=17)
    for step in range(3):
        c = ef.compensate("w", make_array(backend, gaussian((300,), seed=step), dtype))
        values = to_np(c).astype(np.float64)
        p = comp.compress(c, name="w")
        want = float(np.sum(values[to_np(p.arrays["indices"])] ** 2))
        ef.update_sparse("w", c, p.arrays["indices"])
        assert ef.sent_sq("w") == pytest.approx(want, rel=1e-12)
        left = float(np.sum(to_np(ef.residual("w")).astype(np.float64) ** 2))
        assert want + left == pytest.approx(float(np.sum(values ** 2)), rel=1e-12)
    with pytest.raises(KeyError, match="no sent norm"):
        ef.sent_sq("w")                                  # taken
    c = ef.compensate("w", make_array(backend, gaussian((300,), seed=9), dtype))
    ef.update("w", c, c)
    with pytest.raises(KeyError, match="no sent norm"):
        ef.sent_sq("w")                                  # a dense update keeps none
    off = ErrorFeedback()
    off.update_sparse("w", torch.ones(4), torch.tensor([1]))
    with pytest.raises(KeyError, match="track_sent is False"):
        off.sent_sq("w")


def test_error_feedback_state_and_checks() -> None:
    ef = ErrorFeedback()
    g = np.arange(6, dtype=np.float32).reshape(2, 3)
    ef.update("a", g, np.zeros_like(g))
    ef.update("b", torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64))
    state = ef.state_dict()
    other = ErrorFeedback()
    other.load_state_dict(state)
    assert other.names() == ["a", "b"] and len(other) == 2 and "a" in other
    np.testing.assert_array_equal(other.residual("a"), g)
    assert torch.equal(other.residual("b"), torch.ones(4, dtype=torch.float64))
    state["residuals"]["a"][0, 0] = 99.0  # copies, not views
    assert other.residual("a")[0, 0] == 0.0 and ef.residual("a")[0, 0] == 0.0
    with pytest.raises(ValueError, match="shape"):
        ef.compensate("a", np.zeros(6, dtype=np.float32))
    with pytest.raises(ValueError, match="dtype"):
        ef.compensate("a", np.zeros((2, 3), dtype=np.float64))
    with pytest.raises(ValueError, match="framework"):
        ef.compensate("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="shape"):
        ef.update("c", np.zeros(3), np.zeros(4))
    with pytest.raises(TypeError):
        ef.compensate("z", [1.0, 2.0])
    with pytest.raises(KeyError):
        ef.residual("missing")
    ef.reset("a")
    assert "a" not in ef and "b" in ef
    ef.reset()
    assert len(ef) == 0 and ef.norm() == 0.0


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("build", [
    lambda: TopK(density=0.0), lambda: TopK(density=1.5), lambda: TopK(density=-0.1),
    lambda: TopK(density=float("nan")), lambda: TopK(), lambda: TopK(density=0.1, k=3),
    lambda: TopK(k=0), lambda: TopK(k=2.5), lambda: TopK(k=True),
    lambda: SampledTopK(density=2.0), lambda: SampledTopK(0.1, sample_fraction=0.0),
    lambda: SampledTopK(0.1, oversample=0.5),
    lambda: RandomK(density=0.0), lambda: RandomK(k=-1), lambda: RandomK(),
    lambda: QSGD(bits=0), lambda: QSGD(bits=9), lambda: QSGD(bits=2.0),
    lambda: QSGD(bucket_size=0), lambda: PowerSGD(rank=0), lambda: PowerSGD(rank=1.5),
    lambda: PowerSGD(min_compression_rate=0), lambda: make("nope"),
    lambda: make("topk", density=0.1, foo=1),
], ids=lambda f: "")
def test_bad_arguments(build: Callable[[], Any]) -> None:
    with pytest.raises(ValueError):
        build()


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        TopK(k=10).compress(np.zeros(5), name="w")
    with pytest.raises(ValueError, match="exceeds"):
        RandomK(k=10).compress(np.zeros(5))
    for c in (TopK(k=1), SampledTopK(0.5), RandomK(k=1), QSGD(), FP16(), PowerSGD(),
              SignSGD(), NoCompression()):
        with pytest.raises(TypeError):
            c.compress([1.0, 2.0, 3.0])
    for c in (TopK(k=1), QSGD(), FP16(), SignSGD()):
        with pytest.raises(TypeError, match="floating"):
            c.compress(np.arange(5))
    with pytest.raises(TypeError, match="bfloat16"):
        BF16().compress(np.ones(4, dtype=np.float32))
    assert np.array_equal(NoCompression().decompress(NoCompression().compress(np.arange(5))),
                          np.arange(5))
