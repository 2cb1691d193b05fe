"""The examples' summaries tell the truth: "fewer" only when fewer, 3 significant digits,
pushed and pulled bytes both counted, the right script and roles (serial; the 1-rank
check of examples/train_ps.py is a child job)."""

from __future__ import annotations

import sys

import pytest

from .launch import load_script, run_job

summary = load_script("examples/summary_text.py")
train_ps = load_script("examples/train_ps.py")


@pytest.mark.parametrize(("ours", "dense", "text"), [
    (7.243e6, 7.210e6, "0.458% more bytes"),
    (7.210e6, 7.243e6, "0.458% fewer bytes"),
    (1e6, 38.64e6, "38.6x fewer bytes"),
    (5e6, 1e6, "5x more bytes"),
    (3e6, 3e6, "as many bytes"),
    (0, 3e6, "n/a"),
])
def test_compare_bytes(ours, dense, text):
    assert summary.compare_bytes(ours, dense) == text


def test_settings_are_rounded_not_json():
    out = summary.plain({"alpha": 3.0517578125e-05, "beta": 1.2345678901234e-09, "on": True,
                       "ratios": [0.1, 0.0333333333], "inner": {"x": 2.0 / 3.0}, "n": 7})
    assert out == ("{alpha=3.05e-05, beta=1.23e-09, on=True, ratios=[0.1, 0.0333], "
                   "inner={x=0.667}, n=7}")


def test_ps_traffic_counts_pushes_and_pulls():
    stats = [{"bytes_pushed": 118_976, "bytes_pulled": 4_933_496},
             {"bytes_pushed": 120_000, "bytes_pulled": 4_900_000}]
    t = train_ps.traffic_summary(stats, {"dense_bytes_per_rank": 4_600_000})
    mean = (118_976 + 4_933_496 + 120_000 + 4_900_000) / 2
    assert t["sent_bytes_per_rank"] == mean
    assert t["compression"] == pytest.approx(9_200_000 / mean)
    assert "pushed 0.119 MB + pulled 4.92 MB" in t["traffic"][0]
    assert t["traffic"][1].endswith("1.83x fewer bytes"), t["traffic"]


def test_print_summary_names_the_script_and_roles(capsys):
    s = {"script": "examples/train_ps.py", "roles": "2 workers, 1 server", "ranks": 3,
         "mode": "parameter server (sync)", "epochs": 1, "steps": 10,
         "describe": {"lr": 0.05}, "metric": "accuracy", "test_accuracy": 0.9,
         "test_metric": 0.9, "test_loss": 0.3, "train_accuracy": 0.9, "train_loss": 0.3,
         "wall_s": 1.0, "train_s": 0.5, "tau_history": None,
         "traffic": ["per worker        pushed 1 MB + pulled 1 MB = 2 MB"]}
    summary.print_summary(s)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("== mpicomm examples/train_ps.py: 3 ranks (2 workers, 1 server), "
                      "parameter server (sync), 1 epoch, 10 steps")
    assert out[1] == "settings          {lr=0.05}" and out[-1].startswith("per worker")


def test_train_ps_on_one_rank_is_one_usage_line():
    res = run_job(1, [sys.executable, "examples/train_ps.py", "--epochs", "1"], timeout=240)
    assert res.returncode == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("train_ps.py: error: --servers 1 needs "
                                                   "at least 2 ranks"), res.output
