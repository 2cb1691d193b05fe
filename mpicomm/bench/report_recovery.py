"""The benchmark report's section for the ``recovery`` suite (:mod:`mpicomm.bench.recovery`):
the verdicts per scenario, the median phases of a restart, then one row per kill."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: A trial's columns, in order (those no trial of the file has are left out).
TRIAL_COLUMNS = ("scenario", "victim", "kill_step", "restored_step", "status", "passed",
                 "applied", "expected", "twice", "missing", "server_staleness",
                 "kill_to_train_s", "load_s", "detect_s", "relaunch_s", "spawn_s",
                 "python_mpi_s", "imports_s", "init_s", "restore_s", "first_step_s")


def recovery_section(r: dict[str, Any], table: Callable[..., str]) -> str:
    """Summary, median restart phases and every trial of a recovery result."""
    trials = r.get("trials", [])
    cols = [c for c in TRIAL_COLUMNS if any(c in t for t in trials)]
    load = r.get("load_average")
    where = (f"load average {load[0]:.1f} when it ended: the times are loaded, the "
             "verdicts are not" if load else "")
    parts = ["summary" + (f" ({where})" if where else "") + ":\n\n"
             + table(r.get("summary", []))]
    if r.get("phases"):
        parts.append("median phases of a restart (s; each ends when the last rank of the "
                     "restarted job is through it, so they add up to kill_to_train_s):\n\n"
                     + table(r["phases"]))
    if trials:
        parts.append("trials (one kill -9 each):\n\n" + table(trials, cols))
    return "\n".join(parts)
