"""The stall inspector (mpicomm.observe.stall), in 3-rank child jobs (serial tests).

Rank 0 enters a world allreduce while rank 1 sleeps outside any collective and rank 2
waits for rank 1 in an allreduce over ranks [1, 2]: with ``MPICOMM_STALL_S=1`` rank 0
reports both missing ranks and where each of them is, rank 2 reports rank 1, and the job
still finishes normally; rank 1, which never waited, reports nothing. ``0`` or no
variable (outside checked mode) leaves it off; bad values and arguments are refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mpicomm.observe.stall import StallInspector, start_from_env

from .launch import run_job

JOB = """
import time, numpy as np, mpicomm
comm = mpicomm.init()
pair = comm.split(None if comm.rank == 0 else 1)
if comm.rank == 1:
    time.sleep(2.5)                           # rank 1: outside any collective
if pair is not None:
    mpicomm.allreduce(np.ones(4), comm=pair)  # rank 2 waits here for rank 1
mpicomm.allreduce(np.ones(4), comm=comm)      # rank 0 waits here for both
from mpicomm.observe import stall
reports = stall._env_inspector.reports if stall._env_inspector else []
print(f"rank {comm.rank} reports {len(reports)}", flush=True)
if pair is not None:
    pair.free()
"""


def _job(tmp_path: Path, **env: str):
    script = tmp_path / "stall_job.py"
    script.write_text(JOB)
    return run_job(3, [sys.executable, str(script)], timeout=120, **env)


def test_stall_reports_missing_ranks_and_where_they_are(tmp_path: Path) -> None:
    res = _job(tmp_path, MPICOMM_STALL_S="1")
    out = res.output
    assert res.returncode == 0, out  # the job is not stopped
    assert "[mpicomm rank 0] stall: waiting" in out and "in allreduce" in out, out
    assert "(call #1 over ranks [0, 1, 2])" in out, out
    rank0 = out[out.index("[mpicomm rank 0] stall"):].split("arrived: ranks")[0]
    assert "not arrived: rank 1: in no mpicomm collective (none called yet)" in rank0, out
    assert "not arrived: rank 2: in allreduce (call #1 over ranks [1, 2])" in rank0, out
    assert "[mpicomm rank 2] stall: waiting" in out, out
    rank2 = out[out.index("[mpicomm rank 2] stall"):].split("arrived: ranks")[0]
    assert "over ranks [1, 2]" in rank2 and "not arrived: rank 1" in rank2, out
    assert "rank 0 reports 1" in out and "rank 2 reports 1" in out, out
    assert "rank 1 reports 0" in out, out


def test_off_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPICOMM_STALL_S", "0")
    assert start_from_env(check=True) is None  # 0 turns it off, also in checked mode
    monkeypatch.delenv("MPICOMM_STALL_S")
    assert start_from_env(check=False) is None  # off unless asked for


def test_bad_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPICOMM_STALL_S", "soon")
    with pytest.raises(ValueError, match="MPICOMM_STALL_S"):
        start_from_env()
    monkeypatch.setenv("MPICOMM_STALL_S", "-1")
    with pytest.raises(ValueError, match="MPICOMM_STALL_S"):
        start_from_env()
    for bad in (0, -2.0, True, "5"):
        with pytest.raises(ValueError, match="threshold_s"):
            StallInspector(bad)  # type: ignore[arg-type]
