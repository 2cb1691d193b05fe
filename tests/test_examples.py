"""The examples and the command line, run as child MPI jobs from a serial test.

``examples/train.py`` at 2 ranks for a couple of epochs (dense, gTop-k, local SGD with
AdaComm): exit status, the printed summary, and the JSON summary's values;
``examples/custom_loop.py``; ``python -m mpicomm info`` and ``python -m mpicomm run``
(including a failing rank's status reaching the caller). The whole file takes well under
a minute on two cores.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mpicomm import strategies
from mpicomm.control import FinalPhase

from .launch import ROOT, clean_env, load_script, run_job

TRAIN = ["--epochs", "2", "--threads", "1"]


def train(tmp_path: Path, *args: str, **env: str) -> tuple[str, dict[str, Any]]:
    """Run examples/train.py on 2 ranks; return its output and JSON summary."""
    out = tmp_path / "summary.json"
    res = run_job(2, [sys.executable, "examples/train.py", *TRAIN, *args, "--json", str(out)],
                  timeout=90, **env)
    assert res.returncode == 0, res.output
    assert "test accuracy" in res.output and "dense allreduce" in res.output, res.output
    return res.output, json.loads(out.read_text())


def check_summary(s: dict[str, Any]) -> None:
    for key in ("ranks", "mode", "describe", "test_accuracy", "test_loss", "train_loss",
                "steps", "wall_s", "sent_bytes_per_rank", "dense_bytes_per_rank",
                "compression", "history", "tau_history", "args"):
        assert key in s, key
    assert s["ranks"] == 2
    assert 0.0 <= s["test_accuracy"] <= 1.0 and 0.0 <= s["train_accuracy"] <= 1.0
    assert s["test_loss"] > 0 and s["wall_s"] > 0 and s["steps"] > 0
    assert s["sent_bytes_per_rank"] > 0 and s["dense_bytes_per_rank"] > 0
    assert len(s["history"]) == s["args"]["epochs"]


def test_train_dense(tmp_path: Path) -> None:
    output, s = train(tmp_path, "--strategy", "dense")
    check_summary(s)
    assert s["describe"]["strategy"] == "dense"
    # dense is its own yardstick: the same counters, the same bytes
    assert s["sent_bytes_per_rank"] == s["dense_bytes_per_rank"]
    assert s["test_accuracy"] > 0.5  # two epochs already learn the digits
    assert "%|" in output  # rank 0's tqdm bar


def test_train_gtopk(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    _, s = train(tmp_path, "--strategy", "gtopk", "--density", "0.01", "--no-progress",
                 "--metrics", str(metrics))
    check_summary(s)
    assert s["describe"]["strategy"] == "gtopk" and s["describe"]["density"] == 0.01
    assert s["sent_bytes_per_rank"] < s["dense_bytes_per_rank"]
    assert s["compression"] > 5
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert len(steps) == s["steps"] and len(epochs) == 2
    # the metrics are rank 0's; the coded pairs make the two ranks' totals differ: one of
    # them is the largest, and both average to the mean
    rank0 = sum(r["sent_bytes"] for r in steps)
    assert s["sent_bytes_max_rank"] in (rank0, 2 * s["sent_bytes_per_rank"] - rank0)
    assert all(r["strategy"] == "gtopk" and r["compression"] > 5 and r["loss"] > 0
               and r["predicted_comm_s"] > 0 and r["comm_s"] > 0 for r in steps)
    assert epochs[-1]["accuracy"] == s["history"][-1]["train_acc"]
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_train_local_sgd_adacomm(tmp_path: Path) -> None:
    """Metrics through MPICOMM_METRICS (not --metrics): loss and accuracy all the same."""
    metrics = tmp_path / "env.jsonl"
    output, s = train(tmp_path, "--local-sgd", "adacomm", "--tau0", "4", "--no-progress",
                      MPICOMM_METRICS=str(metrics))
    check_summary(s)
    assert s["mode"] == "local-sgd adacomm" and s["strategy"] is None
    assert s["tau_history"][0] == 4 and all(t >= 1 for t in s["tau_history"])
    assert s["sent_bytes_per_rank"] < s["dense_bytes_per_rank"]
    assert "AdaComm tau" in output
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == s["steps"] and all(r["loss"] > 0 and r["tau"] >= 1 for r in steps)
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["accuracy"] for r in epochs] == [h["train_acc"] for h in s["history"]]
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals and evals[-1]["accuracy"] == s["test_accuracy"]
    assert f"mpicomm: metrics written to {metrics} (MPICOMM_METRICS)" in output


def test_train_adacomm_starts_at_the_platforms_period(tmp_path: Path) -> None:
    """``--tau0 auto``: the first period is ``ceil(32 sqrt(D/Y))`` of the step and the
    averaging round measured before training (logged), and the run starts there."""
    output, s = train(tmp_path, "--local-sgd", "adacomm", "--tau0", "auto", "--no-progress")
    found = re.search(r"AdaComm tau0 = (\d+): a local step takes (\S+) ms, an averaging "
                      r"round (\S+) ms", output)
    assert found, output
    tau0, step_ms, round_ms = int(found[1]), float(found[2]), float(found[3])
    assert step_ms > 0 and round_ms > 0
    assert abs(tau0 - 32 * math.sqrt(round_ms / step_ms)) < 1.2   # ceil, 3 digits logged
    assert s["tau_history"][0] == tau0 and f"tau0={tau0}," in s["describe"]["adacomm"]


def _train_module() -> Any:
    return load_script("examples/train.py")


@pytest.mark.parametrize(("args", "message"), [
    # a forgotten --strategy: the default dense strategy takes none of these
    (["--density", "2"], "--strategy dense: takes no --density (strategies that do: "),
    (["--bits", "4"], "--strategy dense: takes no --bits"),
    (["--rank", "2"], "--strategy dense: takes no --rank"),
    (["--source", "var"], "--strategy dense: takes no --source"),
    (["--strategy", "gtopk", "--bits", "4"], "--strategy gtopk: takes no --bits"),
    (["--strategy", "artopk", "--coding", "log8"],
     "--strategy artopk: takes no --coding (strategies that do: gtopk, topk)"),
    # values the strategy rejects
    (["--strategy", "gtopk", "--density", "2"], "density must be in (0, 1]"),
    (["--strategy", "topk", "--density", "-0.1"], "density must be in (0, 1]"),
    (["--strategy", "qsgd", "--bits", "12"], "bits must be in [1, 8]"),
    (["--strategy", "powersgd", "--rank", "0"], "rank must be >= 1"),
    (["--strategy", "artopk", "--source", "nope"], "source must be one of"),
    (["--local-sgd", "fixed", "--strategy", "gtopk"], "takes no --strategy"),
    (["--local-sgd", "adacomm", "--density", "0.1"], "takes no --density"),
    (["--local-sgd", "adacomm", "--tau0", "0"], "--tau0 must be an integer >= 1 or 'auto'"),
    (["--local-sgd", "adacomm", "--tau0", "fast"], "got 'fast'"),
    (["--local-sgd", "fixed", "--finish", "0.01"], "takes no --finish"),
    # a denser end: its spec, and a strategy without a density schedule
    (["--strategy", "gtopk", "--finish", "2"], "bad --finish '2': density must be"),
    (["--strategy", "gtopk", "--finish", "0.01,0"], "fraction must be in (0, 1]"),
    (["--strategy", "topk", "--finish", "0.01,x"], "expected DENSITY[,FRACTION]"),
    (["--strategy", "dense", "--finish", "0.01"], "--strategy dense: takes no --finish"),
    # the optimizer's numbers
    (["--lr", "-0.1"], "--lr must be a positive number, got -0.1"),
    (["--momentum", "1.5"], "--momentum must be in [0, 1), got 1.5"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0"),
])
def test_train_rejects_options_in_one_line(args: list[str], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``--density 2`` with the default strategy trained densely without a word,
    and a bad value ended in a traceback from every rank and MPI_Abort."""
    train_py = _train_module()
    with pytest.raises(SystemExit) as exit_info:
        train_py.parse_args(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train.py: error: "), err
    assert message in err, err
    ok = train_py.parse_args(["--strategy", "gtopk", "--density", "0.05"])
    assert ok.strategy == "gtopk" and ok.density == 0.05
    assert train_py.parse_args([]).strategy == "dense"


def test_train_argument_error_is_one_line_from_rank_zero() -> None:
    res = run_job(2, [sys.executable, "examples/train.py", "--density", "2"], timeout=90)
    assert res.returncode == 2, res.output
    lines = [line for line in res.output.splitlines() if "error" in line.lower()]
    assert lines == ["train.py: error: --strategy dense: takes no --density (strategies "
                     "that do: artopk, gtopk, hier_artopk, hier_gtopk, hier_topk, randomk, "
                     "topk) (see --help)"], res.output
    assert "Traceback" not in res.output and "test accuracy" not in res.output


def test_custom_loop(tmp_path: Path) -> None:
    metrics = tmp_path / "loop.jsonl"
    res = run_job(2, [sys.executable, "examples/custom_loop.py"], timeout=90,
                  MPICOMM_METRICS=str(metrics))
    assert res.returncode == 0, res.output
    lines = [line for line in res.output.splitlines() if line.startswith("test accuracy")]
    assert len(lines) == 1, res.output  # printed by rank 0 only
    assert float(lines[0].split()[2]) > 0.8
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert all(r["loss"] > 0 for r in records if r["kind"] == "step")
    assert records[-1]["kind"] == "eval"
    assert f"{records[-1]['accuracy']:.4f}" == lines[0].split()[2]


def python_m_mpicomm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpicomm", *args], cwd=ROOT, env=clean_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=60)


def test_cli_info() -> None:
    res = python_m_mpicomm("info")
    assert res.returncode == 0, res.stdout
    for field in ("mpicomm", "mpi4py", "MPI library", "thread level", "CUDA-aware MPI",
                  "cost defaults"):
        assert field in res.stdout, res.stdout


def test_cli_run_and_exit_status() -> None:
    code = ("import sys; from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "sys.stdout.write(f'rank {{c.Get_rank()}} of {{c.Get_size()}}\\n'); sys.exit({})")
    ok = python_m_mpicomm("run", "-n", "2", "--", sys.executable, "-c", code.format(0))
    assert ok.returncode == 0, ok.stdout
    assert "rank 0 of 2" in ok.stdout and "rank 1 of 2" in ok.stdout
    bad = python_m_mpicomm("run", "-n", "2", sys.executable, "-c",
                           code.format("3 if c.Get_rank() == 1 else 0"))
    assert bad.returncode == 3, bad.stdout
    assert python_m_mpicomm("run", "-n", "2").returncode == 2  # no command


def test_launcher_env_for_open_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpicomm.emulate import mpienv

    assert mpienv.mpi_flavor("Open MPI v5.0.8, package: Open MPI") == "openmpi"
    assert mpienv.mpi_flavor("MPICH Version: 5.0.2") == "mpich"
    assert mpienv.launcher_env("mpich", 64, {"A": "1"}) == {"A": "1"}
    monkeypatch.setattr(mpienv, "usable_cores", lambda: 2)
    monkeypatch.setattr(mpienv.os, "geteuid", lambda: 0)
    env = mpienv.launcher_env("openmpi", 4, {"OMPI_MCA_btl": "tcp,self"})
    assert env["OMPI_MCA_btl"] == "tcp,self"  # the user's setting wins
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["PRTE_MCA_rmaps_default_mapping_policy"] == ":oversubscribe"
    monkeypatch.setattr(mpienv.os, "geteuid", lambda: 1000)
    env = mpienv.launcher_env("openmpi", 2, {})
    assert env == {"OMPI_MCA_btl": "^ofi"}  # not root, not oversubscribed


def test_train_schedule_and_momentum_correction(tmp_path: Path) -> None:
    _, s = train(tmp_path, "--strategy", "topk", "--density", "0.01", "--schedule",
                 "warmup:0.5@step", "--momentum-correction", "--clip-norm", "10",
                 "--coding", "none", "--no-progress")
    check_summary(s)
    d = s["describe"]
    assert d["schedule"] == "warmup:0.5@step" and d["momentum_correction"] == 0.9
    assert d["momentum_masking"] is True and d["clip_norm"] == 10.0
    assert s["test_accuracy"] > 0.5
    # one warm-up step at density 0.5, the rest at 0.01: (P-1)·k·8 bytes per step
    k_warm, k = -(-26122 // 2), -(-26122 // 100)
    assert s["sent_bytes_per_rank"] == 8 * (k_warm + (s["steps"] - 1) * k)


def test_train_topk_with_the_log8_coding(tmp_path: Path) -> None:
    """Top-k by name at density 0.01 (``--coding log8`` spelled out): the pairs in the
    compact format, fewer bytes than int32 indices and float32 values (8 a pair), plain
    error feedback, and the run still learns."""
    _, s = train(tmp_path, "--strategy", "topk", "--density", "0.01", "--no-progress")
    check_summary(s)
    assert s["describe"]["coding"] == "log8" and "momentum_correction" not in s["describe"]
    k = -(-26122 // 100)
    assert 0 < s["sent_bytes_per_rank"] < 8 * s["steps"] * k / 2
    assert s["test_accuracy"] > 0.5


def test_train_gtopk_by_name_codes_its_butterfly(tmp_path: Path) -> None:
    """gTop-k by name at density 0.01: the butterfly's pairs coded and the exact values
    at its indices, fewer bytes than with plain pairs (``--coding none``: 8 a pair), and
    the run still learns."""
    _, s = train(tmp_path, "--strategy", "gtopk", "--density", "0.01", "--no-progress")
    check_summary(s)
    assert (s["describe"]["coding"], s["describe"]["exact_values"]) == ("log8", True)
    assert s["test_accuracy"] > 0.5
    _, plain = train(tmp_path, "--strategy", "gtopk", "--density", "0.01", "--coding",
                     "none", "--no-progress")
    assert (plain["describe"]["coding"], plain["describe"]["exact_values"]) == (None, True)
    assert plain["steps"] == s["steps"]
    assert 0 < s["sent_bytes_per_rank"] < 0.75 * plain["sent_bytes_per_rank"]


def test_train_warmup_dense(tmp_path: Path) -> None:
    """``--warmup-dense``: the warm-up step at density 0.9 is a dense ring allreduce (the
    2-rank Allgather of 0.9·d pairs would send more), the rest top-k pairs."""
    _, s = train(tmp_path, "--strategy", "topk", "--density", "0.01", "--schedule",
                 "warmup:0.9@step", "--warmup-dense", "--coding", "none", "--no-progress")
    check_summary(s)
    assert s["describe"]["warmup_dense"] is True
    k = -(-26122 // 100)
    assert s["sent_bytes_per_rank"] == 4 * 26122 + 8 * (s["steps"] - 1) * k


def test_train_finish_ends_the_run_denser(tmp_path: Path) -> None:
    """``--finish 0.1,0.25``: density 0.1 for the last quarter of the run's steps, the
    density 0.01 before (Top-k's Allgather at 2 ranks: 8 bytes a pair); and around the
    schedule a name brings when ``--schedule`` is not given (gTop-k's ramp)."""
    _, s = train(tmp_path, "--strategy", "topk", "--density", "0.01", "--coding", "none",
                 "--finish", "0.1,0.25", "--no-progress")
    check_summary(s)
    steps = s["steps"]
    start = steps - round(steps / 4)
    assert s["describe"]["schedule"] == f"finish:0.1,{start}"
    k, k_end = -(-26122 // 100), -(-26122 // 10)
    assert s["sent_bytes_per_rank"] == 8 * (start * k + (steps - start) * k_end)
    assert s["test_accuracy"] > 0.5
    train_py = _train_module()
    args = train_py.parse_args(["--strategy", "gtopk", "--density", "0.001", "--finish",
                                "0.01", "--epochs", "10"])
    schedule = train_py.build_strategy(args, steps_per_epoch=30).schedule
    assert schedule == FinalPhase(0.01, 270, strategies.recipe("gtopk", 0.001)["schedule"])


def test_train_takes_the_workloads_recipe_where_no_option_is_given() -> None:
    """The optimizer settings, epochs and batch left out are the workload's (what the
    benchmarks train it with), a given one wins, and the synchronized gradient is clipped
    as the recipe says (``text-lm``: 0.5, from the harness)."""
    train_py = _train_module()
    lm = train_py.parse_args(["--workload", "text-lm", "--strategy", "topk"])
    assert (lm.lr, lm.momentum, lm.weight_decay, lm.epochs, lm.batch_size) == \
        (5.0, 0.0, 0.0, 1, 3)
    assert train_py.spec_of(lm).clip_norm is None   # the harness reads the recipe's
    digits = train_py.parse_args(["--lr", "0.2", "--epochs", "3"])
    assert (digits.lr, digits.momentum, digits.weight_decay, digits.epochs,
            digits.batch_size) == (0.2, 0.9, 1e-3, 3, 32)
