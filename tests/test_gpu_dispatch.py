"""Device-correct CUDA synchronization, checked on the CPU with stand-in device objects.

With tensors on ``cuda:N`` (N != 0) every wait must target *that* device's current
stream, fresh device memory must be synchronized before MPI writes into it, cupy scratch
must be allocated on the array's device, and GradientSync's communication thread must
make the model's device its current one. Real CUDA runs of the same paths are the
``gpu``-marked tests in test_buffers.py / test_strategies.py / test_torch_sync.py.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpicomm import cudampi, p2p
from mpicomm.arrayops import ArrayOps, TorchOps
from mpicomm.buffers import BufferInfo
from mpicomm.torch import GradientSync, comm_thread
from mpicomm.torch.buckets import Bucket

CUDA1 = torch.device("cuda", 1)


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def stream(self, device: Any = None) -> Any:
        log = self

        class Stream:
            def synchronize(self) -> None:
                log.events.append(("sync", device))

        return Stream()


def fake_torch(log: Log) -> Any:
    """What TorchOps uses of torch: empty(), cuda.current_stream(device)."""
    def empty(n: int, dtype: Any = None, device: Any = None) -> Any:
        log.events.append(("empty", torch.device(device)))
        return types.SimpleNamespace(device=torch.device(device), numel=n)

    return types.SimpleNamespace(empty=empty, cuda=types.SimpleNamespace(
        current_stream=log.stream))


# ---------------------------------------------------------------------- torch
def test_torch_ops_wait_on_the_tensors_own_device():
    log = Log()
    ops = TorchOps(device=True)
    ops.torch = fake_torch(log)
    dst = types.SimpleNamespace(device=CUDA1, copy_=lambda src: log.events.append(("copy",
                                                                                 None)))
    ops.copy_(dst, None)
    assert log.events == [("copy", None), ("sync", CUDA1)]


def test_torch_ops_fresh_device_memory_is_synchronized_before_use():
    log = Log()
    ops = TorchOps(device=True)
    ops.torch = fake_torch(log)
    a = types.SimpleNamespace(device=CUDA1, dtype=torch.float32)
    ops.empty_like(a, 8)
    ops.empty(4, torch.uint8, device=CUDA1)
    assert log.events == [("empty", CUDA1), ("sync", CUDA1)] * 2


def test_host_torch_ops_never_touch_cuda(monkeypatch):
    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("a host operation asked CUDA for a stream")

    monkeypatch.setattr(torch.cuda, "current_stream", boom)
    ops = TorchOps(device=False)
    acc = ops.empty_like(torch.ones(3), 3)
    ops.copy_(acc, torch.ones(3))
    ops.reduce_(acc, torch.ones(3), "sum")
    assert acc.tolist() == [2.0] * 3


def test_staged_synchronize_uses_the_tensors_device(monkeypatch):
    log = Log()
    monkeypatch.setattr(torch.cuda, "current_stream", log.stream)
    x = types.SimpleNamespace(device=CUDA1)
    cudampi.synchronize(x, BufferInfo("torch", "float32", (1,), "cuda:1", 4))
    cudampi.synchronize(x, BufferInfo("torch", "float32", (1,), "cpu", 4))  # host: no-op
    assert log.events == [("sync", CUDA1)]


# ---------------------------------------------------------------------- cupy
class FakeCupy:
    """A cupy stand-in: a current device switched by ``with array.device``, per-device
    current streams, allocations recorded with the device current at the time."""

    def __init__(self) -> None:
        self.current = 0
        self.events: list[tuple[str, int]] = []
        fake = self

        class Device:
            def __init__(self, id: int) -> None:
                self.id = id

            def __enter__(self) -> None:
                self.saved, fake.current = fake.current, self.id

            def __exit__(self, *exc: object) -> None:
                fake.current = self.saved

        class Stream:
            def __init__(self, device: int) -> None:
                self.device = device

            def synchronize(self) -> None:
                fake.events.append(("sync", self.device))

        self.Device = Device
        self.cuda = types.SimpleNamespace(
            get_current_stream=lambda: Stream(fake.current))

    def empty(self, n: int, dtype: Any = None) -> Any:
        self.events.append(("empty", self.current))
        return self.array(self.current)

    def array(self, device: int) -> Any:
        return types.SimpleNamespace(device=self.Device(device), dtype=np.float32)


def test_cupy_scratch_lives_on_the_arrays_device():
    cp = FakeCupy()
    ops = ArrayOps(cp, device=True)
    a = cp.array(1)
    scratch = ops.empty_like(a, 16)
    assert scratch.device.id == 1
    assert cp.events == [("empty", 1), ("sync", 1)]
    assert cp.current == 0  # the caller's current device is left alone


def test_cupy_ops_wait_on_the_arrays_device():
    cp = FakeCupy()
    cp.copyto = lambda dst, src: cp.events.append(("copy", cp.current))
    ops = ArrayOps(cp, device=True)
    ops.copy_(cp.array(1), cp.array(1))
    assert cp.events == [("copy", 0), ("sync", 1)]


def test_cupy_synchronize_uses_the_arrays_device(monkeypatch):
    cp = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    cudampi.synchronize(cp.array(1), BufferInfo("cupy", "float32", (1,), "cuda:1", 4))
    assert cp.events == [("sync", 1)]


# ---------------------------------------------------------------------- sparse wire
def test_direct_wire_receive_synchronizes_before_mpi_writes(monkeypatch):
    """CUDA-aware path: the fresh torch.empty block may still be in use by a kernel
    queued earlier on the stream (caching allocator); MPI must not write before it is
    done."""
    log = Log()
    monkeypatch.setattr(p2p, "cuda_aware", lambda: True)

    class Message:
        def Recv(self, spec: Any) -> None:
            log.events.append(("recv", spec[0].device))

    class P2P:
        def Mprobe(self, source: int, tag: int, status: Any) -> Any:
            status.Set_elements(MPI.BYTE, 5)
            return Message()

    comm = types.SimpleNamespace(p2p=P2P(), traffic=types.SimpleNamespace(recv_bytes=0),
                                 resources={}, wait_poll_s=None)
    wire = p2p.Wire(comm, CUDA1)
    assert wire.direct and not wire.staged
    wire._ops.torch = fake_torch(log)
    got = wire.recv(0, 7)
    assert got.device == CUDA1 and comm.traffic.recv_bytes == 5
    assert log.events == [("empty", CUDA1), ("sync", CUDA1), ("recv", CUDA1)]


# ---------------------------------------------------------------------- GradientSync
def test_communication_thread_binds_the_models_device(monkeypatch):
    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    host = Bucket(0, [], ["a"], 4, [])
    assert comm_thread.bind_thread_device([host]) is None and calls == []
    on_gpu = [host, Bucket(1, [], ["b"], 4, [CUDA1]),
              Bucket(2, [], ["c"], 4, [torch.device("cuda", 2)])]
    assert comm_thread.bind_thread_device(on_gpu) == CUDA1
    assert calls == [CUDA1]


@pytest.mark.mpi
def test_gradient_sync_thread_asks_for_its_device(comm, monkeypatch):
    seen: list[str] = []
    real = comm_thread.bind_thread_device

    def spy(buckets: list[Any]) -> Any:
        seen.append(threading.current_thread().name)
        return real(buckets)

    monkeypatch.setattr(comm_thread, "bind_thread_device", spy)
    model = torch.nn.Linear(3, 2)
    with GradientSync(model, comm=comm) as sync:
        model(torch.ones(1, 3)).sum().backward()
        assert sync.wait()
    assert seen == ["mpicomm-gradsync"]


@pytest.mark.mpi
def test_a_failing_device_binding_is_raised_by_wait(comm, monkeypatch):
    def broken(buckets: list[Any]) -> None:
        raise RuntimeError("cannot bind the device")

    monkeypatch.setattr(comm_thread, "bind_thread_device", broken)
    model = torch.nn.Linear(3, 2)
    sync = GradientSync(model, comm=comm)
    try:
        model(torch.ones(1, 3)).sum().backward()
        with pytest.raises(RuntimeError, match="cannot bind"):
            sync.wait()
    finally:
        sync._shutdown(free=True)


# ---------------------------------------------------------------------- markers
def test_every_cuda_case_carries_the_gpu_marker():
    """``pytest -m gpu`` must select every CUDA parameter (run on a GPU machine)."""
    from . import arrays
    from .test_buffers import needs_cuda, needs_cupy

    for param in arrays.cases():
        backend = param.values[0]
        names = {m.name for m in param.marks}
        assert ("gpu" in names) == (backend.name in ("torch-cuda", "cupy")), param.id

    def probe() -> None:
        pass

    for wrap in (needs_cuda, needs_cupy):
        marks = {m.name for m in getattr(wrap(probe), "pytestmark", [])}
        assert {"gpu", "skipif"} <= marks
