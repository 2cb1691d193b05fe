"""Recovery: kill -9 a rank at a random step, restart, resume; check nothing is lost or doubled.

Run in one process (it launches the jobs itself)::

    python -m mpicomm.bench recovery --trials 10 --json benchmarks/results/recovery.json

Each trial starts ``python -m mpicomm run -n N --restarts 2 --checkpoint-dir DIR --
python -m mpicomm.bench.recovery_job MODE`` (:mod:`mpicomm.bench.recovery_job`), waits
until rank 0 has done a step drawn at random (uniform over the run, seeded), sends
``SIGKILL`` to the chosen rank and waits for the job, which the launcher restarts and
which resumes from its newest complete checkpoint. Scenarios (``--scenarios``):

``sync-server`` / ``sync-worker``
    parameter server in BSP mode, a random server (resp. worker) killed; pass = the final
    model is bitwise equal to an uninterrupted run's (:data:`torch.equal` on every tensor).
``peer``
    :class:`~mpicomm.torch.GradientSync` with Top-k and error feedback, a random rank
    killed; pass = bitwise equal to an uninterrupted run.
``async`` / ``ssp``
    a random worker or server killed; pass = every (worker, step) push applied exactly
    once (the job's one-hot counting key) and, for SSP, the largest staleness served
    after the restart at most the bound.

Per trial: the step and rank killed, the step resumed from, the exit status, and
``kill_to_train_s`` = from the kill to the end of the first step after the restore,
with ``load_s`` (the restore itself) beside it. Target: ``kill_to_train_s - load_s <
10`` s. That time is split into phases (:data:`PHASES`) from the timestamps the launcher
(``MPICOMM_RESTART_FAILED_AT``, ``_LAUNCHED_AT``) and every rank of the restarted job
(``phases-<rank>.json``, :data:`mpicomm.bench.recovery_job.PHASES`) write; each phase
ends when the last rank is through it, so the phases add up to ``kill_to_train_s``.
Timings need a quiet machine (each restart starts ``N`` Python processes that import
torch); the correctness checks do not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from ._util import UsageError, print_table, write_json

SCENARIOS = ("sync-server", "sync-worker", "peer", "async", "ssp")
_JOB_MODE = {"sync-server": "sync", "sync-worker": "sync", "peer": "peer", "async": "async",
             "ssp": "ssp"}
#: Launcher variables of a parent MPI job that a child job must not inherit.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "OMPI_COMM_", "OMPI_MCA_orte_", "MPI_LOCAL",
                      "PRTE_MCA_ess")


#: The phases of a restart: (name, from, to) over the timestamps of the kill, the
#: launcher and the slowest rank of the restarted job.
PHASES = (
    ("detect_s", "killed_at", "failed_at"),         # the launcher (mpiexec) sees the
                                                    # death, ends the other ranks, exits
    ("relaunch_s", "failed_at", "launched_at"),     # the supervisor starts mpiexec again
    ("spawn_s", "launched_at", "process_at"),       # mpiexec starts every rank's process
    ("python_mpi_s", "process_at", "module_at"),    # Python, import mpicomm, MPI_Init
    ("imports_s", "module_at", "main_at"),          # import torch and the job's modules
    ("init_s", "main_at", "init_at"),               # mpicomm.init
    ("restore_s", "init_at", "restored_at"),        # build the model, find and load the
                                                    # newest complete checkpoint
    ("first_step_s", "restored_at", "first_step_at"),  # the first step after it
)


def restart_phases(killed_at: float, marks: list[dict[str, Any]]) -> dict[str, float]:
    """The :data:`PHASES` of one restart from every rank's ``phases-<rank>.json``
    (``marks``): each stage's time is the latest over the ranks; missing stages are left
    out."""
    def latest(name: str) -> float | None:
        vals = [m[name] for m in marks if isinstance(m.get(name), (int, float))
                and m[name] == m[name]]
        return max(vals) if vals else None

    at = {"killed_at": killed_at, **{name: latest(name) for _, name, _ in PHASES[1:]},
          "first_step_at": latest("first_step_at")}
    out = {}
    for phase, start, end in PHASES:
        if at.get(start) is not None and at.get(end) is not None:
            out[phase] = at[end] - at[start]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated subset of {', '.join(SCENARIOS)}")
    parser.add_argument("--trials", type=int, default=10, help="kills per scenario")
    parser.add_argument("--ranks", type=int, default=4, help="ranks per job")
    parser.add_argument("--servers", type=int, default=1, help="parameter-server ranks")
    parser.add_argument("--steps", type=int, default=30, help="training steps per job")
    parser.add_argument("--every", type=int, default=4, help="checkpoint period (steps)")
    parser.add_argument("--step-ms", type=float, default=30.0,
                        help="extra time per step (sleep), so that kills land mid-run")
    parser.add_argument("--staleness", type=int, default=2, help="SSP bound")
    parser.add_argument("--seed", type=int, default=0, help="draws of the kill step and rank")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    parser.add_argument("--workdir", default=None, help="keep the jobs' folders here")


def child_env() -> dict[str, str]:
    """This environment without a parent launcher's variables, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def job_command(mode: str, ranks: int, folder: str, *, restarts: int, steps: int,
                every: int, step_ms: float, servers: int = 1, staleness: int = 2,
                save: str | None = None, progress: str | None = None,
                json_path: str | None = None) -> list[str]:
    """The ``python -m mpicomm run`` command line of one recovery job."""
    cmd = [sys.executable, "-m", "mpicomm", "run", "-n", str(ranks), "--restarts",
           str(restarts), "--checkpoint-dir", folder, "--", sys.executable, "-m",
           "mpicomm.bench.recovery_job", mode, "--steps", str(steps), "--every", str(every),
           "--step-ms", str(step_ms), "--servers", str(servers), "--staleness",
           str(staleness)]
    for flag, value in (("--save", save), ("--progress", progress), ("--json", json_path)):
        if value:
            cmd += [flag, value]
    return cmd


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def kill_trial(mode: str, ranks: int, victim: int, kill_step: int, workdir: str, *,
               steps: int, every: int, step_ms: float, servers: int = 1,
               staleness: int = 2, timeout: float = 300.0) -> dict[str, Any]:
    """One job killed at ``kill_step`` (rank 0's count) by ``SIGKILL`` of rank ``victim``
    and restarted; the facts of the run (module docstring). ``workdir`` must be empty."""
    folder, progress = os.path.join(workdir, "ckpt"), os.path.join(workdir, "progress")
    os.makedirs(folder)
    save, facts_path = os.path.join(workdir, "final.pt"), os.path.join(workdir, "facts.json")
    cmd = job_command(mode, ranks, folder, restarts=2, steps=steps, every=every,
                      step_ms=step_ms, servers=servers, staleness=staleness, save=save,
                      progress=progress, json_path=facts_path)
    log_path = os.path.join(workdir, "job.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        killed_at, killed_step, deadline = None, None, time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
            if killed_at is not None:
                continue
            step = (_read(os.path.join(progress, "step")) or "").split()
            pid = (_read(os.path.join(progress, f"pid-{victim}")) or "").split()
            if len(step) == 2 and step[1] == "0" and int(step[0]) >= kill_step and \
                    len(pid) == 2 and pid[1] == "0":
                try:
                    os.kill(int(pid[0]), signal.SIGKILL)
                    killed_at, killed_step = time.time(), int(step[0])
                except ProcessLookupError:
                    pass
        if proc.poll() is None:  # timed out: the launcher ends every process of the job
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        status = proc.wait()
    facts = json.loads(_read(facts_path) or "{}")
    resumed = json.loads(_read(os.path.join(progress, "resumed.json")) or "{}")
    out: dict[str, Any] = {"mode": mode, "victim": victim, "kill_step": killed_step,
                           "status": status, "restored_step": facts.get("restored_step"),
                           "restarts": facts.get("restart")}
    if killed_at is not None and resumed.get("first_step_at"):
        out["kill_to_train_s"] = resumed["first_step_at"] - killed_at
        out["load_s"] = resumed.get("load_s")
        marks = [json.loads(_read(os.path.join(progress, name)) or "{}")
                 for name in sorted(os.listdir(progress)) if name.startswith("phases-")]
        out.update(restart_phases(killed_at, marks))
    for key in ("exactly_once", "applied", "expected", "twice", "missing",
                "server_staleness", "worker_staleness"):
        if key in facts:
            out[key] = facts[key]
    out["save"] = save if os.path.exists(save) else None
    out["log"] = log_path
    return out


def reference_run(mode: str, ranks: int, workdir: str, *, steps: int, every: int,
                  servers: int = 1, timeout: float = 300.0) -> str:
    """An uninterrupted run's final model (its path); ``RuntimeError`` if it failed."""
    folder = os.path.join(workdir, "ckpt")
    os.makedirs(folder)
    save = os.path.join(workdir, "final.pt")
    cmd = job_command(mode, ranks, folder, restarts=0, steps=steps, every=every,
                      step_ms=0.0, servers=servers, save=save)
    res = subprocess.run(cmd, env=child_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if res.returncode != 0 or not os.path.exists(save):
        raise RuntimeError(f"reference run of {mode} failed ({res.returncode}):\n{res.stdout}")
    return save


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def bitwise_equal(a: str, b: str) -> bool:
    """Whether two saved ``state_dict`` files hold the same tensors, bit for bit."""
    import torch

    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def judge(trial: dict[str, Any], reference: str | None, staleness: int) -> bool:
    """Whether a trial passed (module docstring)."""
    if trial["status"] != 0 or trial["kill_step"] is None or not trial.get("restarts"):
        return False
    if trial["mode"] in ("async", "ssp"):
        ok = bool(trial.get("exactly_once"))
        if trial["mode"] == "ssp":
            ok = ok and trial.get("server_staleness", staleness + 1) <= staleness
        return ok
    return reference is not None and trial["save"] is not None and \
        bitwise_equal(reference, trial["save"])


def victims(scenario: str, ranks: int, servers: int) -> list[int]:
    """The ranks a scenario may kill."""
    workers = ranks - servers
    if scenario == "sync-server":
        return list(range(workers, ranks))
    if scenario == "sync-worker":
        return list(range(workers))
    return list(range(ranks))


def summarize(rows: list[dict[str, Any]], scenarios: list[str]
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per scenario: the verdicts and restart times, and the median of every phase."""
    summary, phases = [], []
    for scenario in scenarios:
        mine = [r for r in rows if r["scenario"] == scenario]
        timed = [r for r in mine if "kill_to_train_s" in r]
        restart = [r["kill_to_train_s"] - (r["load_s"] or 0) for r in timed]
        summary.append({"scenario": scenario, "trials": len(mine),
                        "passed": sum(r["passed"] for r in mine),
                        "median_kill_to_train_s": _median([r["kill_to_train_s"]
                                                           for r in timed]),
                        "max_kill_to_train_s": max((r["kill_to_train_s"] for r in timed),
                                                   default=None),
                        "max_restart_s_without_load": max(restart, default=None),
                        "max_load_s": max((r["load_s"] or 0 for r in timed), default=None)})
        phases.append({"scenario": scenario, **{
            name: _median([r[name] for r in timed if name in r]) for name, _, _ in PHASES}})
    return summary, phases


def run(args: argparse.Namespace) -> int:
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        raise UsageError(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    if args.trials < 1 or args.steps < 2 * args.every or not 1 <= args.servers < args.ranks:
        raise UsageError("need --trials >= 1, --steps >= 2 * --every and "
                         "1 <= --servers < --ranks")
    from ..emulate.mpienv import machine

    rng = random.Random(args.seed)
    root = args.workdir or tempfile.mkdtemp(prefix="mpicomm-recovery-")
    common = dict(steps=args.steps, every=args.every, servers=args.servers)
    rows: list[dict[str, Any]] = []
    references: dict[str, str] = {}
    t0 = time.perf_counter()

    def save() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The JSON so far (after every trial: an interrupted run keeps its trials)."""
        summary, phases = summarize(rows, scenarios)
        kept = [{k: v for k, v in r.items() if k not in ("log", "save")} for r in rows]
        write_json(args.json, {"suite": "recovery", "machine": machine(),
                               "ranks": args.ranks, "args": vars(args),
                               "load_average": os.getloadavg(), "summary": summary,
                               "phases": phases, "trials": kept})
        return summary, phases

    for scenario in scenarios:
        mode = _JOB_MODE[scenario]
        if mode in ("sync", "peer") and mode not in references:
            ref_dir = os.path.join(root, f"reference-{mode}")
            references[mode] = reference_run(mode, args.ranks, ref_dir, timeout=args.timeout,
                                             **common)
        for i in range(args.trials):
            victim = rng.choice(victims(scenario, args.ranks, args.servers))
            kill_step = rng.randint(2, args.steps - 2)
            work = os.path.join(root, f"{scenario}-{i}")
            trial = kill_trial(mode, args.ranks, victim, kill_step, work,
                               step_ms=args.step_ms, staleness=args.staleness,
                               timeout=args.timeout, **common)
            trial["scenario"] = scenario
            trial["passed"] = judge(trial, references.get(mode), args.staleness)
            rows.append(trial)
            print(f"{scenario} trial {i}: killed rank {victim} at step {trial['kill_step']}, "
                  f"resumed from {trial['restored_step']}: "
                  f"{'pass' if trial['passed'] else 'FAIL (' + trial['log'] + ')'}",
                  flush=True)
            if args.json:
                save()
    summary, phases = save()
    print_table(summary, ["scenario", "trials", "passed", "median_kill_to_train_s",
                          "max_kill_to_train_s", "max_restart_s_without_load", "max_load_s"])
    print("median phase of a restart (s; each ends when the last rank is through it):")
    print_table(phases, ["scenario", *(name for name, _, _ in PHASES)])
    print(f"(took {time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.1f}: "
          "restart times need a quiet machine)")
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r["passed"] for r in rows) else 1
