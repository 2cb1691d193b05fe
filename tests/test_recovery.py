"""``python -m mpicomm run --restarts K --checkpoint-dir DIR``: restarts, refusals, and kill -9
of a rank at a random step with a bitwise (or exactly-once) resume, and the same through
examples/train.py and examples/train_ps.py (--checkpoint-dir, --save-model).

The kill tests run one trial each at 2-3 ranks (async mode, SSP without the bound, is
left to ``python -m mpicomm.bench recovery``, which runs trials per scenario:
benchmarks/results/recovery-*.json).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpicomm.bench import recovery

from .launch import ROOT, clean_env

PY = sys.executable


def mpicomm_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "mpicomm", "run", *args], cwd=ROOT, env=clean_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


def test_restarts_a_failed_job_and_exports_the_directory(tmp_path):
    """A command that fails (status 3) on its first two starts: restarted twice, each
    start told its number; status 2 (bad input) is never restarted."""
    log = tmp_path / "starts"
    script = (f'echo "$MPICOMM_RESTART $MPICOMM_CHECKPOINT_DIR" >> {log}; '
              'test "$MPICOMM_RESTART" -ge 2 || exit 3')
    res = mpicomm_run("-n", "1", "--restarts", "3", "--checkpoint-dir", str(tmp_path), "--",
                      "sh", "-c", script)
    assert res.returncode == 0, res.stdout
    assert log.read_text().split("\n")[:3] == [f"{i} {tmp_path}" for i in range(3)]
    assert res.stdout.count("the job failed (exit status 3)") == 2, res.stdout
    log.unlink()
    res = mpicomm_run("-n", "1", "--restarts", "1", "--", "sh", "-c",
                      f"echo x >> {log}; exit 3")
    assert res.returncode == 3 and log.read_text() == "x\nx\n", res.stdout
    assert "after 1 restart(s); giving up" in res.stdout
    log.unlink()
    res = mpicomm_run("-n", "1", "--restarts", "3", "--", "sh", "-c", f"echo x >> {log}; exit 2")
    assert res.returncode == 2 and log.read_text() == "x\n", res.stdout


def test_sigterm_ends_every_process_of_the_job(tmp_path):
    """SIGTERM to ``python -m mpicomm run --restarts``: status 143, no restart, and the
    ranks (in a process group of their own) are gone too."""
    pidfile = tmp_path / "pid"
    proc = subprocess.Popen([PY, "-m", "mpicomm", "run", "-n", "1", "--restarts", "2", "--",
                             "sh", "-c", f"echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; "
                             "exec sleep 120"], cwd=ROOT, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        rank = int(pidfile.read_text())
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and "restart" not in out, out
    with pytest.raises(ProcessLookupError):
        os.kill(rank, 0)


@pytest.mark.parametrize("args,message", [
    (["--restarts", "-1"], "--restarts must be >= 0, got -1"),
    (["--checkpoint-dir", "/nonexistent/ckpt"], "no such directory"),
])
def test_bad_arguments_are_one_line_before_any_start(tmp_path, args, message):
    marker = tmp_path / "started"
    res = mpicomm_run("-n", "2", *args, "--", "touch", str(marker))
    assert res.returncode == 2 and not marker.exists()
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m mpicomm run: ") and \
        message in lines[0], res.stdout


def test_restart_phases_add_up_along_the_slowest_rank():
    """Each phase ends when the last rank is through it; missing stages are left out."""
    base = {"failed_at": 10.5, "launched_at": 10.6, "restart": 1}
    marks = [dict(base, rank=0, process_at=10.7, module_at=11.0, main_at=12.0, init_at=12.1,
                  restored_at=12.3, first_step_at=12.5),
             dict(base, rank=1, process_at=10.8, module_at=11.2, main_at=11.9, init_at=12.1,
                  restored_at=12.4, first_step_at=None),
             dict(base, rank=2, process_at=float("nan"), module_at=11.1, main_at=12.0,
                  init_at=12.2, restored_at=12.2)]
    phases = recovery.restart_phases(10.0, marks)
    assert phases == pytest.approx({
        "detect_s": 0.5, "relaunch_s": 0.1, "spawn_s": 0.2, "python_mpi_s": 0.4,
        "imports_s": 0.8, "init_s": 0.2, "restore_s": 0.2, "first_step_s": 0.1})
    assert sum(phases.values()) == pytest.approx(12.5 - 10.0)
    assert recovery.restart_phases(10.0, [{"rank": 0, "module_at": 11.0}]) == {}


# ---------------------------------------------------------------------- kill -9
STEPS, EVERY = 12, 4


def _trial(mode: str, victim: int, tmp_path, seed: int) -> dict:
    kill_step = random.Random(seed).randint(2, STEPS - 2)
    return recovery.kill_trial(mode, 3, victim, kill_step, str(tmp_path / f"kill-{mode}"),
                               steps=STEPS, every=EVERY, step_ms=30.0, staleness=2)


@pytest.mark.parametrize("mode,victim", [("sync", 2), ("peer", 1)])
def test_kill_at_a_random_step_resumes_bitwise(tmp_path, mode, victim):
    """Parameter server (the server killed) and GradientSync with Top-k + error feedback
    (a rank killed): the final model equals an uninterrupted run's, bit for bit. Then the
    checkpoint of these 3 ranks is refused by a job of 2: one error line, exit status 2,
    no restart, the checkpoints untouched."""
    reference = recovery.reference_run(mode, 3, str(tmp_path / "reference"), steps=STEPS,
                                       every=EVERY)
    trial = _trial(mode, victim, tmp_path, seed=len(mode))
    assert trial["status"] == 0 and trial["restarts"] == 1, Path(trial["log"]).read_text()
    assert trial["kill_step"] is not None
    assert recovery.bitwise_equal(reference, trial["save"])
    assert trial["kill_to_train_s"] > 0 and trial["load_s"] >= 0
    if mode != "peer":
        return
    folder = tmp_path / f"kill-{mode}" / "ckpt"
    before = {d: sorted(os.listdir(folder / d)) for d in os.listdir(folder)}
    job = [PY, "-m", "mpicomm.bench.recovery_job", mode, "--steps", str(STEPS),
           "--every", str(EVERY), "--step-ms", "0"]
    res = mpicomm_run("-n", "2", "--restarts", "2", "--checkpoint-dir", str(folder), "--",
                      *job)
    assert res.returncode == 2, res.stdout
    errors = [line for line in res.stdout.splitlines() if "error" in line]
    assert len(errors) == 1 and "job of 3 ranks" in errors[0] and \
        "this job has 2" in errors[0], res.stdout
    assert "restart" not in res.stdout
    assert {d: sorted(os.listdir(folder / d)) for d in os.listdir(folder)} == before


def test_kill_applies_every_push_exactly_once(tmp_path):
    """A worker killed in SSP mode: every (worker, step) push counted once in the final
    value, and the staleness bound held by the restarted servers and workers."""
    trial = _trial("ssp", 1, tmp_path, seed=7)
    assert trial["status"] == 0 and trial["restarts"] == 1, Path(trial["log"]).read_text()
    assert trial["exactly_once"] and trial["applied"] == trial["expected"] == 2 * STEPS
    assert trial["server_staleness"] <= 2 and trial["worker_staleness"] <= 2


# ---------------------------------------------------------------------- the examples
def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(k) for k in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


def _kill_a_rank_after_a_checkpoint(cmd: list[str], folder: Path, script: str,
                                    after_step: int) -> subprocess.CompletedProcess:
    """Run ``cmd`` (a ``python -m mpicomm run --restarts 1`` job); once a complete
    checkpoint of step ``after_step`` or later is in ``folder``, SIGKILL one rank."""
    from mpicomm.checkpoint import layout

    proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        killed = False
        while not killed and proc.poll() is None:
            time.sleep(0.02)
            if any(step >= after_step for step, _ in layout.complete_steps(str(folder))):
                for pid in sorted(_descendants(proc.pid)):
                    try:
                        if script in Path(f"/proc/{pid}/cmdline").read_text():
                            os.kill(pid, signal.SIGKILL)
                            killed = True
                            break
                    except (OSError, ProcessLookupError):
                        continue
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the launcher ends every process of the job
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


@pytest.mark.parametrize("script,ranks,extra", [
    ("examples/train.py", 2, ["--strategy", "topk", "--density", "0.05"]),
    ("examples/train_ps.py", 3, ["--servers", "1", "--mode", "sync"]),
])
def test_examples_killed_and_restarted_match_an_uninterrupted_run(tmp_path, script, ranks,
                                                                  extra):
    """The examples' --checkpoint-dir / --save-model: a rank killed by SIGKILL after a
    checkpoint, the job restarted by ``--restarts 1``: the final model equals an
    uninterrupted run's, bit for bit."""
    common = [PY, script, "--epochs", "4", "--hidden", "32", "--no-progress",
              "--checkpoint-every", "5", *extra]
    res = mpicomm_run("-n", str(ranks), "--", *common, "--save-model",
                      str(tmp_path / "reference.pt"), timeout=300)
    assert res.returncode == 0, res.stdout
    folder = tmp_path / "ckpt"
    folder.mkdir()
    res = _kill_a_rank_after_a_checkpoint(
        [PY, "-m", "mpicomm", "run", "-n", str(ranks), "--restarts", "1", "--checkpoint-dir",
         str(folder), "--", *common, "--save-model", str(tmp_path / "resumed.pt")],
        folder, script, after_step=10)
    assert res.returncode == 0 and "restart 1 of 1" in res.stdout, res.stdout
    assert "resumed from" in res.stdout, res.stdout
    assert recovery.bitwise_equal(str(tmp_path / "reference.pt"), str(tmp_path / "resumed.pt"))
