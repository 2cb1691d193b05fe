"""The PyTorch DDP drop-in: process group from MPI ranks, comm hook running mpicomm strategies.

Multi-rank (``-m mpi``): DDP with the dense hook (threaded and inline) ends with the same
parameters as DDP with its own gloo allreduce; a non-dense strategy gives the same result
on every rank; bad arguments raise on every rank. Serial: ``examples/ddp_hook.py`` as a
3-rank child job, gTop-k through the hook within 1 accuracy point of dense on the digits.
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
from mpicomm.observe import trace
from mpicomm.observe.metrics import Metrics
from mpicomm.torch import MpicommHookState, ddp_comm_hook, mpicomm_hook, process_group

from .launch import run_job


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
    res = run_job(3, [sys.executable, "examples/ddp_hook.py", "--epochs", "6", "--strategy",
                      "dense,gtopk", "--density", "0.05", "--json", str(out)], timeout=120)
    assert res.returncode == 0, res.output
    runs = json.loads(out.read_text())["runs"]
    dense, gtopk = runs["dense"], runs["gtopk"]
    assert dense["test_accuracy"] > 0.9, dense
    assert gtopk["test_accuracy"] >= dense["test_accuracy"] - 0.01, (gtopk, dense)
    assert 0 < gtopk["hook_sent_bytes"] < dense["hook_sent_bytes"] / 5
