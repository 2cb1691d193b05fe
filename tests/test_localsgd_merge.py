"""``benchmarks/localsgd_merge.py``: seeds and schedules of a ``bench localsgd`` comparison
run as separate jobs merge into exactly the result of one job (model clock)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .launch import load_script, run_job

ARGS = ["-m", "mpicomm.bench", "localsgd", "--workload", "digits-mlp", "--hidden", "8",
        "--clock", "model", "--step-ms", "1", "--rate-gbit", "1", "--latency-us", "50",
        "--budget-s", "0.06", "--taus", "4", "--eval-every", "4"]


def _merge_module():
    return load_script("benchmarks/localsgd_merge.py")


def _job(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    result = run_job(1, [sys.executable, *ARGS, *extra, "--json", str(out)], timeout=240)
    assert result.returncode == 0, result.output
    return json.loads(out.read_text())


def test_separate_jobs_merge_into_the_one_job_result(tmp_path, capsys):
    module = _merge_module()
    merge = module.merge
    whole = _job(tmp_path, "whole", "--seeds", "2")
    seed0 = _job(tmp_path, "seed0", "--seeds", "1", "--schedules", "fixed,decay")
    seed1 = _job(tmp_path, "seed1", "--seeds", "1", "--seed-offset", "1")
    merged = merge([seed1, seed0], ["seed1.json", "seed0.json"])
    # the command line writes the same result, with the note, and prints the targets
    out = tmp_path / "merged.json"
    assert module.main([str(out), str(tmp_path / "seed1.json"), str(tmp_path / "seed0.json"),
                        "--note", "two jobs"]) == 0
    written = json.loads(out.read_text())
    assert written["note"] == "two jobs" and written["targets"] == merged["targets"]
    assert capsys.readouterr().out.count("'speedup_target_met'") == len(merged["targets"])
    for key in ("rows", "summary", "targets", "curves"):
        assert json.loads(json.dumps(merged[key])) == whole[key], key
    # the run records too, but for the wall-clock seconds of each step
    walls = [{k: v for k, v in r.items() if k != "step_s"} for r in merged["training_runs"]]
    assert walls == [{k: v for k, v in r.items() if k != "step_s"}
                     for r in whole["training_runs"]]
    assert merged["args"]["seeds"] == 2 and merged["args"]["seed_offset"] == 0
    assert merged["merged_from"] == ["seed1.json", "seed0.json"]
    # a merged result renders like any other
    assert {"model_clock", "step_s", "delay_s"} <= set(merged)

    with pytest.raises(ValueError, match="more than one result"):
        merge([seed0, seed0], ["a", "b"])
    with pytest.raises(ValueError, match="no run of"):
        merge([seed0, dict(seed1, rows=seed1["rows"][:1], curves=seed1["curves"][:1],
                           training_runs=seed1["training_runs"][:1])], ["a", "b"])
    other = dict(seed1, args=dict(seed1["args"], lr=0.5))
    with pytest.raises(ValueError, match="options \\['lr'\\] differ"):
        merge([seed0, other], ["a", "b"])
    slower = dict(seed1, step_s=seed1["step_s"] * 2)
    with pytest.raises(ValueError, match="step or round time differs"):
        merge([seed0, slower], ["a", "b"])
    with pytest.raises(ValueError, match="not a bench localsgd result"):
        merge([seed0, {"suite": "ps"}], ["a", "b"])
