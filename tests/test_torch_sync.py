"""mpicomm.torch: GradientSync, DistributedOptimizer, broadcast_module, and the Timeline."""

from __future__ import annotations

import copy
import json
import threading

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpicomm.observe.timeline import Timeline
from mpicomm.strategies import Dense, Strategy, available, make
from mpicomm.torch import DistributedOptimizer, GradientSync, broadcast_module
from mpicomm.torch.buckets import make_buckets
from mpicomm.torch.replicas import describe_module_mismatch

if MPI.COMM_WORLD.Get_size() > 1:
    torch.set_num_threads(1)  # several ranks share few cores

TINY = 0.0002  # MB: a bucket per parameter or two in the small models below
TOL = dict(rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------- helpers
def mlp(seed: int, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12), torch.nn.Tanh(),
        torch.nn.Linear(12, 3),
    ).to(dtype)


def batch(step: int, rank: int, b: int = 4, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(b, 6, generator=g, dtype=dtype), torch.randn(b, 3, generator=g,
                                                                     dtype=dtype)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def global_batch(step: int, size: int, b: int = 4):
    parts = [batch(step, r, b) for r in range(size)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def assert_same_on_every_rank(comm, tensor: torch.Tensor) -> None:
    everyone = comm.allgather_object(tensor.detach().cpu().numpy())
    for r, other in enumerate(everyone):
        assert np.array_equal(other, everyone[0]), f"rank {r} differs from rank 0"


class Recording(Dense):
    """Dense averaging that remembers whether it was ever handed a non-finite value."""

    name = "recording"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.saw_nonfinite = False
        self.thread_names: set[str] = set()

    def aggregate(self, tensors, names=None):
        self.thread_names.add(threading.current_thread().name)
        self.saw_nonfinite |= not all(bool(torch.isfinite(t).all()) for t in tensors)
        return super().aggregate(tensors, names)


class AllgatherMean(Strategy):
    """A strategy written outside the library: gather every rank's vector and average."""

    name = "allgather-mean"

    def aggregate_flat(self, flat, name):
        parts = self.comm.allgather_object(flat.cpu().numpy())
        return torch.from_numpy(np.mean(np.stack(parts), axis=0)).to(flat)


class Failing(Dense):
    def aggregate(self, tensors, names=None):
        raise RuntimeError("strategy exploded")


# ---------------------------------------------------------------------- multi-rank
@pytest.mark.mpi
@pytest.mark.parametrize("bucket_mb", [TINY, 25.0])
def test_p_ranks_equal_one_process_with_p_times_the_batch(comm, bucket_mb):
    model = mlp(seed=comm.rank)  # different on every rank until rank 0's is broadcast
    reference = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    with GradientSync(model, bucket_mb=bucket_mb, comm=comm) as sync:
        if bucket_mb == TINY:
            assert len(sync.buckets) > 3
        assert torch.equal(flat_params(model), flat_params(reference))
        for step in range(5):
            opt.zero_grad()
            loss_of(model, *batch(step, comm.rank)).backward()
            assert sync.step(opt) is True
            ref_opt.zero_grad()
            loss_of(reference, *global_batch(step, comm.size)).backward()
            ref_opt.step()
        assert sync.stats.steps == 5 and sync.stats.skipped == 0
        assert sync.stats.buckets == 5 * len(sync.buckets)
    torch.testing.assert_close(flat_params(model), flat_params(reference), **TOL)
    assert not torch.equal(flat_params(model), flat_params(mlp(seed=0)))  # it did train
    assert_same_on_every_rank(comm, flat_params(model))


@pytest.mark.mpi
def test_parameters_and_buffers_come_from_rank_zero(comm):
    def make_model(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        m[1].running_mean.fill_(float(seed))
        m[1].num_batches_tracked.fill_(seed)
        return m

    model = make_model(comm.rank + 1)
    expected = make_model(1).state_dict()
    with GradientSync(model, comm=comm):
        pass
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name

    # the public helper, from another root, with a bool buffer (sent as raw bytes)
    other = make_model(comm.rank + 1)
    other.register_buffer("mask", torch.tensor([comm.rank % 2 == 0, True, False]))
    root = comm.size - 1
    broadcast_module(other, root=root, comm=comm)
    for value in other.state_dict().values():
        assert_same_on_every_rank(comm, value)
    assert other[1].running_mean[0].item() == float(root + 1)
    assert other.mask.tolist() == [root % 2 == 0, True, False]


@pytest.mark.mpi
def test_no_sync_accumulates_then_averages_once(comm):
    k = 3
    model, reference = mlp(seed=0), mlp(seed=0)
    strategy = Recording()
    with GradientSync(model, strategy=strategy, bucket_mb=TINY, comm=comm) as sync:
        for micro in range(k):
            x, y = batch(micro, comm.rank)
            if micro < k - 1:
                with sync.no_sync():
                    (loss_of(model, x, y) / k).backward()
                assert strategy.stats.calls == 0  # nothing communicated yet
            else:
                (loss_of(model, x, y) / k).backward()
        assert sync.wait()
        assert strategy.stats.calls == len(sync.buckets)
    xs, ys = zip(*[global_batch(micro, comm.size) for micro in range(k)])
    loss_of(reference, torch.cat(xs), torch.cat(ys)).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(4, 8).double()
        self.a = torch.nn.Linear(8, 2).double()
        self.b = torch.nn.Linear(8, 2).double()
        self.never = torch.nn.Linear(8, 2).double()

    def forward(self, x, use_a: bool):
        h = torch.tanh(self.trunk(x))
        return self.a(h) if use_a else self.b(h)


@pytest.mark.mpi
def test_unused_parameters_are_launched_at_wait(comm):
    def local_grads(model, rank, step):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x[:, :4], rank % 2 == 0), y[:, :2])
        loss.backward()

    model = Branchy()
    initial = copy.deepcopy(model)
    with GradientSync(model, bucket_mb=TINY, comm=comm) as sync:
        assert sync.buckets[0][:2] == ["never.bias", "never.weight"]  # never fills by itself
        for step in range(3):
            # what the average must be, computed here from every rank's data
            expected = {}
            for rank in range(comm.size):
                replica = copy.deepcopy(initial)
                local_grads(replica, rank, step)
                for name, p in replica.named_parameters():
                    if p.grad is not None:
                        expected[name] = expected.get(name, 0) + p.grad / comm.size
            model.zero_grad()
            local_grads(model, comm.rank, step)
            assert sync.wait()
            for name, p in model.named_parameters():
                if name in expected:
                    torch.testing.assert_close(p.grad, expected[name], **TOL)
                else:
                    assert p.grad is None, name
            assert model.never.weight.grad is None
            assert (model.b.weight.grad is None) == (comm.size == 1)


@pytest.mark.mpi
def test_backward_twice_without_wait_waits_first(comm):
    model, reference = mlp(seed=0), mlp(seed=0)
    with GradientSync(model, bucket_mb=TINY, comm=comm) as sync:
        loss_of(model, *batch(0, comm.rank)).backward()
        loss_of(model, *batch(1, comm.rank)).backward()  # the previous step is unfinished
        assert sync.wait()
        assert sync.stats.steps == 2
    for step in (0, 1):
        loss_of(reference, *global_batch(step, comm.size)).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


@pytest.mark.mpi(min_size=2)
def test_model_mismatch_raises_on_every_rank(comm):
    last = comm.size - 1

    def build(width_on_last, dtype_on_last=torch.float32, name_on_last="0"):
        layers = torch.nn.Sequential()
        width = width_on_last if comm.rank == last else 4
        layers.add_module(name_on_last if comm.rank == last else "0", torch.nn.Linear(3, width))
        return layers.to(dtype_on_last if comm.rank == last else torch.float32)

    with pytest.raises(ValueError, match=rf"parameter '0.weight' has shape \(4, 3\) on rank "
                                         rf"0 but \(5, 3\) on rank {last}"):
        GradientSync(build(5), comm=comm)
    with pytest.raises(ValueError, match=rf"dtype float32 on rank 0 but float64 on rank {last}"):
        GradientSync(build(4, torch.float64), comm=comm)
    with pytest.raises(ValueError, match=rf"is '0.weight' on rank 0 but parameter 'x.weight' "
                                         rf"on rank {last}"):
        broadcast_module(build(4, name_on_last="x"), comm=comm)
    # every rank raised before communicating anything else: the communicator still works
    assert comm.allreduce_value(1) == comm.size


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_nonfinite_on_one_rank_is_handled_on_every_rank(comm, mode):
    bad_rank = comm.size - 1
    model = mlp(seed=0)
    strategy = Recording()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradientSync(model, strategy=strategy, bucket_mb=TINY, comm=comm,
                      on_nonfinite=mode) as sync:
        x, y = batch(0, comm.rank)
        if comm.rank == bad_rank:
            x[0, 0] = float("nan")
        before = flat_params(model).clone()
        loss_of(model, x, y).backward()
        if mode == "raise":
            with pytest.raises(FloatingPointError, match=rf"bucket \d+ .* on rank\(s\) "
                                                         rf"\[{bad_rank}\]"):
                sync.step(opt)
        else:
            assert sync.step(opt) is False
            assert sync.stats.skipped == 1
            assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
        assert torch.equal(flat_params(model), before)  # no rank stepped
        assert not strategy.saw_nonfinite
        # every rank recovers on the next, finite step
        opt.zero_grad()
        loss_of(model, *batch(1, comm.rank)).backward()
        assert sync.step(opt) is True
        assert not strategy.saw_nonfinite
    assert_same_on_every_rank(comm, flat_params(model))


@pytest.mark.mpi
def test_distributed_optimizer_equals_gradient_sync(comm):
    a, b = mlp(seed=comm.rank), mlp(seed=comm.rank)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9)
    dopt = DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9), b,
                                bucket_mb=TINY, comm=comm)
    with GradientSync(a, bucket_mb=TINY, comm=comm) as sync, dopt:
        for step in range(4):
            x, y = batch(step, comm.rank)
            opt_a.zero_grad()
            loss_of(a, x, y).backward()
            sync.step(opt_a)
            dopt.zero_grad()
            loss_of(b, x, y).backward()
            assert dopt.synchronize() is True
            dopt.step()
        assert torch.equal(flat_params(a), flat_params(b))
        assert_same_on_every_rank(comm, flat_params(b))
        # delegation to the wrapped optimizer
        assert dopt.param_groups is dopt.optimizer.param_groups
        assert dopt.defaults["momentum"] == 0.9
        state = dopt.state_dict()
        assert len(state["state"]) == len(list(b.parameters()))
        dopt.load_state_dict(state)
        assert dopt.last_step_ok


@pytest.mark.mpi
def test_close_removes_hooks_and_stops_the_thread(comm):
    model = mlp(seed=0)
    strategy = Recording()
    sync = GradientSync(model, strategy=strategy, bucket_mb=TINY, comm=comm)
    loss_of(model, *batch(0, comm.rank)).backward()
    sync.wait()
    calls = strategy.stats.calls
    assert calls == len(sync.buckets) and strategy.thread_names == {"mpicomm-gradsync"}
    sync.close()
    assert not sync._thread.is_alive()
    model.zero_grad()
    loss_of(model, *batch(1, comm.rank)).backward()  # hooks gone: local gradients only
    assert strategy.stats.calls == calls
    local = mlp(seed=0)
    loss_of(local, *batch(1, comm.rank)).backward()
    for p, q in zip(model.parameters(), local.parameters()):
        assert torch.equal(p.grad, q.grad)
    with pytest.raises(RuntimeError, match="closed"):
        sync.wait()
    sync.close()  # idempotent


@pytest.mark.mpi
def test_a_strategy_written_elsewhere_works(comm):
    model, reference = mlp(seed=0), mlp(seed=0)
    with GradientSync(model, strategy=AllgatherMean(), bucket_mb=TINY, comm=comm) as sync, \
            GradientSync(reference, bucket_mb=TINY, comm=comm) as dense:
        for m, s in ((model, sync), (reference, dense)):
            loss_of(m, *batch(0, comm.rank)).backward()
            assert s.wait()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


@pytest.mark.mpi
@pytest.mark.parametrize("name", [n for n in available() if n != "dense"])
def test_every_registered_strategy_gives_every_rank_the_same_gradients(comm, name):
    strategy = make(name)  # every registered strategy has defaults for all its options
    model = mlp(seed=0, dtype=torch.float32)
    with GradientSync(model, strategy=strategy, bucket_mb=TINY, comm=comm) as sync:
        for step in range(3):
            model.zero_grad()
            loss_of(model, *batch(step, comm.rank, dtype=torch.float32)).backward()
            assert sync.wait()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            assert torch.isfinite(grads).all()
            assert_same_on_every_rank(comm, grads)


@pytest.mark.mpi
def test_first_bucket_communicates_before_backward_ends(comm):
    torch.manual_seed(0)
    width, layers = 1024, 4
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    tl = Timeline()
    with GradientSync(model, bucket_mb=4.1, comm=comm, timeline=tl) as sync:
        assert len(sync.buckets) == layers  # one Linear (4 MiB + bias) per bucket
        overlapped = []
        for _ in range(3):
            tl.clear()
            model.zero_grad()
            model(torch.randn(128, width)).square().mean().backward()
            assert sync.wait()
            events = tl.events()
            ready = [e for e in events if e["cat"] == "bucket"]
            comm_spans = sorted((e for e in events if e["cat"] == "comm"),
                                key=lambda e: e["args"]["bucket"])
            assert [e["args"]["at"] for e in ready] == ["hook"] * layers
            assert [e["args"]["bucket"] for e in comm_spans] == list(range(layers))
            assert {e["tid"] for e in comm_spans} == {"mpicomm-gradsync"}
            first_ready = next(e["ts"] for e in ready if e["args"]["bucket"] == 0)
            assert comm_spans[0]["ts"] >= first_ready
            overlapped.append(comm_spans[0]["ts"] < max(e["ts"] for e in ready))
        # OS scheduling on an oversubscribed machine may delay the thread once; not thrice
        assert any(overlapped), overlapped


@pytest.mark.mpi
def test_timeline_gather_merges_every_rank(comm, tmp_path):
    tl = Timeline(rank=comm.rank)
    with tl.span("work", cat="test", rank=comm.rank):
        pass
    merged = tl.gather(comm)
    if comm.rank == 0:
        assert sorted(e["pid"] for e in merged) == list(range(comm.size))
        path = tl.save(tmp_path / "merged.json", events=merged)
        names = {e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"]
                 if e["ph"] == "M"}
        assert names == {f"rank {r}" for r in range(comm.size)}
    else:
        assert merged is None


@pytest.mark.mpi
@pytest.mark.gpu
def test_cuda_model_matches_cpu_reference(comm):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    device = torch.device("cuda", comm.local_rank % torch.cuda.device_count())
    model, reference = mlp(seed=comm.rank).to(device), mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    with GradientSync(model, bucket_mb=TINY, comm=comm) as sync:
        for step in range(3):
            opt.zero_grad()
            x, y = batch(step, comm.rank)
            loss_of(model, x.to(device), y.to(device)).backward()
            assert sync.step(opt)
            ref_opt.zero_grad()
            loss_of(reference, *global_batch(step, comm.size)).backward()
            ref_opt.step()
    torch.testing.assert_close(flat_params(model).cpu(), flat_params(reference), rtol=1e-10,
                               atol=1e-10)


# ---------------------------------------------------------------------- serial
def test_describe_module_mismatch_names_the_first_difference():
    base = [("parameter", "w", (2, 3), "float32", True), ("parameter", "b", (2,), "float32",
                                                              True)]
    assert describe_module_mismatch([base, list(base)]) is None
    shape = [base[0], ("parameter", "b", (3,), "float32", True)]
    dtype = [("parameter", "w", (2, 3), "float64", True), base[1]]
    assert describe_module_mismatch([base, shape, dtype]) == (
        "parameter 'w' has dtype float32 on rank 0 but float64 on rank 2")
    assert "has shape (2,) on rank 0 but (3,) on rank 1" in describe_module_mismatch(
        [base, shape])
    assert "exists on rank 0 but rank 1 has only 1" in describe_module_mismatch(
        [base, base[:1]])
    assert "rank 1 has buffer 'm'" in describe_module_mismatch(
        [base, [*base, ("buffer", "m", (1,), "float32", False)]])
    frozen = [base[0], ("parameter", "b", (2,), "float32", False)]
    assert "requires_grad=True on rank 0 but requires_grad=False on rank 1" in \
        describe_module_mismatch([base, frozen])


def test_buckets_run_back_to_front_up_to_the_cap():
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 100),
                                torch.nn.Linear(100, 2))
    named = list(model.named_parameters())
    # bytes: 0.weight 400, 0.bias 40, 1.weight 4000, 1.bias 400, 2.weight 800, 2.bias 8
    buckets = make_buckets(named, cap=1000)
    assert [b.names for b in buckets] == [["2.bias", "2.weight"], ["1.bias"], ["1.weight"],
                                          ["0.bias", "0.weight"]]
    assert [b.nbytes for b in buckets] == [808, 400, 4000, 440]
    assert len(make_buckets(named, cap=1 << 30)) == 1


def test_frozen_parameters_get_no_bucket():
    model = mlp(seed=0)
    model[0].weight.requires_grad_(False)
    with GradientSync(model, bucket_mb=TINY) as sync:
        assert "0.weight" not in sum(sync.buckets, [])
        loss_of(model, *batch(0, 0)).backward()
        assert sync.wait() and model[0].weight.grad is None


def test_single_process_sync_is_the_identity_and_stats_count():
    model, reference = mlp(seed=0), mlp(seed=0)
    tl = Timeline()
    with GradientSync(model, strategy="dense", bucket_mb=TINY, timeline=tl) as sync:
        assert sync.wait() is True  # no backward yet: nothing to do
        loss_of(model, *batch(0, 0)).backward()
        assert sync.wait() is True
        assert sync.wait() is True  # a second wait is free
        assert sync.stats.steps == 1
        assert sync.stats.strategy is sync.strategy.stats
        assert sync.stats.strategy.calls == len(sync.buckets)
    loss_of(reference, *batch(0, 0)).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    kinds = {(e["cat"], e["ph"]) for e in tl.events()}
    assert kinds == {("bucket", "i"), ("comm", "X"), ("wait", "X")}


def test_errors_on_the_thread_reach_the_caller():
    model = mlp(seed=0)
    with GradientSync(model, strategy=Failing(), bucket_mb=TINY) as sync:
        loss_of(model, *batch(0, 0)).backward()
        with pytest.raises(RuntimeError, match="strategy exploded"):
            sync.wait()
        assert sync._thread.is_alive()  # the thread survives; the next step runs again


def test_arguments_are_checked():
    model = mlp(seed=0)
    with pytest.raises(ValueError, match="bucket_mb"):
        GradientSync(model, bucket_mb=0)
    with pytest.raises(ValueError, match="on_nonfinite"):
        GradientSync(model, on_nonfinite="ignore")
    with pytest.raises(TypeError, match="strategy"):
        GradientSync(model, strategy=object())
    with pytest.raises(TypeError, match="nn.Module"):
        GradientSync([torch.zeros(1)])
    with pytest.raises(ValueError, match="unknown strategy"):
        GradientSync(model, strategy="no-such-strategy")


def test_distributed_optimizer_is_a_wrapper_not_a_subclass():
    model = mlp(seed=0)
    inner = torch.optim.Adam(model[0].parameters(), lr=1e-3)
    with DistributedOptimizer(inner, model, bucket_mb=TINY) as dopt:
        assert type(dopt.optimizer) is torch.optim.Adam
        assert not isinstance(dopt, torch.optim.Adam)
        dopt.add_param_group({"params": (p for p in model[2].parameters()), "lr": 1e-2})
        assert len(dopt.param_groups) == 2
        with pytest.raises(ValueError, match="not in the model"):
            dopt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
        scheduler = torch.optim.lr_scheduler.StepLR(dopt.optimizer, step_size=1, gamma=0.5)
        loss_of(model, *batch(0, 0)).backward()
        assert dopt.step() is None and dopt.last_step_ok
        scheduler.step()
        assert dopt.param_groups[0]["lr"] == pytest.approx(5e-4)
        assert dopt.state is inner.state  # other attributes come from the optimizer
    with pytest.raises(ValueError, match="not in the model"):
        DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1),
                             model)


def test_distributed_optimizer_with_a_closure():
    model, reference = mlp(seed=0), mlp(seed=0)
    x, y = batch(0, 0)
    dopt = DistributedOptimizer(torch.optim.LBFGS(model.parameters(), max_iter=3), model,
                                bucket_mb=TINY)
    ref = torch.optim.LBFGS(reference.parameters(), max_iter=3)

    def closure_for(m, o):
        def closure():
            o.zero_grad()
            loss = loss_of(m, x, y)
            loss.backward()
            return loss
        return closure

    dopt.step(closure_for(model, dopt))
    ref.step(closure_for(reference, ref))
    dopt.close()
    torch.testing.assert_close(flat_params(model), flat_params(reference), **TOL)


def test_timeline_records_spans_and_instants_from_threads(tmp_path):
    tl = Timeline(rank=3)
    with tl.span("outer", cat="a", size=5):
        tl.instant("mark", cat="b")
    def in_thread():
        with tl.span("inner", cat="c"):
            pass

    worker = threading.Thread(target=in_thread, name="worker")
    worker.start()
    worker.join()
    events = tl.events()
    by_name = {e["name"]: e for e in events}
    assert by_name["outer"]["ph"] == "X" and by_name["outer"]["args"] == {"size": 5}
    assert by_name["outer"]["dur"] >= 0 and by_name["outer"]["pid"] == 3
    assert by_name["mark"]["ph"] == "i"
    assert by_name["outer"]["ts"] <= by_name["mark"]["ts"] <= (
        by_name["outer"]["ts"] + by_name["outer"]["dur"])
    assert by_name["inner"]["tid"] == "worker" and by_name["outer"]["tid"] == "MainThread"
    path = tl.save(tmp_path / "trace-{rank}.json")
    assert path.name == "trace-3.json"
    saved = json.loads(path.read_text())["traceEvents"]
    assert [e["name"] for e in saved if e["ph"] != "M"] == [e["name"] for e in events]
    tl.clear()
    assert tl.events() == []


def test_disabled_timeline_records_nothing():
    tl = Timeline(enabled=False)
    with tl.span("x"):
        tl.instant("y")
    tl.complete("z", 0.0, 1.0)
    assert tl.events() == []


@pytest.mark.gpu
def test_cuda_gradients_single_process():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    model, reference = mlp(seed=0).cuda(), mlp(seed=0)
    with GradientSync(model, bucket_mb=TINY) as sync:
        x, y = batch(0, 0)
        loss_of(model, x.cuda(), y.cuda()).backward()
        assert sync.wait()
    loss_of(reference, x, y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.is_cuda
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-10, atol=1e-10)
