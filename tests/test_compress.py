"""Serial tests of mpicomm.compress (no MPI): what every compressor promises over every
array backend (tests/arrays.py: numpy, torch CPU, torch CUDA and cupy, the
last two skipped with a reason where unavailable, x float16, bfloat16, float32 and
float64): the round trip, the wire sizes, the registry and capabilities, summable
payloads of the allreduce-compatible ones, an untouched global RNG, the checks of bad
arguments and inputs; and the error-feedback memory.
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
)

from .arrays import FLOATS, Backend, as_numpy, cases, gaussian


def shares_memory(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.shares_memory(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.device != b.device or a.numel() == 0 or b.numel() == 0:
            return False
        a0, b0 = a.data_ptr(), b.data_ptr()
        return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes
    if type(a).__module__.startswith("cupy"):
        import cupy

        return bool(cupy.shares_memory(a, b))
    return False


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
@pytest.mark.parametrize("backend,dtype", cases(FLOATS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_round_trip(backend: Backend, dtype: str, cname: str, shape: tuple[int, ...]) -> None:
    if cname == "bf16" and not backend.name.startswith("torch"):
        pytest.skip("bfloat16 payloads exist only in torch (TypeError tested separately)")
    comp = FACTORIES[cname]()
    x = backend.make(gaussian(shape, seed=1), dtype)
    before = as_numpy(x).copy()
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
    np.testing.assert_array_equal(as_numpy(x), before)  # input untouched
    xs, ys = as_numpy(x), as_numpy(y)
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
    x = torch.from_numpy(gaussian(shape, seed=2)).to(getattr(torch, dtype))
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


# ---------------------------------------------------------------------- ErrorFeedback
@pytest.mark.parametrize("backend,dtype", cases(["float16", "float32", "float64"]))
def test_error_feedback_conservation(backend: Backend, dtype: str) -> None:
    ef = ErrorFeedback()
    comp = TopK(density=0.05)
    residual_expected = np.zeros((10, 20))
    for step in range(3):
        g = backend.make(gaussian((10, 20), seed=step), dtype)
        gc = ef.compensate("w", g)
        # the float64 sum is exact here; rounding it to dtype is the dtype's own addition
        expected = (as_numpy(g) + residual_expected).astype(dtype)
        np.testing.assert_array_equal(as_numpy(gc), expected)
        assert not shares_memory(gc, g)
        sent = comp.decompress(comp.compress(gc, name="w", step=step))
        ef.update("w", gc, sent)
        r = ef.residual("w")
        assert inspect(r) == inspect(g)
        np.testing.assert_array_equal(as_numpy(sent) + as_numpy(r), as_numpy(gc))  # exact
        residual_expected = as_numpy(r)
    assert ef.norm() == pytest.approx(np.linalg.norm(residual_expected), rel=1e-12)
    assert ef.norm("w") == ef.norm()


@pytest.mark.parametrize("backend,dtype", cases(["float32"]))
def test_error_feedback_update_sparse(backend: Backend, dtype: str) -> None:
    dense_ef, sparse_ef = ErrorFeedback(), ErrorFeedback()
    comp = TopK(k=17)
    for step in range(3):
        g = backend.make(gaussian((300,), seed=step), dtype)
        a, b = dense_ef.compensate("w", g), sparse_ef.compensate("w", g)
        p = comp.compress(b, name="w")
        dense_ef.update("w", a, comp.decompress(comp.compress(a, name="w")))
        sparse_ef.update_sparse("w", b, p.arrays["indices"])
        assert shares_memory(sparse_ef.residual("w"), b)  # kept in place, no copy
        assert np.all(as_numpy(b)[as_numpy(p.arrays["indices"])] == 0)
        np.testing.assert_array_equal(as_numpy(sparse_ef.residual("w")),
                                      as_numpy(dense_ef.residual("w")))
    g = torch.ones(5)
    ef = ErrorFeedback()
    c = ef.compensate("x", g)
    ef.update_sparse("x", c, torch.tensor([1, 3]), inplace=False)
    assert torch.equal(c, torch.ones(5))
    assert torch.equal(ef.residual("x"), torch.tensor([1.0, 0, 1, 0, 1]))
    with pytest.raises(ValueError, match="out of range"):
        ef.update_sparse("x", c, torch.tensor([5]))


@pytest.mark.parametrize("backend,dtype", cases(["float32", "float64"]))
def test_error_feedback_tracks_the_sent_mass(backend: Backend, dtype: str) -> None:
    """``track_sent``: ``sent_sq`` is ``||compensated[indices]||²`` of the last sparse
    update (taken once), and with the residual's squared norm it makes up the
    compensated one (disjoint entries); off by default, nothing after a dense update."""
    ef = ErrorFeedback()
    ef.track_sent = True
    comp = TopK(k=17)
    for step in range(3):
        c = ef.compensate("w", backend.make(gaussian((300,), seed=step), dtype))
        values = as_numpy(c).astype(np.float64)
        p = comp.compress(c, name="w")
        want = float(np.sum(values[as_numpy(p.arrays["indices"])] ** 2))
        ef.update_sparse("w", c, p.arrays["indices"])
        assert ef.sent_sq("w") == pytest.approx(want, rel=1e-12)
        left = float(np.sum(as_numpy(ef.residual("w")).astype(np.float64) ** 2))
        assert want + left == pytest.approx(float(np.sum(values ** 2)), rel=1e-12)
    with pytest.raises(KeyError, match="no sent norm"):
        ef.sent_sq("w")                                  # taken
    c = ef.compensate("w", backend.make(gaussian((300,), seed=9), dtype))
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
