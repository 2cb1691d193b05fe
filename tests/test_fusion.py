"""mpicomm.fusion (grouping + persistent layouts) and Strategy.aggregate_into."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpicomm.fusion import Layout, LayoutCache, group
from mpicomm.strategies import (
    Dense,
    GTopK,
    PowerSGDAllreduce,
    QSGDAllgather,
    SignAllgather,
    TopKAllgather,
)


# ---------------------------------------------------------------------- grouping
def test_group_consecutive_by_kind_and_cap():
    sizes = [4, 4, 4, 8, 4, 4]
    kinds = ["a", "a", "b", "b", "a", "a"]
    assert group(sizes, kinds, 8) == [[0, 1], [2], [3], [4, 5]]
    assert group(sizes, kinds, None) == [[0, 1], [2, 3], [4, 5]]
    assert group(sizes, None, 8) == [[0, 1], [2], [3], [4, 5]]
    assert group(sizes, None, None) == [[0, 1, 2, 3, 4, 5]]


def test_group_per_kind_keeps_one_open_group_per_kind():
    sizes = [4, 4, 4, 4, 4]
    kinds = ["a", "b", "a", "b", "a"]
    assert group(sizes, kinds, None, consecutive=False) == [[0, 2, 4], [1, 3]]
    assert group(sizes, kinds, 8, consecutive=False) == [[0, 2], [1, 3], [4]]


def test_group_large_items_and_edges():
    assert group([], None, 8) == []
    assert group([100, 1, 1], None, 8) == [[0], [1, 2]]  # larger than the cap: alone
    assert group([0, 0, 0], None, 1) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="cap"):
        group([1], None, 0)


# ---------------------------------------------------------------------- layouts
def test_layout_pack_is_persistent_and_round_trips():
    ts = [torch.arange(6.0).view(2, 3), torch.tensor([7.0]), torch.arange(4.0).view(2, 2).t()]
    layout = Layout([t.shape for t in ts], torch.float32, torch.device("cpu"))
    assert layout.nbytes == 0
    flat = layout.pack(ts)
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 7, 0, 2, 1, 3] and layout.nbytes == 44
    ptr = flat.data_ptr()
    flat2 = layout.pack([t * 2 for t in ts])
    assert flat2.data_ptr() == ptr  # refilled in place, never reallocated
    out = [torch.empty_like(t) for t in ts]
    layout.unpack(out)
    for o, t in zip(out, ts):
        assert torch.equal(o, 2 * t)
    views = layout.views()
    assert [tuple(v.shape) for v in views] == [(2, 3), (1,), (2, 2)]
    assert all(v.data_ptr() >= ptr for v in views)


def test_layout_cache_replaces_a_changed_layout():
    cache = LayoutCache()
    a = [torch.ones(3), torch.ones(2)]
    first = cache.get("x", a)
    assert cache.get("x", [torch.zeros(3), torch.zeros(2)]) is first
    assert cache.get("x", [torch.ones(4), torch.ones(2)]) is not first
    assert cache.get("x", [torch.ones(4, dtype=torch.float64), torch.ones(2)]).dtype \
        == torch.float64
    assert len(cache) == 1
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


# ---------------------------------------------------------------------- aggregate_into
SHAPES = [(16, 12), (12,), (3, 4, 5), (1,), (30,)]


def grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    out[2] = out[2].transpose(0, 2)  # a non-contiguous gradient
    return out


FACTORIES = {
    "dense": lambda: Dense(fusion_bytes=1000),
    "dense-one": lambda: Dense(fusion_bytes=8),
    "topk": lambda: TopKAllgather(density=0.2, fusion_bytes=600),
    "gtopk": lambda: GTopK(density=0.2),
    "qsgd": lambda: QSGDAllgather(bits=4, bucket_size=16),
    "sign": lambda: SignAllgather(),
    "powersgd": lambda: PowerSGDAllreduce(rank=1),
}


@pytest.mark.mpi
@pytest.mark.parametrize("which", list(FACTORIES))
def test_aggregate_into_equals_aggregate(comm, which):
    """Bit for bit, over steps (error feedback included), with persistent buffers that
    are refilled rather than reallocated after the first step."""
    fresh, inplace = FACTORIES[which]().bind(comm), FACTORIES[which]().bind(comm)
    names = [f"p{i}" for i in range(len(SHAPES))]
    held = None
    for step in range(3):
        g = grads(comm.rank, step)
        want = fresh.aggregate(g, names)
        mine = [t.clone() for t in g]
        inplace.aggregate_into(mine, names)
        for w, m in zip(want, mine):
            assert torch.equal(w, m)
        ptrs = sorted(layout.flat.data_ptr() for layout in inplace.buffers._layouts.values())
        if step == 0:
            held = (inplace.buffers.nbytes, ptrs)
        assert (inplace.buffers.nbytes, ptrs) == held
    assert inplace.stats.calls == fresh.stats.calls == 3
    assert inplace.stats.sent_bytes == fresh.stats.sent_bytes


@pytest.mark.mpi
def test_aggregate_into_single_contiguous_tensor_needs_no_buffer(comm):
    s = Dense(fusion_bytes=8).bind(comm)
    t = torch.full((1000,), float(comm.rank), dtype=torch.float64)
    ptr = t.data_ptr()
    s.aggregate_into([t], ["w"])
    assert t.data_ptr() == ptr and s.buffers.nbytes == 0
    assert torch.all(t == (comm.size - 1) / 2)


@pytest.mark.mpi
def test_aggregate_results_never_alias_persistent_buffers(comm):
    s = Dense().bind(comm)
    a = [torch.ones(3), torch.ones(4)]
    s.aggregate_into([t.clone() for t in a], ["a", "b"])
    first = s.aggregate(a, ["a", "b"])
    s.aggregate_into([t * 5 for t in a], ["a", "b"])
    assert all(torch.all(r == 1) for r in first)


def test_aggregate_into_wants_torch_tensors():
    with pytest.raises(TypeError, match="torch tensors"):
        Dense().aggregate_into([np.ones(3)], ["a"])


@pytest.mark.mpi
@pytest.mark.parametrize("set_to_none", [False, True])
def test_gradient_sync_keeps_grads_in_persistent_bucket_views(comm, set_to_none):
    """After the first step .grad is a view of the bucket's flat buffer: the same memory
    every step, fused by the strategy without a pack buffer, and still the exact
    average (compared with a plain allreduce of the local gradients)."""
    import mpicomm
    from mpicomm.torch import GradientSync

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(),
                                torch.nn.Linear(5, 3)).double()
    with GradientSync(model, comm=comm, bucket_mb=1.0) as sync:
        ptrs = None
        for step in range(3):
            model.zero_grad(set_to_none=set_to_none)
            x = torch.full((4, 6), float(comm.rank + step), dtype=torch.float64)
            with sync.no_sync():
                model(x).square().sum().backward()
            local = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=set_to_none)
            model(x).square().sum().backward()
            assert sync.wait()
            for p, g in zip(model.parameters(), local):
                want = mpicomm.allreduce(g, op="avg", comm=comm)
                torch.testing.assert_close(p.grad, want, rtol=1e-12, atol=1e-12)
            now = [p.grad.data_ptr() for p in model.parameters()]
            ptrs = ptrs or now
            assert now == ptrs
            storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
            assert len(storages) == 1  # one bucket, one flat buffer
        assert sync.strategy.buffers.nbytes == 0  # adjacent views: nothing to pack


@pytest.mark.mpi
@pytest.mark.gpu
def test_cuda_gradient_sync_reuses_its_buffers(comm):
    """On a GPU: the bucket views and (under a non-CUDA-aware MPI) the pinned staging
    buffers are the same memory at every step after the first."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    import mpicomm
    from mpicomm.staging import staging_pool
    from mpicomm.torch import GradientSync

    device = torch.device("cuda", comm.local_rank % torch.cuda.device_count())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8)).to(device)
    with GradientSync(model, comm=comm, bucket_mb=0.01) as sync:
        seen = None
        for step in range(3):
            model.zero_grad(set_to_none=True)
            x = torch.full((4, 64), float(comm.rank + step), device=device)
            with sync.no_sync():
                model(x).square().sum().backward()
            local = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            model(x).square().sum().backward()
            assert sync.wait()
            for p, g in zip(model.parameters(), local):
                want = mpicomm.allreduce(g.cpu(), op="avg", comm=comm)
                torch.testing.assert_close(p.grad.cpu(), want, rtol=1e-5, atol=1e-6)
            state = ([p.grad.data_ptr() for p in model.parameters()],
                     staging_pool(sync._tcomm.resources).nbytes)
            if step > 0:
                assert state == seen
            seen = state


def test_fusion_benchmark_suite_runs(tmp_path):
    """``python -m mpicomm.bench fusion`` (tiny, one process): all four paths timed."""
    import json

    from mpicomm.bench.__main__ import main

    out = tmp_path / "fusion.json"
    assert main(["fusion", "--buckets", "2", "--bucket-mb", "0.05", "--repeats", "1",
                 "--warmup", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["fresh", "packed", "views", "raw"]
    assert all(r["time_ms"] >= 0 for r in rows)
