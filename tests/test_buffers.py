"""The buffer layer: inspection, CUDA-awareness decision, conversions, staging, Buffer.

Serial tests; the CUDA ones (staged round trips through pinned memory, cupy) are
skipped with a reason where there is no GPU, and run unchanged where there is one.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import numpy as np
import pytest
import torch

import mpicomm
from mpicomm import cudampi
from mpicomm.arrayops import ops_for
from mpicomm.buffers import Buffer, BufferInfo, framework_of, from_torch, inspect, to_torch
from mpicomm.cudampi import cuda_aware
from mpicomm.staging import StagingPool, staging_pool

HAVE_CUDA = torch.cuda.is_available()


def needs_cuda(test: Any) -> Any:
    """Marks a test ``gpu`` (``pytest -m gpu`` selects it) and skips it without CUDA."""
    skip = pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device "
                              "(torch.cuda.is_available() is False)")
    return pytest.mark.gpu(skip(test))


def _have_cupy() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - any failure means: no usable GPU
        return False


def needs_cupy(test: Any) -> Any:
    """Marks a test ``gpu`` and skips it without cupy and a CUDA device."""
    skip = pytest.mark.skipif(not _have_cupy(), reason="cupy with a CUDA device is absent")
    return pytest.mark.gpu(skip(test))


@pytest.fixture
def fresh_probe(monkeypatch):
    """Clear the cached CUDA-awareness decision before and after a test."""
    cudampi._probe_cuda_aware.cache_clear()
    cudampi._log_decision_once.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    cudampi._probe_cuda_aware.cache_clear()
    cudampi._log_decision_once.cache_clear()


# ---------------------------------------------------------------------- inspection
def test_framework_of():
    assert framework_of(np.zeros(2)) == "numpy"
    assert framework_of(np.zeros(())) == "numpy"
    assert framework_of(torch.zeros(2)) == "torch"
    for bad in ([1, 2], 3.0, 1, None, "x", np.float32(1), memoryview(b"ab"),
                torch.Size([2])):
        with pytest.raises(TypeError, match="expected a numpy.ndarray"):
            framework_of(bad)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "uint8", "int16",
                                   "int32", "int64"])
def test_inspect_numpy(dtype):
    info = inspect(np.zeros((3, 4), dtype=dtype))
    size = np.dtype(dtype).itemsize
    assert info == BufferInfo("numpy", dtype, (3, 4), "cpu", size)
    assert (info.numel, info.nbytes) == (12, 12 * size)
    assert info.is_float == dtype.startswith("float")
    assert not info.is_cuda


def test_inspect_torch():
    info = inspect(torch.zeros(5, 0, 2, dtype=torch.bfloat16))
    assert info == BufferInfo("torch", "bfloat16", (5, 0, 2), "cpu", 2)
    assert (info.numel, info.nbytes, info.is_float) == (0, 0, True)
    info = inspect(torch.tensor(3, dtype=torch.int64))
    assert (info.shape, info.numel, info.nbytes, info.is_float) == ((), 1, 8, False)


def test_inspect_rejects_unsupported():
    for bad in (np.zeros(2, np.complex64), np.zeros(2, bool), np.zeros(2, object),
                np.zeros(2, "U3"), torch.zeros(2, dtype=torch.complex64),
                torch.zeros(2, dtype=torch.bool)):
        with pytest.raises(TypeError, match="unsupported dtype"):
            inspect(bad)
    with pytest.raises(TypeError, match="unsupported torch device"):
        inspect(torch.zeros(2, device="meta"))
    with pytest.raises(TypeError):
        inspect([1.0])


@needs_cuda
def test_inspect_cuda_tensor():
    info = inspect(torch.zeros(3, device="cuda"))
    assert info.device.startswith("cuda") and info.is_cuda


# ---------------------------------------------------------------------- CUDA awareness
@pytest.mark.parametrize(("setting", "library", "expected"), [
    ("0", (True, "says yes"), False), ("0", (False, "says no"), False),
    ("1", (None, "cannot be asked"), True), ("1", (True, "says yes"), True)])
def test_cuda_aware_env_forces_the_decision(fresh_probe, setting, library, expected):
    fresh_probe.setattr(cudampi, "_query_library", lambda: library)
    fresh_probe.setenv("MPICOMM_CUDA_AWARE", setting)
    assert cuda_aware() is expected
    aware, why = cudampi._probe_cuda_aware()
    assert aware is expected and f"MPICOMM_CUDA_AWARE={setting}" in why


def test_forced_cuda_aware_is_refused_when_the_library_denies(fresh_probe):
    """The H100 run's segfault: MPICOMM_CUDA_AWARE=1 on an MPI whose
    MPIX_Query_cuda_support() returns 0 must never hand device pointers to it."""
    fresh_probe.setattr(cudampi, "_query_library",
                        lambda: (False, "MPIX_Query_cuda_support() returned 0"))
    fresh_probe.setenv("MPICOMM_CUDA_AWARE", "1")
    with pytest.raises(ValueError, match=r"MPICOMM_CUDA_AWARE=1.*returned 0.*pinned"):
        cuda_aware()
    with pytest.raises(ValueError, match="denies CUDA support"):  # not cached: asked again
        cuda_aware()
    fresh_probe.setenv("MPICOMM_CUDA_AWARE", "auto")
    assert cuda_aware() is False


def test_forced_cuda_aware_on_this_mpi(fresh_probe):
    """The real library of this machine: where it denies CUDA support, forcing is refused;
    host buffers never ask, so they keep working under the same setting."""
    fresh_probe.setenv("MPICOMM_CUDA_AWARE", "1")
    answer, _ = cudampi._query_library()
    if answer is False:
        with pytest.raises(ValueError, match="denies CUDA support"):
            cuda_aware()
    else:
        assert cuda_aware() is True
    b = Buffer(torch.ones(3))
    assert not b.staged and b.input_view().tolist() == [1.0] * 3


def test_cuda_aware_auto_on_this_mpi(fresh_probe):
    """Auto asks the library; the MPICH wheel without CUDA says no, with a reason."""
    fresh_probe.setenv("MPICOMM_CUDA_AWARE", "auto")
    aware, why = cudampi._probe_cuda_aware()
    assert why
    if "MPICH" in mpicomm.comm.MPI.Get_library_version() and not HAVE_CUDA:
        assert aware is False
        assert "MPIX_Query_cuda_support" in why or "assuming not" in why
    assert cuda_aware() is aware


def test_cuda_aware_unset_means_auto(fresh_probe):
    fresh_probe.delenv("MPICOMM_CUDA_AWARE", raising=False)
    auto = cudampi._probe_cuda_aware()
    cudampi._probe_cuda_aware.cache_clear()
    fresh_probe.setenv("MPICOMM_CUDA_AWARE", "AUTO")
    assert cudampi._probe_cuda_aware() == auto


@pytest.mark.parametrize("bad", ["yes", "2", "cuda"])
def test_cuda_aware_invalid_env_value(fresh_probe, bad):
    fresh_probe.setenv("MPICOMM_CUDA_AWARE", bad)
    with pytest.raises(ValueError, match="MPICOMM_CUDA_AWARE"):
        cuda_aware()


def test_cuda_aware_decision_is_cached_and_logged_once(fresh_probe, caplog):
    fresh_probe.setenv("MPICOMM_CUDA_AWARE", "0")
    with caplog.at_level(logging.INFO, logger="mpicomm.buffers"):
        assert cuda_aware() is False
        fresh_probe.setenv("MPICOMM_CUDA_AWARE", "1")  # cached: no longer read
        assert cuda_aware() is False
    messages = [r.getMessage() for r in caplog.records if "CUDA buffers" in r.getMessage()]
    assert len(messages) == 1 and "staging through pinned host memory" in messages[0]


# ---------------------------------------------------------------------- conversions
def test_to_torch_from_torch_are_zero_copy_for_numpy():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = to_torch(a)
    assert isinstance(t, torch.Tensor) and t.shape == (2, 3) and t.dtype == torch.float32
    t[0, 0] = 42
    assert a[0, 0] == 42  # shares memory
    back = from_torch(t, like=a)
    assert isinstance(back, np.ndarray) and np.shares_memory(back, a)
    back[1, 2] = -1
    assert t[1, 2] == -1


def test_to_torch_from_torch_identity_and_copies():
    t = torch.ones(3)
    assert to_torch(t) is t
    assert from_torch(t, like=torch.zeros(1)) is t
    strided = np.arange(10.0)[::2]
    converted = to_torch(strided)  # made contiguous: a copy
    assert converted.tolist() == strided.tolist()
    converted[0] = 99
    assert strided[0] == 0
    grad = torch.ones(2, requires_grad=True)
    assert isinstance(from_torch(grad, like=np.zeros(1)), np.ndarray)
    with pytest.raises(TypeError):
        to_torch([1, 2])
    with pytest.raises(TypeError):
        from_torch(t, like=[1])


@needs_cupy
def test_cupy_torch_round_trip_shares_memory():
    import cupy

    c = cupy.arange(4, dtype=cupy.float32)
    t = to_torch(c)
    t[0] = 7
    assert float(c[0]) == 7
    back = from_torch(t, like=c)
    assert isinstance(back, cupy.ndarray) and back.data.ptr == c.data.ptr


# ---------------------------------------------------------------------- array ops
def test_numpy_ops():
    ops = ops_for("numpy", False)
    assert ops.framework == "numpy" and ops_for("cupy", False) is ops
    a, b = np.array([1.0, 5.0, -2.0]), np.array([4.0, 2.0, -3.0])
    for op, want in (("sum", [5, 7, -5]), ("avg", [5, 7, -5]), ("max", [4, 5, -2]),
                     ("min", [1, 2, -3])):
        acc = a.copy()
        ops.reduce_(acc, b, op)
        np.testing.assert_array_equal(acc, want)
    out = np.empty(3)
    ops.combine_(out, a, b, "max")  # out of place: inputs untouched
    np.testing.assert_array_equal(out, [4, 5, -2])
    np.testing.assert_array_equal(a, [1.0, 5.0, -2.0])
    ops.combine_(a, a, b, "sum")  # out may be an input
    np.testing.assert_array_equal(a, [5, 7, -5])
    ops.divide_(acc := np.array([3.0, 6.0]), 3)
    np.testing.assert_array_equal(acc, [1.0, 2.0])
    strided = np.arange(8)[::2]
    flat = ops.flat(strided)
    assert flat.flags.c_contiguous and flat.tolist() == [0, 2, 4, 6]
    whole = np.arange(6).reshape(2, 3)
    assert np.shares_memory(ops.flat(whole), whole)
    assert ops.shares_memory(whole[0], whole) and not ops.shares_memory(whole, whole.copy())
    assert ops.itemsize(np.zeros(1, np.int16)) == 2
    assert ops.data_ptr(whole) == whole.__array_interface__["data"][0]
    assert ops.msg(whole)[0] is whole


def test_torch_ops():
    ops = ops_for("torch", False)
    assert ops.framework == "torch"
    for dtype in (torch.bfloat16, torch.float16, torch.int32):
        acc = torch.tensor([1, 5, -2], dtype=dtype)
        other = torch.tensor([4, 2, -3], dtype=dtype)
        ops.reduce_(acc, other, "max")
        assert acc.tolist() == [4, 5, -2]
        ops.reduce_(acc, other, "min")
        assert acc.tolist() == [4, 2, -3]
        ops.reduce_(acc, other, "sum")
        assert acc.tolist() == [8, 4, -6]
    a, b = torch.tensor([1.0, 5.0]), torch.tensor([4.0, 2.0])
    out = torch.empty(2)
    ops.combine_(out, a, b, "min")
    assert out.tolist() == [1.0, 2.0] and a.tolist() == [1.0, 5.0]
    ops.combine_(out, a, b, "avg")  # avg reduces as a sum
    assert out.tolist() == [5.0, 7.0]
    acc = torch.tensor([3.0, 6.0])
    ops.divide_(acc, 3)
    assert acc.tolist() == [1.0, 2.0]
    base = torch.arange(6)
    assert ops.shares_memory(base[:3], base[2:]) and not ops.shares_memory(base[:3], base[3:])
    assert not ops.shares_memory(base[:0], base)
    assert ops.flat(torch.arange(6).reshape(2, 3).t()).tolist() == [0, 3, 1, 4, 2, 5]
    assert ops.empty(4, torch.float16).dtype == torch.float16
    assert ops.concatenate([base[:2], base[4:]]).tolist() == [0, 1, 4, 5]


def test_ops_for_unknown_framework():
    with pytest.raises(TypeError, match="framework"):
        ops_for("jax", False)


# ---------------------------------------------------------------------- staging pool
TORCH_F32 = BufferInfo("torch", "float32", (0,), "cuda:0", 4)


class CountingAllocator:
    """Stands in for pinned allocation (which needs CUDA) and records every request."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, info: BufferInfo, numel: int) -> Any:
        self.sizes.append(numel)
        return torch.empty(numel, dtype=getattr(torch, info.dtype))


@pytest.fixture
def pool(monkeypatch) -> tuple[StagingPool, CountingAllocator]:
    allocator = CountingAllocator()
    monkeypatch.setattr(StagingPool, "_allocate", staticmethod(allocator))
    return StagingPool(), allocator


def test_staging_pool_reuses_and_grows_geometrically(pool):
    p, alloc = pool
    first = p.get(TORCH_F32, 10, "in")
    assert first.shape == (10,) and alloc.sizes == [10]
    smaller = p.get(TORCH_F32, 4, "in")
    assert smaller.shape == (4,) and smaller.data_ptr() == first.data_ptr()
    assert alloc.sizes == [10]                      # reused, nothing new
    assert p.get(TORCH_F32, 10, "in").data_ptr() == first.data_ptr()
    p.get(TORCH_F32, 11, "in")
    assert alloc.sizes == [10, 20]                  # grows to twice the old capacity
    p.get(TORCH_F32, 100, "in")
    assert alloc.sizes == [10, 20, 100]             # or to the request, if larger
    p.get(TORCH_F32, 100, "in")
    assert alloc.sizes == [10, 20, 100]
    assert p.nbytes == 100 * 4


def test_staging_pool_keys_by_slot_and_dtype(pool):
    p, alloc = pool
    a = p.get(TORCH_F32, 8, "in")
    b = p.get(TORCH_F32, 8, "out")
    c = p.get(BufferInfo("torch", "float16", (0,), "cuda:0", 2), 8, "in")
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3
    assert c.dtype == torch.float16
    assert alloc.sizes == [8, 8, 8]
    assert p.nbytes == 8 * 4 + 8 * 4 + 8 * 2


def test_staging_pool_empty_request(pool):
    p, alloc = pool
    assert p.get(TORCH_F32, 0, "in").shape == (0,)
    assert alloc.sizes == [1]


def test_staging_pool_lives_in_the_resources():
    resources: dict[str, Any] = {}
    pool = staging_pool(resources)
    assert isinstance(pool, StagingPool) and resources["staging"] is pool
    assert staging_pool(resources) is pool
    assert pool.nbytes == 0


@pytest.mark.skipif(HAVE_CUDA, reason="checks the failure without CUDA")
def test_pinned_allocation_needs_an_accelerator():
    with pytest.raises(RuntimeError):
        StagingPool().get(TORCH_F32, 4, "in")


@needs_cuda
def test_staging_pool_allocates_pinned_memory():
    held = StagingPool().get(TORCH_F32, 16, "in")
    assert held.is_pinned() and held.device.type == "cpu"


# ---------------------------------------------------------------------- Buffer (host)
def test_buffer_numpy_views_and_copies():
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = Buffer(x)
    assert not b.staged and b.info.shape == (2, 3)
    view = b.input_view()
    assert view.shape == (6,) and np.shares_memory(view, x)
    work = b.writable_copy()
    assert not np.shares_memory(work, x) and work.tolist() == list(range(6))
    out = np.empty((2, 3), np.int32)
    target = b.writable_copy(out)
    assert np.shares_memory(target, out) and out.tolist() == x.tolist()
    assert b.result_array(4).shape == (4,)
    assert np.shares_memory(b.result_array(6, out), out)
    delivered = b.deliver(work, (3, 2))
    assert delivered.shape == (3, 2) and np.shares_memory(delivered, work)
    other = np.zeros((2, 3), np.int32)
    assert b.deliver(work, (2, 3), other) is other and other.tolist() == x.tolist()


def test_buffer_torch_detaches_and_keeps_dtype():
    x = torch.arange(4, dtype=torch.float32, requires_grad=True)
    b = Buffer(x)
    work = b.writable_copy()
    assert not work.requires_grad and work.dtype == torch.float32
    assert b.empty(3).dtype == torch.float32
    result = b.deliver(work, (2, 2))
    assert isinstance(result, torch.Tensor) and result.shape == (2, 2)


def test_buffer_non_contiguous_input_is_copied():
    x = np.arange(12, dtype=np.float64).reshape(3, 4).T
    view = Buffer(x).input_view()
    assert view.flags.c_contiguous and view.tolist() == x.reshape(-1).tolist()


@pytest.mark.parametrize(("out", "error", "match"), [
    (np.empty(3, np.float64), TypeError, "float64"),
    (torch.empty(4), TypeError, "torch"),
    (np.empty(5, np.float32), ValueError, "shape"),
    (np.empty((4, 2), np.float32)[:, 0], ValueError, "contiguous"),
    ([0.0] * 4, TypeError, "expected"),
])
def test_buffer_check_out(out, error, match):
    b = Buffer(np.zeros(4, np.float32))
    with pytest.raises(error, match=match):
        b.check_out(out, (4,))
    b.check_out(None, (4,))
    b.check_out(np.empty(4, np.float32), (4,))


def test_buffer_check_out_torch_contiguity():
    b = Buffer(torch.zeros(3))
    with pytest.raises(ValueError, match="contiguous"):
        b.check_out(torch.zeros(3, 2)[:, 0], (3,))
    with pytest.raises(TypeError):
        b.check_out(torch.zeros(3, dtype=torch.float64), (3,))


# ---------------------------------------------------------------------- Buffer (CUDA)
@needs_cuda
def test_staged_cuda_tensor_round_trip(fresh_probe):
    fresh_probe.setenv("MPICOMM_CUDA_AWARE", "0")
    resources: dict[str, Any] = {}
    x = torch.arange(10, dtype=torch.float16, device="cuda").reshape(2, 5)
    b = Buffer(x, resources)
    assert b.staged
    host = b.input_view()
    assert host.device.type == "cpu" and host.is_pinned()
    assert host.tolist() == list(range(10))
    host.mul_(2)
    result = b.deliver(host, (2, 5))
    assert result.device == x.device and result.dtype == x.dtype
    assert result.cpu().tolist() == (2 * torch.arange(10.0)).reshape(2, 5).tolist()
    before = staging_pool(resources).nbytes
    Buffer(x, resources).input_view()
    assert staging_pool(resources).nbytes == before  # reused, not reallocated
    out = torch.empty_like(x)
    assert b.deliver(host, (2, 5), out) is out


@needs_cuda
def test_cuda_aware_buffer_is_not_staged(fresh_probe):
    fresh_probe.setattr(cudampi, "_query_library", lambda: (True, "stub: says yes"))
    fresh_probe.setenv("MPICOMM_CUDA_AWARE", "1")
    x = torch.ones(4, device="cuda")
    b = Buffer(x)
    assert not b.staged and b.writable_copy().device == x.device


@needs_cuda
def test_cuda_buffer_under_a_refused_forced_setting(fresh_probe):
    fresh_probe.setattr(cudampi, "_query_library", lambda: (False, "stub: says no"))
    fresh_probe.setenv("MPICOMM_CUDA_AWARE", "1")
    with pytest.raises(ValueError, match="denies CUDA support"):
        Buffer(torch.ones(4, device="cuda"))


@needs_cupy
def test_staged_cupy_round_trip(fresh_probe):
    import cupy

    fresh_probe.setenv("MPICOMM_CUDA_AWARE", "0")
    x = cupy.arange(6, dtype=cupy.float32)
    b = Buffer(x, {})
    host = b.input_view()
    assert isinstance(host, np.ndarray) and host.tolist() == list(range(6))
    result = b.deliver(host * 0 + host + 1, (2, 3))
    assert isinstance(result, cupy.ndarray) and result.shape == (2, 3)
    assert result.get().reshape(-1).tolist() == [v + 1 for v in range(6)]


# ---------------------------------------------------------------------- multi-rank
@pytest.fixture
def own_comm(comm):
    """A private duplicate of the session communicator: its staging pool starts empty,
    whatever other tests left in the shared one."""
    c = comm.dup()
    yield c
    c.free()


@pytest.mark.mpi
@needs_cuda
@pytest.mark.parametrize("aware", ["0", "1"])
def test_cuda_collectives_staged_and_direct(own_comm, fresh_probe, aware):
    """CUDA tensors in, CUDA tensors out, through staging or device pointers; the pinned
    pool is allocated once and reused by later calls. A forced ``1`` that the MPI library
    denies raises ``ValueError`` on every rank before any communication."""
    comm = own_comm
    fresh_probe.setenv("MPICOMM_CUDA_AWARE", aware)
    x = torch.full((1000,), float(comm.rank), device="cuda")
    total = float(sum(range(comm.size)))
    if aware == "1" and cudampi._query_library()[0] is False:
        before = comm.traffic.snapshot()
        with pytest.raises(ValueError, match="denies CUDA support"):
            mpicomm.allreduce(x, comm=comm)
        assert (comm.traffic - before).sent_bytes == 0
        assert staging_pool(comm.resources).nbytes == 0
        assert comm.allreduce_value(1) == comm.size  # nobody is stuck in a collective
        return
    for algorithm in ("ring", "recursive_doubling", "rabenseifner", "mpi"):
        result = mpicomm.allreduce(x, algorithm=algorithm, comm=comm)
        assert result.device == x.device
        assert torch.equal(result.cpu(), torch.full((1000,), total))
    pool_bytes = staging_pool(comm.resources).nbytes
    mpicomm.allreduce(x, comm=comm)
    assert staging_pool(comm.resources).nbytes == pool_bytes
    assert (pool_bytes > 0) == (aware == "0")


@pytest.mark.mpi
def test_host_collectives_never_stage(own_comm):
    """Host buffers never touch the pinned pool (which would need CUDA)."""
    mpicomm.allreduce(torch.ones(100), comm=own_comm)
    mpicomm.allgather(np.ones(10), comm=own_comm)
    assert staging_pool(own_comm.resources).nbytes == 0
