"""The PyTorch DDP drop-in: process group from MPI ranks, comm hook running mpicomm strategies.

Multi-rank (``-m mpi``): DDP with the dense hook (threaded and inline) ends with the same
parameters as DDP with its own gloo allreduce; a non-dense strategy gives the same result
on every rank; bad arguments raise on every rank. The end of each iteration: the hook
closes the strategy's step once per synchronized iteration (bucket rebuild, ``no_sync``,
unused parameters), refuses a second ``step_done`` from the caller, lets ``auto`` follow a
network change on the virtual clock identically on every rank, and runs a scheduled
sparsifier with momentum correction bit for bit as ``GradientSync`` does. Serial:
``examples/ddp_hook.py`` as a 3-rank child job, gTop-k through the hook within 1
accuracy point of dense on the digits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import mpicomm
from mpicomm import clock, strategies
from mpicomm.costtable import CostTable
from mpicomm.emulate.vnet import platform_from_env
from mpicomm.observe import trace
from mpicomm.observe.metrics import Metrics
from mpicomm.torch import MpicommHookState, ddp_comm_hook, mpicomm_hook, process_group

from .launch import run_job

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def group(comm: mpicomm.Communicator):
    with process_group(comm):
        yield comm


def _net() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _train(model: torch.nn.Module, rank: int, steps: int = 3) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    for _ in range(steps):
        x, y = torch.randn(8, 12, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [True, False])
def test_dense_hook_equals_ddp(group: mpicomm.Communicator, overlap: bool) -> None:
    plain = _train(DistributedDataParallel(_net(), bucket_cap_mb=0.001), group.rank)
    model = DistributedDataParallel(_net(), bucket_cap_mb=0.001)
    hook = ddp_comm_hook("dense", group, overlap=overlap)
    model.register_comm_hook(None, hook)
    with trace.recording(None, group) as tl:  # the hook's buckets show in the timeline
        hooked = _train(model, group.rank)
    hook.state.close()
    spans = [e for e in tl.events() if e["ph"] == "X"]
    buckets = [e for e in spans if e["name"].startswith("ddp bucket")]
    assert len(buckets) == hook.state.buckets
    inner = [e for e in spans if e["name"] == "dense.aggregate"]
    assert len(inner) == len(buckets) and all(
        b["tid"] == i["tid"] and b["ts"] <= i["ts"] for b, i in zip(buckets, inner))
    assert hook.state.buckets >= 3  # every step went through the hook
    for a, b in zip(plain, hooked):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if group.size > 1:
        assert hook.state.stats.sent_bytes > 0


@pytest.mark.mpi
def test_state_and_function_pair_agree_across_ranks(group: mpicomm.Communicator) -> None:
    model = DistributedDataParallel(_net())
    with MpicommHookState("gtopk", group, density=0.25) as state:
        model.register_comm_hook(state, mpicomm_hook)
        params = _train(model, group.rank, steps=2)
        assert state.buckets == 2 and "gtopk" in repr(state)
        record = Metrics(rank=group.rank).observe(state)  # the hook as a metrics source
        assert record["strategy"] == "gtopk" and record["sent_bytes"] == state.stats.sent_bytes
        assert record["dense_bytes"] == 2 * sum(p.numel() * 4 for p in params)
    flat = torch.cat([p.reshape(-1) for p in params]).numpy()
    everyone = group.allgather_object(flat)
    for other in everyone:
        np.testing.assert_array_equal(other, flat)  # replicas stay identical


@pytest.mark.mpi
def test_bad_arguments(group: mpicomm.Communicator) -> None:
    with pytest.raises(TypeError, match="strategy must be"):
        MpicommHookState(object(), group)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown strategy"):
        ddp_comm_hook("no-such-strategy", group)
    with pytest.raises(RuntimeError, match="already exists"):
        mpicomm.torch.init_process_group(group)  # the fixture's group is still up
    assert dist.is_initialized()


def test_gtopk_hook_trains_digits_like_dense(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    res = run_job(3, [sys.executable, "examples/ddp_hook.py", "--epochs", "8", "--strategy",
                      "dense,gtopk", "--density", "0.05", "--json", str(out)], timeout=120)
    assert res.returncode == 0, res.output
    runs = json.loads(out.read_text())["runs"]
    dense, gtopk = runs["dense"], runs["gtopk"]
    assert dense["test_accuracy"] > 0.9, dense
    assert gtopk["test_accuracy"] >= dense["test_accuracy"] - 0.01, (gtopk, dense)
    assert 0 < gtopk["hook_sent_bytes"] < dense["hook_sent_bytes"] / 5
    # --momentum-correction hands the optimizer to the hook: gTop-k's memory takes SGD's
    # momentum over and trains differently; dense has no memory and does not change
    res = run_job(3, [sys.executable, "examples/ddp_hook.py", "--epochs", "8", "--strategy",
                      "dense,gtopk", "--density", "0.05", "--momentum-correction", "--json",
                      str(out)], timeout=120)
    assert res.returncode == 0, res.output
    handed = json.loads(out.read_text())["runs"]
    assert handed["dense"]["test_accuracy"] == dense["test_accuracy"]
    assert handed["gtopk"]["test_accuracy"] != gtopk["test_accuracy"]


# ---------------------------------------------------------------------- end of iteration
class _Logged(strategies.make("dense").__class__):
    """Dense averaging that logs its buffers and its ``step_done`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, object]] = []

    def aggregate_flat(self, flat, name):  # noqa: ANN001, ANN201
        self.log.append(("bucket", name))
        return super().aggregate_flat(flat, name)

    def step_done(self, model=None, optimizer=None) -> None:  # noqa: ANN001
        self.log.append(("done", optimizer))


class _Branchy(torch.nn.Module):
    """Two heads; the second is used only when asked (an unused parameter otherwise)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = torch.nn.Linear(12, 16)
        self.head = torch.nn.Linear(16, 4)
        self.extra = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(h) + self.extra(h) if extra else self.head(h)


@pytest.mark.mpi
@pytest.mark.parametrize(("overlap", "unused"), [(True, False), (False, False),
                                                 (True, True)])
def test_one_step_done_per_synchronized_iteration(group: mpicomm.Communicator,
                                                  overlap: bool, unused: bool) -> None:
    """Each synchronized iteration ends with exactly one ``step_done(None, optimizer)``
    right after its last bucket: across DDP's bucket rebuild (the parameters' order
    changes after the first iteration; the strategy's buffers stay the same from then
    on),
    with two ``no_sync`` micro-batches (no hook, no step) and with an unused head
    (``find_unused_parameters``). The caller's own ``step_done`` raises while the hook
    owns the steps and works again after ``close``."""
    model = DistributedDataParallel(_Branchy(), bucket_cap_mb=0.0005,
                                    find_unused_parameters=unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = _Logged()
    hook = ddp_comm_hook(strategy, group, overlap=overlap, optimizer=opt)
    layouts: list[list[int]] = []

    def recording(state, bucket):  # noqa: ANN001, ANN202
        layouts[-1].append([id(p) for p in bucket.parameters()])
        return hook(state, bucket)

    model.register_comm_hook(None, recording)
    gen = torch.Generator().manual_seed(100 + group.rank)
    plan = ["sync", "sync", "accumulate", "accumulate", "sync", "sync"]
    for i, kind in enumerate(plan):
        layouts.append([])
        x = torch.randn(8, 12, generator=gen)
        extra = not (unused and i == 5)  # the extra head idle in the last iteration
        if kind == "accumulate":
            with model.no_sync():
                model(x, extra).sum().backward()
        else:
            model(x, extra).sum().backward()
            opt.step()
            opt.zero_grad()
    synced = plan.count("sync")
    assert hook.state.steps == synced and [len(b) for b in layouts[2:4]] == [0, 0]
    if not unused:                           # DDP rebuilt its buckets after iteration 0
        assert layouts[0] != layouts[1]      # (not with find_unused_parameters)
    log = strategy.log
    dones = [i for i, (what, _) in enumerate(log) if what == "done"]
    assert len(dones) == synced and dones[-1] == len(log) - 1
    assert all(arg is opt for what, arg in log if what == "done")
    per_step, start = [], 0
    for end in dones:                        # the buffers between two ends of a step
        per_step.append([name for _, name in log[start:end]])
        start = end + 1
    # the same buffers at every step after the rebuild (here it also regrouped them)
    assert all(s == per_step[1] for s in per_step[1:]), per_step
    assert sum(map(len, per_step)) == hook.state.buckets
    with pytest.raises(RuntimeError, match="closed by its MpicommHookState"):
        hook.state.strategy.step_done(None, opt)
    with pytest.raises(ValueError, match="already belongs to an open MpicommHookState"):
        MpicommHookState(strategy, group)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        MpicommHookState("dense", group, optimizer="sgd")
    hook.state.close()
    strategy.step_done(None, opt)            # its own again
    assert log[-1] == ("done", opt)
    everyone = group.allgather_object([(w, str(n)) for w, n in log])
    assert everyone == [everyone[0]] * group.size


def _mlp() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.ReLU(),
                               torch.nn.Linear(48, 10))


def _momentum_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int,
                    step: object, steps: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(200 + rank)
    for _ in range(steps):
        x, y = torch.randn(16, 20, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [True, False])
def test_scheduled_sparsifier_under_the_hook_equals_gradientsync(group, overlap) -> None:
    """gTop-k by name (a density warm-up advanced per step) with the momentum correction
    that takes the SGD optimizer's momentum over at the first step's end
    (``momentum_correction="optimizer"``) through the DDP hook with ``optimizer=`` gives
    the same weights, bit for bit, as ``GradientSync.step`` over the same steps (one
    bucket each; the hook runs ``step_done`` before the optimizer step, GradientSync
    after it). The default by name is plain error feedback: the optimizer keeps its
    momentum, and the run equals GradientSync with ``momentum_correction=0``."""
    from mpicomm.torch import GradientSync

    steps = 8
    ref_model = _mlp()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    ref_strategy = strategies.make("gtopk", density=0.02, momentum_correction="optimizer")
    with GradientSync(ref_model, strategy=ref_strategy, comm=group, bucket_mb=64) as sync:
        ref = _momentum_steps(ref_model, ref_opt, group.rank, lambda: sync.step(ref_opt),
                              steps)
    assert ref_opt.param_groups[0]["momentum"] == 0.0       # taken over
    model = DistributedDataParallel(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hook = ddp_comm_hook("gtopk", group, overlap=overlap, optimizer=opt, density=0.02,
                         momentum_correction="optimizer")
    model.register_comm_hook(None, hook)
    mine = _momentum_steps(model, opt, group.rank, opt.step, steps)
    assert hook.state.steps == steps and opt.param_groups[0]["momentum"] == 0.0
    assert hook.state.strategy.memory.momentum == 0.9
    hook.state.close()
    assert torch.equal(mine, ref)
    # without the optimizer: plain error feedback, the optimizer's own momentum
    plain_model = _mlp()
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.05, momentum=0.9)
    with GradientSync(plain_model, strategy=strategies.make(
            "gtopk", density=0.02, momentum_correction=0.0), comm=group,
            bucket_mb=64) as sync:
        plain = _momentum_steps(plain_model, plain_opt, group.rank,
                                lambda: sync.step(plain_opt), steps)
    model = DistributedDataParallel(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hook = ddp_comm_hook("gtopk", group, overlap=overlap, density=0.02)
    model.register_comm_hook(None, hook)
    mine = _momentum_steps(model, opt, group.rank, opt.step, steps)
    assert opt.param_groups[0]["momentum"] == 0.9
    assert hook.state.strategy.memory.momentum == 0.0
    hook.state.close()
    assert torch.equal(mine, plain)
    if group.size > 1:
        assert not torch.equal(plain, ref)


@pytest.mark.mpi
@pytest.mark.parametrize("given", [True, False])
def test_auto_momentum_under_the_hook_is_applied_once(group, given) -> None:
    """``auto`` (Allgather Top-k at 0.1) under the hook: with ``optimizer=`` it takes the
    SGD optimizer's momentum over and runs bit for bit as under ``GradientSync.step``;
    without it the optimizer keeps its momentum, the memory falls back to plain error
    feedback, and the run equals ``momentum_correction=False`` under ``GradientSync``."""
    from mpicomm.torch import GradientSync

    def auto(**kw):  # noqa: ANN003, ANN202
        return strategies.make("auto", ratio=0.1, schemes=("allgather_topk",),
                               calibrate_links=0, trial_steps=0, **kw)

    steps = 6
    ref_model = _mlp()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    with GradientSync(ref_model, strategy=auto(momentum_correction=given), comm=group,
                      bucket_mb=64) as sync:
        ref = _momentum_steps(ref_model, ref_opt, group.rank, lambda: sync.step(ref_opt),
                              steps)
    model = DistributedDataParallel(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hook = ddp_comm_hook(auto(momentum_correction=True), group,
                         optimizer=opt if given else None)
    model.register_comm_hook(None, hook)
    mine = _momentum_steps(model, opt, group.rank, opt.step, steps)
    memory = hook.state.strategy.memory
    hook.state.close()
    assert opt.param_groups[0]["momentum"] == (0.0 if given else 0.9)
    assert memory.momentum == (0.9 if given else 0.0)   # never in both
    assert torch.equal(mine, ref)


def test_window_without_the_model_leaves_the_optimizer_alone() -> None:
    """An exploration window's snapshot (``auto``): with the model, the model and the
    optimizer come back at the restore; without it (the DDP hook never sees the model)
    the optimizer's state is not restored either (it belongs to the parameters'
    trajectory, which the window keeps); the strategy's state always is."""
    from mpicomm.strategies.auto_snapshot import WindowSnapshot

    class State:
        def __init__(self) -> None:
            self.value = 1

        def state_dict(self) -> dict:
            return {"value": self.value}

        def load_state_dict(self, state: dict) -> None:
            self.value = state["value"]

    for with_model in (True, False):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        strategy, snap = State(), WindowSnapshot({"windows": 0, "exploration_s": 0.0})
        snap.act("save", model if with_model else None, opt, strategy)
        model(torch.randn(2, 12)).sum().backward()
        opt.step()                               # the window's step: new weights, momentum
        strategy.value = 2
        weights = [p.detach().clone() for p in model.parameters()]
        snap.act("restore", model if with_model else None, opt, strategy)
        assert strategy.value == 1 and snap.overheads["windows"] == 1
        assert bool(opt.state) is not with_model
        kept = all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
        assert kept is not with_model


@pytest.mark.mpi
def test_auto_under_the_hook_follows_a_network_change(group, tmp_path) -> None:
    """``auto`` under the DDP hook on the virtual clock, the network falling from
    10 Gbit/s to 10 Mbit/s at step 4 (same 100 µs latency): dense on the large bucket
    while the network is fast, a re-decision after the change moves it to Allgather
    Top-k, every bucket ends there, and the decisions are the same at the same steps on
    every rank. Without the hook's ``step_done`` the strategy keeps its first choices
    (no records, no decision after the first iteration's)."""
    change, steps = 4, 13
    schedule = tmp_path / "schedule.txt"
    if group.rank == 0:
        schedule.write_text(f"step {change} 10mbit 100us\n")
    schedule = Path(group.bcast_object(str(schedule)))
    plat = platform_from_env(group.size, {"MPICOMM_VIRTUAL_RATE": "10gbit",
                                          "MPICOMM_VIRTUAL_DELAY": "100us",
                                          "MPICOMM_VIRTUAL_SCHEDULE": str(schedule)})
    table = CostTable.load(str(ROOT / "benchmarks" / "costs-controllers-mnist1d.json"))
    with clock.session(plat, table):
        vc = group.dup()
        vc.check = False
        try:
            torch.manual_seed(0)
            model = DistributedDataParallel(torch.nn.Sequential(
                torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)))
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            hook = ddp_comm_hook("auto", vc, optimizer=opt, ratio=0.01,
                                 schemes=("dense", "allgather_topk"), trial_steps=0,
                                 drift_patience=2, calibrate_links=1)
            model.register_comm_hook(None, hook)
            gen = torch.Generator().manual_seed(100 + group.rank)
            for step in range(steps):
                clock.report_step(step)
                opt.zero_grad()
                with clock.waiting_for_threads():  # backward waits for the hook thread
                    model(torch.randn(8, 64, generator=gen)).pow(2).mean().backward()
                opt.step()
            auto = hook.state.strategy
            hook.state.close()
        finally:
            vc.free()
    assert hook.state.steps == steps
    decisions = [(t, bucket, scheme) for t, bucket, scheme, _ in auto.decisions]
    assert group.allgather_object(decisions) == [decisions] * group.size
    assert {r.step for r in auto.records} == set(range(steps - 1))  # one step late
    if group.size == 1:                      # no network: nothing to follow
        assert {s for _, _, s in decisions} == {"dense"}
        return
    before = {b: s for t, b, s in decisions if t < change}  # in force at the change
    now = {r.bucket for r in auto.records if r.step == steps - 2}  # (agreed one late)
    final = {b: s for _, b, s in decisions if b in now}
    moved = {b for t, b, s in decisions if t > change and before.get(b) == "dense"
             and s == "allgather_topk"}
    assert "dense" in before.values() and moved, decisions
    assert len(final) == 2 and set(final.values()) == {"allgather_topk"}, decisions
    slow = [r.measured for r in auto.records if r.step == change and r.scheme == "dense"]
    fast = [r.measured for r in auto.records if r.step == change - 1 and r.scheme == "dense"]
    assert min(slow) > 100 * max(fast)       # the network did change (measured)
