"""Every dense collective's results against a numpy reference, at whatever rank count runs
the suite.

Run under ``mpiexec -n P python -m pytest --with-mpi -m mpi`` (the Makefile uses P = 1..5).
Each test loops over the buffer backends of ``tests/arrays.py`` (numpy, torch CPU; torch
CUDA and cupy appear as skipped params where there is no GPU) and their dtypes.

Inputs are deterministic per rank (``default_rng([seed, rank])``), so every rank can
compute every other rank's input and the numpy reference locally. They are small
integers (ints) or multiples of 1/4 in [-8, 8] (floats): every partial sum of up to 8
ranks is then exactly representable even in float16/bfloat16, so sums, max and min are
checked bit-exactly in every dtype, whatever order an algorithm reduces in. Rounding is
exercised separately with real-valued data and ``arrays.tolerance``.

Every result is also checked for framework/dtype/device/shape, for holding the same
bytes on every rank, and for leaving the input untouched; results written into ``out=``
(in place or preallocated) are checked the same way.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

import mpicomm
from mpicomm.buffers import inspect
from mpicomm.collectives import ALGORITHMS

from .arrays import FLOATS, INTS, Backend, cases, tolerance

pytestmark = pytest.mark.mpi

OPS = ("sum", "avg", "max", "min")
SIZE_DTYPES = ("float32", "int64")


# ---------------------------------------------------------------------- inputs
def seed_of(*key: Any) -> int:
    """A stable seed for one test case (the same on every rank and every run)."""
    return zlib.crc32(repr(key).encode())


def rank_values(shape: Sequence[int], dtype: str, rank: int, seed: int) -> np.ndarray:
    """Rank ``rank``'s input as float64/int64 numpy values that are exact in ``dtype``."""
    rng = np.random.default_rng([seed, rank])
    if dtype in INTS:
        return rng.integers(-15, 16, size=tuple(shape), dtype=np.int64)
    return rng.integers(-32, 33, size=tuple(shape)).astype(np.float64) / 4


def real_values(shape: Sequence[int], dtype: str, rank: int, seed: int) -> np.ndarray:
    """Real-valued data in [-1, 1], rounded to ``dtype`` (then held as float64)."""
    import torch

    rng = np.random.default_rng([seed, rank])
    raw = torch.from_numpy(rng.uniform(-1, 1, size=tuple(shape)))
    return raw.to(getattr(torch, dtype)).to(torch.float64).numpy()


def all_inputs(shape: Sequence[int], dtype: str, size: int, seed: int,
               values: Callable[..., np.ndarray] = rank_values) -> list[np.ndarray]:
    return [values(shape, dtype, r, seed) for r in range(size)]


def make(backend: Backend, values: np.ndarray, dtype: str) -> Any:
    """``values`` as a ``backend`` array of ``dtype`` with the same shape.

    (``arrays._np_make`` goes through ``np.ascontiguousarray``, which turns a 0-d array
    into shape ``(1,)``; reshaping restores 0-d inputs.)
    """
    return backend.make(values, dtype).reshape(values.shape)


def reference_reduce(inputs: Sequence[np.ndarray], op: str) -> np.ndarray:
    """The elementwise reduction in float64/int64 (``avg`` divides the exact sum)."""
    stack = np.stack(inputs)
    if op == "max":
        return np.asarray(stack.max(axis=0))
    if op == "min":
        return np.asarray(stack.min(axis=0))
    total = np.asarray(stack.sum(axis=0))
    return total / len(inputs) if op == "avg" else total


# ---------------------------------------------------------------------- checks
def raw_bytes(x: Any) -> bytes:
    """The bytes of a numpy/torch/cupy array in C order (bfloat16 included)."""
    fw = inspect(x).framework
    if fw == "torch":
        import torch

        flat = x.detach().cpu().contiguous().reshape(-1)
        return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    if fw == "cupy":
        return x.get().tobytes()
    return np.ascontiguousarray(x).tobytes()


def digest(x: Any) -> str:
    return hashlib.sha256(raw_bytes(x)).hexdigest()


def assert_same_on_all_ranks(comm: mpicomm.Communicator, digests: list[str]) -> None:
    """Every rank computed results with the same bytes (one exchange per test: the
    digests of all the results a test produced, in order)."""
    everyone = comm.allgather_object(digests)
    assert all(d == everyone[0] for d in everyone), "ranks hold different results"


def assert_kind(result: Any, like: Any, shape: Sequence[int]) -> None:
    """``result`` has ``like``'s framework, dtype and device, and shape ``shape``."""
    got, want = inspect(result), inspect(like)
    assert type(result) is type(like)
    assert (got.framework, got.dtype, got.device) == (want.framework, want.dtype, want.device)
    assert got.shape == tuple(shape)


def assert_values(backend: Backend, result: Any, expected: np.ndarray, dtype: str,
                  exact: bool = True, terms: int = 1) -> None:
    got = backend.to_numpy(result)
    if dtype in INTS or exact:
        np.testing.assert_array_equal(got.astype(expected.dtype), expected, strict=True)
    else:
        np.testing.assert_allclose(got.astype(np.float64), expected,
                                   **tolerance(dtype, terms))


def assert_untouched(x: Any, before: bytes) -> None:
    assert raw_bytes(x) == before, "the collective modified its input"


def assert_not_aliased(result: Any, x: Any) -> None:
    """An out-of-place result never shares memory with the input."""
    if inspect(result).framework == "torch":
        assert result is not x
        if result.numel() and x.numel():
            r0, x0 = result.data_ptr(), x.data_ptr()
            r1 = r0 + result.numel() * result.element_size()
            x1 = x0 + x.numel() * x.element_size()
            assert r1 <= x0 or x1 <= r0
    elif inspect(result).framework == "numpy":
        assert not np.shares_memory(result, x)


def expected_exact(op: str, dtype: str) -> bool:
    """Exact data: everything is bit-exact except the rounding of avg's division."""
    return op != "avg" or dtype in INTS


def ops_for(dtype: str) -> tuple[str, ...]:
    return OPS if dtype in FLOATS else tuple(o for o in OPS if o != "avg")


# ---------------------------------------------------------------------- allreduce
def run_allreduce(comm: mpicomm.Communicator, backend: Backend, dtype: str, algorithm: str,
                  shape: Sequence[int], op: str) -> str:
    seed = seed_of("allreduce", tuple(shape), dtype, op)
    inputs = all_inputs(shape, dtype, comm.size, seed)
    x = make(backend, inputs[comm.rank], dtype)
    before = raw_bytes(x)
    result = mpicomm.allreduce(x, op=op, algorithm=algorithm, comm=comm)
    assert_kind(result, x, shape)
    assert_values(backend, result, reference_reduce(inputs, op), dtype,
                  exact=expected_exact(op, dtype))
    assert_untouched(x, before)
    assert_not_aliased(result, x)
    return digest(result)


@pytest.mark.parametrize("shape", [(2,), (33,), (6, 7)], ids=str)
@pytest.mark.parametrize("algorithm", ALGORITHMS["allreduce"])
@pytest.mark.parametrize(("backend", "dtype"), cases())
def test_allreduce_every_dtype(comm, backend, dtype, algorithm, shape):
    assert_same_on_all_ranks(comm, [run_allreduce(comm, backend, dtype, algorithm, shape, op)
                                    for op in ops_for(dtype)])


ALLREDUCE_SHAPES = [(), (0,), (1,), (3,), (4,), (5,), (17,), (1023,), (100_003,), (0, 4),
                    (3, 0, 2), (2, 3, 5)]


@pytest.mark.parametrize("shape", ALLREDUCE_SHAPES, ids=str)
@pytest.mark.parametrize("algorithm", ALGORITHMS["allreduce"])
@pytest.mark.parametrize(("backend", "dtype"), cases(SIZE_DTYPES))
def test_allreduce_every_size(comm, backend, dtype, algorithm, shape):
    assert_same_on_all_ranks(comm, [run_allreduce(comm, backend, dtype, algorithm, shape, op)
                                    for op in ops_for(dtype)])


@pytest.mark.parametrize("algorithm", ALGORITHMS["allreduce"])
@pytest.mark.parametrize(("backend", "dtype"), cases(FLOATS))
def test_allreduce_rounds_within_tolerance(comm, backend, dtype, algorithm):
    """Real-valued data: float16/bfloat16 reduce in their own precision, within tolerance."""
    shape = (257,)
    inputs = all_inputs(shape, dtype, comm.size, seed_of("real", dtype), real_values)
    x = make(backend, inputs[comm.rank], dtype)
    digests = []
    for op in ("sum", "avg"):
        result = mpicomm.allreduce(x, op=op, algorithm=algorithm, comm=comm)
        assert_values(backend, result, reference_reduce(inputs, op), dtype, exact=False,
                      terms=comm.size)
        digests.append(digest(result))
    assert_same_on_all_ranks(comm, digests)


# ---------------------------------------------------------------------- allgather
def run_allgather(comm: mpicomm.Communicator, backend: Backend, dtype: str, algorithm: str,
                  shape: Sequence[int]) -> str:
    inputs = all_inputs(shape, dtype, comm.size, seed_of("allgather", tuple(shape), dtype))
    x = make(backend, inputs[comm.rank], dtype)
    before = raw_bytes(x)
    result = mpicomm.allgather(x, algorithm=algorithm, comm=comm)
    expected = np.concatenate([a if a.ndim else a.reshape(1) for a in inputs])
    assert_kind(result, x, expected.shape)
    assert_values(backend, result, expected, dtype)
    assert_untouched(x, before)
    assert_not_aliased(result, x)
    return digest(result)


@pytest.mark.parametrize("shape", [(2,), (5, 3)], ids=str)
@pytest.mark.parametrize("algorithm", ALGORITHMS["allgather"])
@pytest.mark.parametrize(("backend", "dtype"), cases())
def test_allgather_every_dtype(comm, backend, dtype, algorithm, shape):
    assert_same_on_all_ranks(comm, [run_allgather(comm, backend, dtype, algorithm, shape)])


@pytest.mark.parametrize("shape", [(), (0,), (1,), (3,), (7,), (20_001,), (0, 3), (2, 3, 4)],
                         ids=str)
@pytest.mark.parametrize("algorithm", ALGORITHMS["allgather"])
@pytest.mark.parametrize(("backend", "dtype"), cases(SIZE_DTYPES))
def test_allgather_every_size(comm, backend, dtype, algorithm, shape):
    assert_same_on_all_ranks(comm, [run_allgather(comm, backend, dtype, algorithm, shape)])


# ---------------------------------------------------------------------- allgatherv
ROW_PATTERNS: dict[str, Callable[[int], int]] = {
    "ramp": lambda r: r + 1,
    "zeros-on-even": lambda r: 0 if r % 2 == 0 else 2 * r + 1,
    "all-empty": lambda r: 0,
    "one-large": lambda r: 40_001 if r == 0 else 3,
}


def run_allgatherv(comm: mpicomm.Communicator, backend: Backend, dtype: str, algorithm: str,
                   pattern: str, trailing: tuple[int, ...]) -> str:
    rows = [ROW_PATTERNS[pattern](r) for r in range(comm.size)]
    seed = seed_of("allgatherv", pattern, trailing, dtype)
    inputs = [rank_values((n, *trailing), dtype, r, seed) for r, n in enumerate(rows)]
    x = make(backend, inputs[comm.rank], dtype)
    before = raw_bytes(x)
    result, counts = mpicomm.allgatherv(x, algorithm=algorithm, comm=comm, return_counts=True)
    expected = np.concatenate(inputs)
    assert counts == rows
    assert_kind(result, x, expected.shape)
    assert_values(backend, result, expected, dtype)
    assert_untouched(x, before)
    assert_not_aliased(result, x)
    return digest(result)


@pytest.mark.parametrize("trailing", [(), (3,)], ids=str)
@pytest.mark.parametrize("algorithm", ALGORITHMS["allgatherv"])
@pytest.mark.parametrize(("backend", "dtype"), cases())
def test_allgatherv_every_dtype(comm, backend, dtype, algorithm, trailing):
    assert_same_on_all_ranks(comm, [run_allgatherv(comm, backend, dtype, algorithm, "ramp",
                                                   trailing)])


@pytest.mark.parametrize("trailing", [(), (2, 2)], ids=str)
@pytest.mark.parametrize("pattern", list(ROW_PATTERNS))
@pytest.mark.parametrize("algorithm", ALGORITHMS["allgatherv"])
@pytest.mark.parametrize(("backend", "dtype"), cases(SIZE_DTYPES))
def test_allgatherv_row_patterns(comm, backend, dtype, algorithm, pattern, trailing):
    assert_same_on_all_ranks(comm, [run_allgatherv(comm, backend, dtype, algorithm, pattern,
                                                   trailing)])


def test_allgatherv_zero_dim_input_is_one_row(comm):
    result, counts = mpicomm.allgatherv(np.array(comm.rank, dtype=np.int32), comm=comm,
                                        return_counts=True)
    assert counts == [1] * comm.size
    np.testing.assert_array_equal(result, np.arange(comm.size, dtype=np.int32), strict=True)


# ---------------------------------------------------------------------- broadcast
def run_broadcast(comm: mpicomm.Communicator, backend: Backend, dtype: str, algorithm: str,
                  shape: Sequence[int], roots: Sequence[int] | None = None) -> None:
    """Broadcast from each root in turn (default: every rank); non-roots pass different
    (ignored) contents."""
    digests = []
    for root in range(comm.size) if roots is None else sorted(set(roots)):
        inputs = all_inputs(shape, dtype, comm.size, seed_of("bcast", tuple(shape), dtype))
        x = make(backend, inputs[comm.rank], dtype)
        before = raw_bytes(x)
        result = mpicomm.broadcast(x, root=root, algorithm=algorithm, comm=comm)
        assert_kind(result, x, shape)
        assert_values(backend, result, inputs[root], dtype)
        assert_untouched(x, before)
        assert_not_aliased(result, x)
        digests.append(digest(result))
    assert_same_on_all_ranks(comm, digests)


@pytest.mark.parametrize("shape", [(3,), (4, 5)], ids=str)
@pytest.mark.parametrize("algorithm", ALGORITHMS["broadcast"])
@pytest.mark.parametrize(("backend", "dtype"), cases())
def test_broadcast_every_dtype(comm, backend, dtype, algorithm, shape):
    run_broadcast(comm, backend, dtype, algorithm, shape)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (2,), (9,), (100_003,), (0, 2), (3, 1, 7)],
                         ids=str)
@pytest.mark.parametrize("algorithm", ALGORITHMS["broadcast"])
@pytest.mark.parametrize(("backend", "dtype"), cases(SIZE_DTYPES))
def test_broadcast_every_size(comm, backend, dtype, algorithm, shape):
    """Every root is covered by the dtype test; here the first, a middle and the last."""
    p = comm.size
    run_broadcast(comm, backend, dtype, algorithm, shape, roots=(0, p // 2, p - 1))


# ---------------------------------------------------------------------- reduce_scatter
def run_reduce_scatter(comm: mpicomm.Communicator, backend: Backend, dtype: str,
                       algorithm: str, rows_per_rank: int, trailing: tuple[int, ...],
                       op: str) -> None:
    p, r = comm.size, comm.rank
    shape = (p * rows_per_rank, *trailing)
    inputs = all_inputs(shape, dtype, p, seed_of("rs", rows_per_rank, trailing, dtype, op))
    x = make(backend, inputs[r], dtype)
    before = raw_bytes(x)
    result = mpicomm.reduce_scatter(x, op=op, algorithm=algorithm, comm=comm)
    full = reference_reduce(inputs, op)
    expected = full[r * rows_per_rank:(r + 1) * rows_per_rank]
    assert_kind(result, x, expected.shape)
    assert_values(backend, result, expected, dtype, exact=expected_exact(op, dtype))
    assert_untouched(x, before)
    assert_not_aliased(result, x)
    # every rank's block, gathered, is the whole reduction (so all ranks agree on it)
    gathered = mpicomm.allgather(result, comm=comm)
    assert_values(backend, gathered, full, dtype, exact=expected_exact(op, dtype))


@pytest.mark.parametrize(("rows", "trailing"), [(1, ()), (3, (2,))], ids=str)
@pytest.mark.parametrize("algorithm", ALGORITHMS["reduce_scatter"])
@pytest.mark.parametrize(("backend", "dtype"), cases())
def test_reduce_scatter_every_dtype(comm, backend, dtype, algorithm, rows, trailing):
    for op in ops_for(dtype):
        run_reduce_scatter(comm, backend, dtype, algorithm, rows, trailing, op)


@pytest.mark.parametrize(("rows", "trailing"),
                         [(0, ()), (1, ()), (2, ()), (7, ()), (20_001, ()), (0, (3,)),
                          (5, (2, 3))], ids=str)
@pytest.mark.parametrize("algorithm", ALGORITHMS["reduce_scatter"])
@pytest.mark.parametrize(("backend", "dtype"), cases(SIZE_DTYPES))
def test_reduce_scatter_every_size(comm, backend, dtype, algorithm, rows, trailing):
    for op in ops_for(dtype):
        run_reduce_scatter(comm, backend, dtype, algorithm, rows, trailing, op)


# ---------------------------------------------------------------------- auto, layouts
@pytest.mark.parametrize("n", [1, 1000, 300_000])
def test_auto_algorithm_is_correct(comm, n):
    inputs = all_inputs((n,), "float32", comm.size, seed_of("auto", n))
    x = inputs[comm.rank].astype(np.float32)
    np.testing.assert_array_equal(mpicomm.allreduce(x, comm=comm),
                                  reference_reduce(inputs, "sum").astype(np.float32))
    np.testing.assert_array_equal(mpicomm.allgather(x, comm=comm),
                                  np.concatenate(inputs).astype(np.float32))
    np.testing.assert_array_equal(mpicomm.broadcast(x, root=comm.size - 1, comm=comm),
                                  inputs[-1].astype(np.float32))
    np.testing.assert_array_equal(mpicomm.allgatherv(x[:comm.rank], comm=comm),
                                  np.concatenate([a[:i] for i, a in enumerate(inputs)])
                                  .astype(np.float32))


@pytest.mark.parametrize("algorithm", ALGORITHMS["allreduce"])
def test_non_contiguous_inputs(comm, algorithm):
    import torch

    inputs = all_inputs((6, 8), "float64", comm.size, seed_of("strided"))
    expected = reference_reduce(inputs, "sum")
    a = inputs[comm.rank].copy()
    for view, want in ((a[:, ::2], expected[:, ::2]), (a.T, expected.T)):
        got = mpicomm.allreduce(view, algorithm=algorithm, comm=comm)
        np.testing.assert_array_equal(got, want)
        assert got.flags.c_contiguous
    t = torch.from_numpy(a).t()
    got = mpicomm.allreduce(t, algorithm=algorithm, comm=comm)
    np.testing.assert_array_equal(got.numpy(), expected.T)
    gathered = mpicomm.allgather(a[::2], comm=comm)
    np.testing.assert_array_equal(gathered, np.concatenate([x[::2] for x in inputs]))


def test_torch_requires_grad_input(comm):
    import torch

    x = torch.full((5,), float(comm.rank), requires_grad=True)
    result = mpicomm.allreduce(x, comm=comm)
    assert not result.requires_grad
    assert torch.equal(result, torch.full((5,), float(sum(range(comm.size)))))


@pytest.mark.parametrize("segment_bytes", [8, 24])
@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_segmented_rings(comm, monkeypatch, dtype, segment_bytes):
    """Tiny ring segments: many messages per block, pipelined, still exact."""
    monkeypatch.setenv("MPICOMM_RING_SEGMENT_BYTES", str(segment_bytes))
    backend = cases([dtype])[0].values[0]
    p = comm.size
    for n in (1, 2 * p + 3, 101):
        inputs = all_inputs((n,), dtype, p, seed_of("seg", n, dtype))
        x = make(backend, inputs[comm.rank], dtype)
        for op in ("sum", "max"):
            total = reference_reduce(inputs, op)
            assert_values(backend, mpicomm.allreduce(x, op=op, algorithm="ring", comm=comm),
                          total, dtype)
        assert_values(backend, mpicomm.allgather(x, algorithm="ring", comm=comm),
                      np.concatenate(inputs), dtype)
        assert_values(backend, mpicomm.broadcast(x, root=p // 2, algorithm="scatter_allgather",
                                                 comm=comm), inputs[p // 2], dtype)
        rows = [(r * 7) % 5 for r in range(p)]
        part = [a[:k] for a, k in zip(inputs, rows)]
        assert_values(backend, mpicomm.allgatherv(x[:rows[comm.rank]], comm=comm),
                      np.concatenate(part), dtype)
        xs = make(backend, np.concatenate([inputs[comm.rank]] * p), dtype)
        assert_values(backend, mpicomm.reduce_scatter(xs, algorithm="ring", comm=comm),
                      reference_reduce(inputs, "sum"), dtype)


def test_plain_communicator_without_checks(mpi_size):
    """The unchecked path (no call description exchange) gives the same results."""
    from mpi4py import MPI

    plain = mpicomm.Communicator(MPI.COMM_WORLD.Dup(), check=False)
    try:
        x = np.arange(10, dtype=np.int32) * (plain.rank + 1)
        total = sum(range(1, mpi_size + 1))
        for algorithm in ALGORITHMS["allreduce"]:
            np.testing.assert_array_equal(
                mpicomm.allreduce(x, algorithm=algorithm, comm=plain), np.arange(10) * total)
    finally:
        plain.free()


# ---------------------------------------------------------------------- out=
def test_out_in_place_allreduce_and_broadcast(comm):
    import torch

    for wrap in (np.asarray, torch.from_numpy):
        buf = wrap(np.full(7, comm.rank + 1, dtype=np.float32))
        result = mpicomm.allreduce(buf, op="sum", algorithm="ring", comm=comm, out=buf)
        assert result is buf
        np.testing.assert_array_equal(np.asarray(buf), np.full(7, comm.size * (comm.size + 1)
                                                               / 2, dtype=np.float32))
        buf = wrap(np.full((2, 3), comm.rank, dtype=np.int32))
        result = mpicomm.broadcast(buf, root=comm.size - 1, comm=comm, out=buf)
        assert result is buf
        np.testing.assert_array_equal(np.asarray(buf), np.full((2, 3), comm.size - 1))


@pytest.mark.parametrize("algorithm", ALGORITHMS["allreduce"])
def test_out_preallocated_every_collective(comm, algorithm):
    p, r = comm.size, comm.rank
    x = np.arange(2 * p, dtype=np.int64) + 10 * r
    before = x.copy()
    out = np.empty_like(x)
    assert mpicomm.allreduce(x, algorithm=algorithm, comm=comm, out=out) is out
    np.testing.assert_array_equal(out, p * np.arange(2 * p) + 10 * sum(range(p)))
    out = np.empty(2 * p * p, dtype=np.int64)
    assert mpicomm.allgather(x, comm=comm, out=out) is out
    np.testing.assert_array_equal(out, np.concatenate([np.arange(2 * p) + 10 * q
                                                       for q in range(p)]))
    out = np.empty(2, dtype=np.int64)
    assert mpicomm.reduce_scatter(x, comm=comm, out=out) is out
    np.testing.assert_array_equal(out, p * np.arange(2 * r, 2 * r + 2) + 10 * sum(range(p)))
    out = np.empty_like(x)
    assert mpicomm.broadcast(x, root=0, comm=comm, out=out) is out
    np.testing.assert_array_equal(out, np.arange(2 * p))
    out = np.empty(sum(range(p)), dtype=np.int64)
    assert mpicomm.allgatherv(x[:r], comm=comm, out=out) is out
    np.testing.assert_array_equal(out, np.concatenate([np.arange(q) + 10 * q for q in range(p)]))
    np.testing.assert_array_equal(x, before)


@pytest.mark.parametrize("algorithm", ALGORITHMS["allgather"])
def test_allgather_in_place_from_a_slice_of_out(comm, algorithm):
    """The input may already sit in its slot of ``out`` (MPI_IN_PLACE style)."""
    p, r = comm.size, comm.rank
    out = np.full((3 * p, 2), -1, dtype=np.int32)
    mine = out[3 * r:3 * r + 3]
    mine[:] = np.arange(6, dtype=np.int32).reshape(3, 2) + 100 * r
    assert mpicomm.allgather(mine, algorithm=algorithm, comm=comm, out=out) is out
    expected = np.concatenate([np.arange(6).reshape(3, 2) + 100 * q for q in range(p)])
    np.testing.assert_array_equal(out, expected)
