"""The timeline of everything (mpicomm.observe.trace over mpicomm.hooks): traced
front-ends, merged Chrome trace.

Multi-rank: inside ``trace.recording`` every collective, sparse collective, strategy
aggregation, GradientSync bucket/wait event and AdaComm decision is recorded; rank 0's
merged file is valid Chrome-trace JSON with one pid per rank, spans nest properly per
thread (a strategy's span encloses its collectives), dense spans carry the algorithm
``auto`` chose and the cost model's prediction, and traffic counts match the
communicator's. Serial: ``MPICOMM_TIMELINE`` in a 3-rank child job writes the merged
trace at exit; with nothing active a traced call is the plain function; the plot of a
trace.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import mpicomm
from mpicomm import hooks
from mpicomm.control import AdaComm
from mpicomm.observe import trace
from mpicomm.observe.plot import span_depths
from mpicomm.strategies import make
from mpicomm.torch import GradientSync

from .launch import run_job


def check_trace(doc: dict, ranks: int) -> list[dict]:
    """Chrome-trace validity: returns the spans; asserts metadata, fields and nesting."""
    events = doc["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    assert {e["pid"] for e in meta if e["name"] == "process_name"} == set(range(ranks))
    spans = [e for e in events if e["ph"] == "X"]
    for e in events:
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["name"], e
    for e in spans:
        assert e["dur"] >= 0 and e["args"].get("self_us", 0) <= e["dur"] + 1e-3, e
    span_depths(spans)  # raises on spans that overlap without nesting
    return spans


@pytest.mark.mpi
def test_recording_everything(comm: mpicomm.Communicator) -> None:
    # rank 0's own directory: pytest's per-process tmp dirs are pruned by the other ranks
    folder = tempfile.mkdtemp(prefix="mpicomm-trace-") if comm.rank == 0 else None
    path = Path(comm.bcast_object(folder) or ".") / "t.json"
    try:
        _record_and_check(comm, path)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _record_and_check(comm: mpicomm.Communicator, path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2))
    with trace.recording(path, comm) as tl:
        mpicomm.allreduce(np.ones(1000, dtype=np.float32), comm=comm)
        mpicomm.allgather(np.ones(10), algorithm="ring", comm=comm)
        make("gtopk", density=0.1).bind(comm).aggregate([torch.randn(200)])
        with GradientSync(model, "dense", comm=comm) as sync:
            model(torch.randn(3, 6)).sum().backward()
            sync.wait()
        ada = AdaComm(4, interval_rounds=1)
        ada.start(2.0, 0.1)
        ada.observe(1.0, 0.1)
        with tl.span("user block", cat="user"):
            pass
    assert trace.active() is None
    comm.barrier()
    if comm.rank != 0:
        return
    spans = check_trace(json.loads(path.read_text()), comm.size)
    by_name: dict[str, list[dict]] = {}
    for e in spans:
        by_name.setdefault(e["name"], []).append(e)
    for name in ("allreduce", "allgather", "gtopk.aggregate", "dense.aggregate",
                 "adacomm.observe", "user block", "wait"):
        assert {e["pid"] for e in by_name[name]} == set(range(comm.size)), name
    ar = [e for e in by_name["allreduce"] if e["args"].get("bytes") == 4000 and e["pid"] == 0]
    assert ar and ar[0]["args"]["chosen_by"] == "cost model"
    assert ar[0]["args"]["algorithm"] in mpicomm.collectives.ALGORITHMS["allreduce"]
    if comm.size > 1:
        assert ar[0]["args"]["predicted_s"] > 0 and ar[0]["args"]["sent"] > 0
        gtopk = [e for e in spans if e["name"] == "gtopk" and e["pid"] == 0]
        assert gtopk and gtopk[0]["args"]["k"] == 20 and gtopk[0]["args"]["predicted_s"] > 0
    # the strategy's span encloses its sparse collective, on the same thread
    agg = [e for e in by_name["gtopk.aggregate"] if e["pid"] == 0][0]
    inner = [e for e in spans if e["name"] == "gtopk" and e["pid"] == 0
             and e["tid"] == agg["tid"]]
    assert inner and agg["ts"] <= inner[0]["ts"] <= inner[0]["ts"] + inner[0]["dur"] \
        <= agg["ts"] + agg["dur"] + 1e-3
    assert agg["args"]["self_us"] < agg["dur"]  # the nested time is not its own
    assert by_name["adacomm.observe"][0]["args"]["tau"] >= 1
    assert any(e["name"].startswith("aggregate bucket") for e in spans)  # gradsync thread
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e["ph"] == "i" and e["name"].startswith("bucket") for e in events)
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert "mpicomm-gradsync" in names


def test_untraced_call_is_plain() -> None:
    assert trace.active() is None
    out = mpicomm.allreduce(np.arange(4.0), op="sum")
    np.testing.assert_array_equal(out, np.arange(4.0) * mpicomm.world().size)
    assert mpicomm.allreduce.__wrapped__ is not None  # the decorator is there
    with hooks.block("x") as args:
        assert args is None  # nothing records


def test_observers_register_and_unregister_with_hooks() -> None:
    """Any object with the recorder / watch methods can observe the core; after it
    unregisters, traced calls are plain calls again."""

    class Recorder:
        def __init__(self) -> None:
            self.spans: list[tuple[str, str, dict]] = []

        def now(self) -> float:
            return 0.0

        def complete(self, name: str, start_us: float, end_us: float, cat: str = "",
                     **args: object) -> None:
            self.spans.append((name, cat, args))

        def span(self, name: str, cat: str = "", **args: object):
            return contextlib.nullcontext()

        def instant(self, name: str, cat: str = "", **args: object) -> None:
            self.spans.append((name, "instant", args))

    class Watch:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def enter(self, name: str, comm: mpicomm.Communicator) -> str:
            self.calls.append(name)
            return name

        def leave(self, token: str) -> None:
            self.calls.append(f"/{token}")

    rec, watch = Recorder(), Watch()
    assert hooks.set_recorder(rec) is None and hooks.set_watch(watch) is None
    try:
        assert hooks.recording() and trace.active() is None  # not a Timeline
        mpicomm.allreduce(np.ones(8, dtype=np.float32))
        hooks.instant("mark", "user", step=1)
    finally:
        assert hooks.set_recorder(None) is rec and hooks.set_watch(None) is watch
    name, cat, args = rec.spans[0]
    assert (name, cat) == ("allreduce", "collective")
    assert args["bytes"] == 32 and args["ranks"] == mpicomm.world().size
    assert rec.spans[1] == ("mark", "instant", {"step": 1})
    assert watch.calls == ["allreduce", "/allreduce"]
    mpicomm.allreduce(np.ones(8, dtype=np.float32))  # unregistered: nothing more
    assert len(rec.spans) == 2 and len(watch.calls) == 2


def test_env_timeline_child_job(tmp_path: Path) -> None:
    out = tmp_path / "env-trace.json"
    code = ("import numpy as np, mpicomm; c = mpicomm.init(); "
            "[mpicomm.allreduce(np.ones(64), comm=c) for _ in range(3)]; "
            "mpicomm.broadcast(np.ones(8), root=1, comm=c)")
    res = run_job(3, [sys.executable, "-c", code], timeout=90, MPICOMM_TIMELINE=str(out))
    assert res.returncode == 0, res.output
    assert res.output.count(f"mpicomm: trace written to {out}") == 1, res.output
    spans = check_trace(json.loads(out.read_text()), 3)
    for rank in range(3):
        mine = [e["name"] for e in spans if e["pid"] == rank]
        assert mine.count("allreduce") == 3 and mine.count("broadcast") == 1, mine
    pytest.importorskip("matplotlib", reason="plots need the 'plot' extra (matplotlib)")
    from mpicomm.observe.plot import plot_trace

    png = plot_trace(out, tmp_path / "trace.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
