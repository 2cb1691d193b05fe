"""The time-to-accuracy harness (``mpicomm.bench.harness``) and the workloads under MPI.

Multi-rank tests (``@pytest.mark.mpi``, run under ``mpiexec -n 1..5``): shards disjoint
across ranks, one evaluation that every rank agrees on and that matches a single process
evaluating the whole set, and the harness with a gradient strategy and with local SGD
(replicas identical, curve and counters consistent). Serial tests: the ``bench train``
suite as a 2-rank child job on small slices of MNIST-1D and the language model (JSON
format, corpus record), and its one-line error for bad input. About 40 s in all.
"""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
import torch

from mpicomm import workloads
from mpicomm.bench.harness import Spec, train
from mpicomm.bench.sync import GradientMethod, LocalSGDMethod
from mpicomm.strategies import Dense, GTopK

from .launch import run_job


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.mpi
def test_shards_disjoint_and_evaluation_agreed(comm):
    w = workloads.get("digits-mlp", rank=comm.rank, size=comm.size, seed=1, batch=8)
    mine = w.shard.indices(3).tolist()
    everyone = [i for part in comm.allgather_object(mine) for i in part]
    assert len(everyone) == len(set(everyone)) == comm.size * (1437 // comm.size)
    ev = w.evaluate(w.model, comm)
    assert len({json.dumps(e) for e in comm.allgather_object(ev)}) == 1
    whole = w.evaluate(w.model, None)
    assert ev["accuracy"] == pytest.approx(whole["accuracy"], abs=1e-12)
    assert ev["loss"] == pytest.approx(whole["loss"], rel=1e-5)


@pytest.mark.mpi
@pytest.mark.parametrize("method", ["dense", "gtopk"])
def test_harness_gradient_sync_keeps_replicas_identical(comm, method):
    spec = Spec(workload="digits-mlp", seed=2, batch=16, options={"hidden": 32},
                epochs=2, eval_every=5, target=0.2)
    strategy = Dense() if method == "dense" else GTopK(density=0.05)
    w = workloads.get("digits-mlp", rank=comm.rank, size=comm.size, seed=2, batch=16,
                      hidden=32)
    run = train(spec, GradientMethod(strategy), comm, workload=w)
    assert len(set(comm.allgather_object(digest(w.model)))) == 1
    per_epoch = (1437 // comm.size) // 16
    assert run.steps == 2 * per_epoch == len(run.step_s) == len(run.step_bytes)
    assert [p["step"] for p in run.curve] == sorted({*range(5, run.steps + 1, 5), run.steps})
    times = [p["time_s"] for p in run.curve]
    assert times == sorted(times) and run.seconds == times[-1] > 0
    assert len({json.dumps(run.curve)} | set(comm.allgather_object(json.dumps(run.curve)))) == 1
    assert sum(run.step_bytes) == run.sent_bytes <= run.curve[-1]["bytes"]
    assert run.curve[-1]["bytes"] == run.sent_bytes_max_rank
    assert (run.sent_bytes > 0) == (comm.size > 1)
    assert len(run.history) == 2 and 0 < run.history[-1]["train_acc"] <= 1
    assert run.time_to_target_s is not None and run.steps_to_target is not None
    if method == "gtopk" and comm.size > 1:  # 5% of the entries: fewer bytes than dense
        assert run.sent_bytes < 2 * 4 * w.info.parameters * run.steps / 4


@pytest.mark.mpi
def test_harness_local_sgd_evaluates_after_averaging(comm):
    spec = Spec(workload="digits-mlp", seed=0, batch=16, options={"hidden": 16},
                max_steps=23, epochs=5, eval_every=4, eval_split="train")
    w = workloads.get("digits-mlp", rank=comm.rank, size=comm.size, seed=0, batch=16,
                      hidden=16)
    run = train(spec, LocalSGDMethod(3), comm, workload=w)
    assert run.steps == 23
    # evaluations right after averaging rounds (every 3 steps) once 4 steps passed, and
    # at the end after a final averaging
    assert [p["step"] for p in run.curve][:3] == [6, 12, 18] and run.curve[-1]["step"] == 23
    assert len(set(comm.allgather_object(digest(w.model)))) == 1
    assert run.decisions == [{"step": 1, "tau": 3}]
    assert run.extra["rounds"] >= 7


def _virtual_table():
    from mpicomm.costtable import CostTable, OpCost

    return CostTable({"reduce": OpCost(0.0, 1e-10, "byte"), "copy": OpCost(0.0, 0.0, "byte"),
                      "select": OpCost(0.0, 0.0), "merge": OpCost(0.0, 0.0, "pair"),
                      "scatter": OpCost(0.0, 0.0)})


def _on_virtual_clock(comm, fn):
    """``fn(vc)`` under a virtual 1 Gbit/s, 100 us cluster on a fresh communicator."""
    from mpicomm import clock
    from mpicomm.emulate.vnet import platform_from_env

    plat = platform_from_env(comm.size, {"MPICOMM_VIRTUAL_RATE": "1gbit",
                                         "MPICOMM_VIRTUAL_DELAY": "100us"})
    with clock.session(plat, _virtual_table()):
        vc = comm.dup()
        vc.check = False
        try:
            return fn(vc)
        finally:
            vc.free()


@pytest.mark.mpi
def test_harness_charges_declared_step_costs_on_the_virtual_clock(comm):
    from mpicomm import clock

    spec = Spec(workload="digits-mlp", seed=0, batch=16, options={"hidden": 16},
                max_steps=6, eval_every=None, epoch_stats=False, eval_split="train")

    def go(vc):
        for op, s in (("forward", 0.01), ("backward", 0.02), ("optimizer", 0.003)):
            clock.declare(op, s)
        return train(spec, LocalSGDMethod(10**9), vc)  # never averages while training

    run = _on_virtual_clock(comm, go)
    assert run.step_s == pytest.approx([0.033] * 6, rel=1e-9)
    assert run.seconds == pytest.approx(6 * 0.033, rel=1e-9)  # the final averaging: paused


@pytest.mark.mpi
def test_harness_measures_the_step_once_and_repeats_bit_for_bit(comm):
    from mpicomm import clock

    spec = Spec(workload="digits-mlp", seed=1, batch=16, options={"hidden": 32},
                max_steps=8, eval_every=4, epoch_stats=False)

    def go(vc):
        run = train(spec, GradientMethod(Dense()), vc)
        table = clock.cost_table()
        return run, {op: table.ops[op] for op in ("forward", "backward", "optimizer")}

    first, costs = _on_virtual_clock(comm, go)
    again, costs_again = _on_virtual_clock(comm, go)
    assert costs == costs_again and all(c.source == "measured" for c in costs.values())
    assert costs["forward"].per_call > 0 and costs["backward"].per_call > 0
    assert first.curve == again.curve and first.step_s == again.step_s
    step = sum(c.per_call for c in costs.values())
    assert min(first.step_s) >= step * (1 - 1e-9)
    if comm.size > 1:   # the allreduce of the gradients on the modelled network
        assert min(first.step_s) > step + 100e-6


def test_bench_train_on_small_slices_writes_the_curves(tmp_path):
    out_cnn, out_lm = tmp_path / "cnn.json", tmp_path / "lm.json"
    base = [sys.executable, "-m", "mpicomm.bench", "train"]
    res = run_job(2, [*base, "--workload", "mnist1d-cnn", "--option", "train_examples=400",
                      "--option", "channels=16", "--epochs", "2", "--eval-every", "4",
                      "--strategy", "dense", "--strategy", "topk+ef", "--target", "0.1",
                      "--json", str(out_cnn)], timeout=180)
    assert res.returncode == 0, res.output
    data = json.loads(out_cnn.read_text())
    assert data["suite"] == "train" and [r["method"] for r in data["summary"]] == \
        ["dense", "topk+ef"]
    runs = data["training_runs"]
    assert all(r["steps"] == 2 * (200 // 32) == len(r["step_s"]) for r in runs)
    assert all(set(p) >= {"step", "time_s", "bytes", "accuracy", "loss"}
               for r in runs for p in r["curve"])
    assert runs[1]["sent_bytes"] < runs[0]["sent_bytes"] / 5
    res = run_job(2, [*base, "--workload", "text-lm", "--option", "max_bytes=200000",
                      "--option", "vocab=512", "--option", "valid_tokens=1024",
                      "--steps", "6", "--json", str(out_lm)], timeout=180)
    assert res.returncode == 0, res.output
    run = json.loads(out_lm.read_text())["training_runs"][0]
    corpus = run["info"]["data"]["corpus"]
    assert corpus["files"] and corpus["bytes"] > 0 and len(corpus["sha256"]) == 64
    assert run["steps"] == 6 and "perplexity" in run["curve"][-1]


@pytest.mark.parametrize("args, message", [
    (["--workload", "nope"], "unknown workload 'nope'"),
    (["--batch", "5000"], "batch 5000 is larger than a rank's shard"),
    (["--strategy", "topk+zz"], "unknown strategy label 'topk+zz'"),
])
def test_bench_train_bad_input_is_one_error_line(args, message):
    res = run_job(2, [sys.executable, "-m", "mpicomm.bench", "train", *args], timeout=120)
    assert res.returncode == 2, res.output
    errors = [line for line in res.output.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], res.output
    assert "Traceback" not in res.output
