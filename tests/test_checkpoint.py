"""mpicomm.checkpoint and mpicomm.durable: atomic checksummed files, complete checkpoints,
state capture, resume bit for bit (peers and parameter server), refusals of bad input."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

import mpicomm
from mpicomm import durable
from mpicomm.checkpoint import Checkpointer, CheckpointError, layout
from mpicomm.checkpoint.state import fingerprint, freeze, mismatch, rng_state, set_rng_state, thaw


# ====================================================================== serial
def test_write_atomic_and_verify(tmp_path):
    path = tmp_path / "a.bin"
    w = durable.write_atomic(path, b"hello world")
    assert w.nbytes == 11 and durable.read_verified(path, w.sha256, w.nbytes) == b"hello world"
    path.write_bytes(b"hello")  # cut short
    with pytest.raises(ValueError, match="cut short"):
        durable.read_verified(path, w.sha256, w.nbytes)
    path.write_bytes(b"hello World")  # same size, one byte changed
    with pytest.raises(ValueError, match="SHA-256"):
        durable.read_verified(path, w.sha256, w.nbytes)
    assert os.listdir(tmp_path) == ["a.bin"]  # no temporary file left


def test_background_writer_overlaps_and_reraises():
    writer = durable.BackgroundWriter()
    done = []
    writer.submit(lambda: done.append(1))
    writer.wait()
    assert done == [1] and writer.tasks == 1

    def fail() -> None:
        raise OSError("disk full")

    writer.submit(fail)
    with pytest.raises(OSError, match="disk full"):
        writer.submit(lambda: None)  # the previous task's error comes back here
    writer.close()


def _fake_step(directory, step, ranks, run="r1", skip=(), sizes=None):
    os.makedirs(layout.step_dir(str(directory), step), exist_ok=True)
    for r in range(ranks):
        if r in skip:
            continue
        name = layout.rank_file(r)
        w = durable.write_atomic(os.path.join(layout.step_dir(str(directory), step), name),
                                 b"x" * (10 + r))
        if sizes is not None:
            w = durable.Written(w.sha256, sizes)
        layout.write_manifest(str(directory), step, r, layout.manifest(
            step, r, run=run, ranks=ranks, writers=range(ranks), fingerprint={},
            files={name: w}))


def test_complete_steps_need_every_manifest_of_one_run(tmp_path):
    _fake_step(tmp_path, 4, 2)
    _fake_step(tmp_path, 8, 2, skip=(1,))            # rank 1 killed before its manifest
    _fake_step(tmp_path, 12, 2)
    _fake_step(tmp_path, 12, 2, run="r2", skip=(0,))  # a second attempt rewrote rank 1 only
    _fake_step(tmp_path, 16, 2, sizes=999)           # a manifest naming a cut-short file
    assert layout.list_steps(str(tmp_path)) == [16, 12, 8, 4]
    assert [s for s, _ in layout.complete_steps(str(tmp_path))] == [4]
    _fake_step(tmp_path, 20, 2)
    assert layout.newest_complete(str(tmp_path)) == 20
    removed = layout.prune(str(tmp_path), keep=1)
    assert sorted(removed) == [4, 8, 12, 16] and layout.list_steps(str(tmp_path)) == [20]


def test_freeze_copies_and_thaws():
    t = torch.ones(3)
    a = np.arange(4.0)
    frozen = freeze({"t": t, "a": a, "n": [1, 2.5, "x", None, (np.float32(2),)]})
    t += 1
    a += 1
    back = thaw(frozen)
    assert torch.equal(back["t"], torch.ones(3)) and np.array_equal(back["a"], np.arange(4.0))
    assert back["n"] == [1, 2.5, "x", None, (2.0,)]
    with pytest.raises(TypeError, match=r"state\['o'\]"):
        freeze({"o": object()})


def test_rng_state_round_trip_through_weights_only_load(tmp_path):
    torch.manual_seed(3)
    np.random.seed(4)
    random.seed(5)
    state = rng_state()
    expected = (torch.rand(2), np.random.rand(2), random.random())
    path = tmp_path / "rng.pt"
    torch.save(freeze(state), path)
    set_rng_state(thaw(torch.load(path, weights_only=True)))
    got = (torch.rand(2), np.random.rand(2), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]


def test_fingerprint_mismatch_names_the_difference():
    small = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    big = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(small.parameters(), lr=0.1)
    a = {"model": fingerprint(small), "optimizer": fingerprint(opt)}
    assert mismatch(a, dict(a)) is None
    why = mismatch(a, {"model": fingerprint(big), "optimizer": fingerprint(opt)})
    assert "'0.weight' is (8, 4) float32 there" in why and "another model" in why
    assert "this job checkpoints ['model']" in mismatch(a, {"model": fingerprint(small)})


# ====================================================================== multi-rank
def _model(hidden: int = 8, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.ReLU(),
                               torch.nn.Dropout(0.2), torch.nn.Linear(hidden, 3))


def _steps(model, opt, sync, comm, steps) -> None:
    for t in steps:
        rng = np.random.default_rng([comm.rank, t])
        x = torch.from_numpy(rng.standard_normal((5, 6)).astype(np.float32))
        y = torch.from_numpy(rng.integers(0, 3, 5))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        sync.step(opt)


def _folder(comm, factory) -> str:
    return comm.bcast_object(str(factory.mktemp("ckpt")) if comm.rank == 0 else None)


def _snapshot_dir(folder: str) -> dict[str, tuple[int, float]]:
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            out[p] = (os.path.getsize(p), os.path.getmtime(p))
    return out


@pytest.mark.mpi
def test_peer_resume_is_bitwise_and_skips_a_damaged_checkpoint(comm, tmp_path_factory):
    """GradientSync with Top-k and error feedback, momentum, dropout: saved at steps 3
    and 5; step 5's last-rank file is damaged (same size, one byte flipped), so the
    restore agrees on step 3 everywhere and replays 3..8 to the same bits."""
    folder = _folder(comm, tmp_path_factory)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sync = mpicomm.torch.GradientSync(model, "topk", comm=comm, density=0.3)
    ckpt = Checkpointer(folder, comm=comm, every=0, model=model, optimizer=opt, sync=sync)
    assert ckpt.restore() is None
    _steps(model, opt, sync, comm, range(3))
    ckpt.save(3, {"step": 3})
    _steps(model, opt, sync, comm, range(3, 5))
    ckpt.save(5, {"step": 5})
    _steps(model, opt, sync, comm, range(5, 8))
    ckpt.close()
    assert ckpt.stats.saves == 2 and sync.strategy.memory.norm() != 0
    final = {k: v.clone() for k, v in model.state_dict().items()}
    sync.close()
    comm.barrier()
    if comm.rank == 0:
        victim = os.path.join(layout.step_dir(folder, 5), layout.rank_file(comm.size - 1))
        with open(victim, "r+b") as f:
            data = bytearray(f.read())
            data[len(data) // 2] ^= 0xFF
            f.seek(0)
            f.write(bytes(data))
    comm.barrier()

    model = _model(seed=99)  # other weights: the checkpoint must replace them
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sync = mpicomm.torch.GradientSync(model, "topk", comm=comm, density=0.3)
    ckpt = Checkpointer(folder, comm=comm, model=model, optimizer=opt, sync=sync)
    resumed = ckpt.restore()
    assert resumed.step == 3 and resumed.position == {"step": 3}
    assert layout.list_steps(folder) == [3]  # the damaged newer one is gone
    _steps(model, opt, sync, comm, range(3, 8))
    for k, v in model.state_dict().items():
        assert torch.equal(v, final[k]), k
    ckpt.close()
    sync.close()


@pytest.mark.mpi
def test_refuses_another_model_and_a_missing_directory(comm, tmp_path_factory):
    folder = _folder(comm, tmp_path_factory)
    model = _model(hidden=8)
    ckpt = Checkpointer(folder, comm=comm, background=False, model=model)
    ckpt.save(1, {"step": 1})
    ckpt.close()
    comm.barrier()
    before = _snapshot_dir(folder)
    other = _model(hidden=16)
    ckpt = Checkpointer(folder, comm=comm, model=other)
    with pytest.raises(CheckpointError, match=r"'0.weight' is \(8, 6\) float32 there"):
        ckpt.restore()
    comm.barrier()
    assert _snapshot_dir(folder) == before  # nothing written, nothing removed
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpointer(os.path.join(folder, "nowhere"), comm=comm, model=model)


@pytest.mark.mpi
def test_local_sgd_with_adacomm_resumes_bitwise(comm, tmp_path_factory):
    folder = _folder(comm, tmp_path_factory)

    def build(seed: int):
        model = _model(seed=seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        local = mpicomm.torch.LocalSGD(
            model, mpicomm.control.AdaComm(4, interval_rounds=1, tau_max=4), opt, comm=comm)
        return model, opt, local

    def train(model, opt, local, steps):
        for t in steps:
            rng = np.random.default_rng([comm.rank, t])
            x = torch.from_numpy(rng.standard_normal((5, 6)).astype(np.float32))
            y = torch.from_numpy(rng.integers(0, 3, 5))
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            local.step(loss)

    model, opt, local = build(0)
    ckpt = Checkpointer(folder, comm=comm, model=model, optimizer=opt, local=local)
    train(model, opt, local, range(7))  # mid-period: replicas differ between ranks
    ckpt.save(7, {"step": 7})
    train(model, opt, local, range(7, 13))
    ckpt.close()
    final, rounds = {k: v.clone() for k, v in model.state_dict().items()}, local.rounds
    model, opt, local = build(5)
    ckpt = Checkpointer(folder, comm=comm, model=model, optimizer=opt, local=local)
    assert ckpt.restore().step == 7
    train(model, opt, local, range(7, 13))
    assert local.rounds == rounds
    for k, v in model.state_dict().items():
        assert torch.equal(v, final[k]), k
    ckpt.close()


@pytest.mark.mpi
def test_parameter_server_resume_is_bitwise(comm, tmp_path_factory):
    if comm.size < 2:
        pytest.skip("a parameter server needs >= 2 ranks")
    folder = _folder(comm, tmp_path_factory)

    def run(steps, seed, save_at=None):
        kv = mpicomm.ps.KVStore(comm, servers=1, mode="sync", lr=0.05, momentum=0.9)
        model = None if kv.is_server else _model(seed=seed)
        ckpt = Checkpointer(folder, comm=comm, kv=kv,
                            **({} if model is None else {"model": model}))
        resumed = ckpt.restore()
        if kv.is_server:
            kv.serve()
            return None, resumed
        opt = mpicomm.torch.PSOptimizer(model, kv)
        start = resumed.position["step"] if resumed else 0
        for t in range(start, steps):
            rng = np.random.default_rng([kv.worker_rank, t])
            x = torch.from_numpy(rng.standard_normal((5, 6)).astype(np.float32))
            y = torch.from_numpy(rng.integers(0, 3, 5))
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if t + 1 == save_at:
                ckpt.save(t + 1, {"step": t + 1})
        ckpt.close()
        opt.close()
        return {k: v.clone() for k, v in model.state_dict().items()}, resumed

    final, resumed = run(6, 0, save_at=3)
    assert resumed is None
    comm.barrier()
    again, resumed = run(6, 7)
    assert resumed.step == 3
    if again is not None:
        for k, v in again.items():
            assert torch.equal(v, final[k]), k
    with open(os.path.join(layout.step_dir(folder, 3), layout.manifest_file(0))) as f:
        manifest = json.load(f)
    assert layout.STORE_FILE in manifest["files"] and manifest["writers"] == \
        list(range(comm.size - 1))
