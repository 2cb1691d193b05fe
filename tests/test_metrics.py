"""Per-step metrics (mpicomm.observe.metrics) and their plots (mpicomm.observe.plot,
python -m mpicomm plot).

Serial: records, notes, the JSON-lines file and its rank rule, ``MPICOMM_METRICS``,
observing GradientSync / LocalSGD / a Strategy (counters become per-step deltas), the
plot panels and the command line. Multi-rank: GradientSync with ``metrics=`` records
every step on every rank with the bytes the strategy's counters saw and a positive
cost-model prediction.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mpicomm
from mpicomm import cli
from mpicomm.observe.metrics import Metrics, metrics_from, predict_step_comm
from mpicomm.observe.plot import loss_note
from mpicomm.strategies import make
from mpicomm.torch import DistributedOptimizer, GradientSync, LocalSGD


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_record_note_and_file(tmp_path: Path) -> None:
    m = Metrics(tmp_path / "m.jsonl", rank=0)
    m.note(loss=2.5, collective="allgather")
    first = m.record(sent_bytes=100, dense_bytes=1000)
    assert first["loss"] == 2.5 and first["collective"] == "allgather"
    assert first["kind"] == "step" and first["step"] == 0 and first["rank"] == 0
    assert first["step_s"] >= 0 and first["time_s"] >= 0
    second = m.record(sent_bytes=50, staleness=torch.tensor(3))  # tensors become numbers
    assert "loss" not in second  # notes go into one record only
    assert second["step"] == 1 and second["staleness"] == 3
    assert second["total_sent_bytes"] == 150
    decision = m.record("decision", reason="cheaper")
    assert decision["step"] == 0 and "step_s" not in decision
    assert m.last is decision
    assert _lines(tmp_path / "m.jsonl") == m.records


def test_rank_rule_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Metrics(tmp_path / "only0.jsonl", rank=1).record(x=1)
    assert not (tmp_path / "only0.jsonl").exists()  # rank 1 keeps records in memory only
    Metrics(str(tmp_path / "r{rank}.jsonl"), rank=1).record(x=1)
    assert _lines(tmp_path / "r1.jsonl")[0]["x"] == 1
    monkeypatch.delenv("MPICOMM_METRICS", raising=False)
    assert metrics_from(None) is None
    monkeypatch.setenv("MPICOMM_METRICS", str(tmp_path / "env.jsonl"))
    m = metrics_from(None)
    assert isinstance(m, Metrics) and m.path == tmp_path / "env.jsonl"
    from mpicomm.observe import metrics as metrics_module
    assert str(m.path) in metrics_module._announced   # said on stderr at exit
    m.record(x=1)
    metrics_from(None).record(x=2)  # a second object of the run appends
    assert [r["x"] for r in _lines(tmp_path / "env.jsonl")] == [1, 2]
    Metrics(tmp_path / "env.jsonl", rank=0).record(x=3)  # an explicit path starts afresh
    assert [r["x"] for r in _lines(tmp_path / "env.jsonl")] == [3]
    with pytest.raises(TypeError, match="metrics must be"):
        metrics_from(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keep"):
        Metrics(keep=0)
    keep = Metrics(keep=2, rank=0)
    for i in range(5):
        keep.record(i=i)
    assert [r["i"] for r in keep.records] == [3, 4]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def test_gradient_sync_records_every_step(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPICOMM_METRICS", str(tmp_path / "sync.jsonl"))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradientSync(model, "gtopk", bucket_mb=0.0001) as sync:  # metrics from the env
        for step in range(3):
            opt.zero_grad()
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            if step < 2:
                sync.metrics.note(loss=loss.item())
                sync.step(opt)
            else:   # the same through step's own keyword
                sync.step(opt, loss=loss)
            assert sync.metrics.last["step"] == step
    records = _lines(tmp_path / "sync.jsonl")
    assert len(records) == 3
    assert records[-1]["loss"] == pytest.approx(loss.item())
    r = records[-1]
    assert r["strategy"] == "gtopk" and r["collective"] == "gtopk(butterfly)+allreduce(ring)"
    assert r["loss"] > 0 and r["dense_bytes"] == sum(
        p.numel() * 4 for p in model.parameters())
    assert r["comm_s"] > 0 and r["wait_s"] >= 0 and r["skipped"] is False
    assert r["predicted_comm_s"] == pytest.approx(predict_step_comm(sync))
    assert r["predicted_calibrated"] is False   # library defaults: the plot leaves it out


def test_local_sgd_tau_and_rounds() -> None:
    model = _model()
    local = LocalSGD(model, 2)
    m = Metrics(rank=0)
    for _ in range(4):
        local.step()
        m.observe(local, loss=1.0)
    assert [r["averaged"] for r in m.records] == [False, True, False, True]
    assert [r["rounds"] for r in m.records] == [0, 1, 1, 2]
    assert all(r["tau"] == 2 and r["strategy"] == "local-sgd" for r in m.records)
    assert m.records[0]["predicted_comm_s"] == 0.0
    assert m.records[1]["predicted_comm_s"] == predict_step_comm(local)


def test_every_loop_api_records_the_loss_it_is_given(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """LocalSGD.step(loss) and DistributedOptimizer.step(loss=...) (or its closure's
    value) put the loss into their records, from MPICOMM_METRICS as from metrics=."""
    monkeypatch.setenv("MPICOMM_METRICS", str(tmp_path / "env.jsonl"))
    model = _model()
    local = LocalSGD(model, 2)                       # metrics from the environment
    for i in range(3):
        local.step(torch.tensor(0.5 + i))
    assert [r["loss"] for r in local.metrics.records] == [0.5, 1.5, 2.5]
    assert [r["averaged"] for r in local.metrics.records] == [False, True, False]
    assert LocalSGD(model, 2, metrics=tmp_path / "own.jsonl").metrics.path == \
        tmp_path / "own.jsonl"

    m = Metrics(rank=0)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               metrics=m, bucket_mb=0.0001)
    x = torch.randn(4, 8)
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step(loss=loss)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        value = model(x).pow(2).mean()
        value.backward()
        return value

    returned = opt.step(closure)
    assert [r["loss"] for r in m.records] == pytest.approx([loss.item(), returned.item()])
    opt.sync.close()


def test_observe_strategy_and_bad_source() -> None:
    strategy = make("dense").bind(mpicomm.init())
    m = Metrics(rank=0)
    strategy.aggregate([torch.ones(10)])
    r = m.observe(strategy)
    assert r["dense_bytes"] == 40 and r["collective"] == "allreduce(auto)"
    strategy.aggregate([torch.ones(10)])
    assert m.observe(strategy)["dense_bytes"] == 40  # a delta, not the running total
    with pytest.raises(TypeError, match="cannot observe"):
        m.observe(object())


def _records() -> list[dict]:
    m = Metrics(rank=0)
    for i in range(20):
        m.record(loss=1.0 / (i + 1), sent_bytes=1000, dense_bytes=50_000,
                 collective="gtopk" if i < 10 else "allgather", tau=4 if i < 8 else 2,
                 comm_s=0.001, predicted_comm_s=0.0008)
        if i % 5 == 4:
            m.record("epoch", loss=0.5, accuracy=i / 20)
    return m.records


def test_plot_panels_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib", reason="plots need the 'plot' extra (matplotlib)")
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    assert cli.main(["plot", str(path), "-o", str(tmp_path / "x" / "o.png")]) == 0
    out = tmp_path / "x" / "o.png"
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000
    assert capsys.readouterr().out.strip() == f"plot written to {out}"
    assert cli.main(["plot", str(path)]) == 0   # default: the suffix replaced by .png
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out.strip() == f"plot written to {tmp_path / 'm.png'}"
    (tmp_path / "other.jsonl").write_text('{"a": 1}\n{"b": [2]}\n')   # JSON, not metrics
    assert cli.main(["plot", str(tmp_path / "other.jsonl")]) == 2
    assert "no metrics records" in capsys.readouterr().err
    assert not (tmp_path / "other.png").exists()
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    assert cli.main(["plot", str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert cli.main(["plot", str(tmp_path / "missing.jsonl")]) == 2
    capsys.readouterr()
    # records without a loss (a loop that never passed one): a plot, and how to get one
    lossless = tmp_path / "lossless.jsonl"
    lossless.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "loss"}) + "\n"
                                for r in _records() if r["kind"] == "step"))
    assert cli.main(["plot", str(lossless)]) == 0
    err = capsys.readouterr().err
    assert "no step loss in the records" in err and "sync.step(opt, loss=loss)" in err, err
    assert (tmp_path / "lossless.png").read_bytes()[:4] == b"\x89PNG"
    assert loss_note(_records()) is None


@pytest.mark.mpi
def test_gradient_sync_metrics_on_every_rank(comm: mpicomm.Communicator) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = Metrics()
    with GradientSync(model, "topk", comm=comm, metrics=m) as sync:
        for _ in range(2):
            opt.zero_grad()
            before = sync.strategy.stats.sent_bytes  # before backward: buckets go out during it
            model(torch.randn(4, 8) + comm.rank).pow(2).mean().backward()
            sync.step(opt)
            assert m.last["sent_bytes"] == sync.strategy.stats.sent_bytes - before
    assert len(m.records) == 2 and m.last["rank"] == mpicomm.world().rank
    assert m.last["predicted_comm_s"] > 0 or comm.size == 1
    if comm.size > 1:
        assert m.last["sent_bytes"] > 0 and m.last["compression"] > 1


@pytest.mark.mpi
def test_parameter_server_staleness_and_bytes(comm: mpicomm.Communicator) -> None:
    """PS mode: per-step records carry the pull's staleness (<= the SSP bound) and the
    bytes pushed/pulled since the previous record."""
    import numpy as np

    from mpicomm.ps import KVStore

    if comm.size < 2:
        pytest.skip("a parameter server needs >= 2 ranks (one server, one worker)")
    kv = KVStore(comm, servers=1, mode="ssp", staleness=1, lr=0.01)
    if kv.is_server:
        kv.serve()
        with pytest.raises(TypeError, match="workers"):
            Metrics().observe(kv)
        return
    m = Metrics()
    kv.init("x", np.zeros(32, dtype=np.float32))
    for _ in range(4):
        pushed = kv.stats()["bytes_pushed"]
        kv.push("x", np.ones(32, dtype=np.float32))
        kv.pull("x")
        rec = m.observe(kv)
        assert rec["strategy"] == "ps-ssp" and 0 <= rec["staleness"] <= 1
        assert rec["sent_bytes"] == kv.stats()["bytes_pushed"] - pushed > 0
        assert rec["recv_bytes"] > 0
    kv.close()


@pytest.mark.mpi
def test_auto_strategy_reports_its_compression_gain(comm: mpicomm.Communicator) -> None:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = Metrics()
    with GradientSync(model, "auto", comm=comm, metrics=m) as sync:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8) + comm.rank).pow(2).mean().backward()
            sync.step(opt)
    gains = [r["gain"] for r in m.records if "gain" in r]
    assert gains and all(0.0 <= g <= 1.0 for g in gains), m.records
    assert comm.allgather_object(gains[-1]) == [gains[-1]] * comm.size  # agreed
