"""One message per failure (mpicomm.abort): child ``mpiexec`` jobs whose output lines are
counted, and the rules that compose the message (no MPI).

Serial tests; each child job takes a few seconds (the failing ranks wait up to 3 s for
each other's reports).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from mpicomm.abort import EXIT_INTERRUPTED, EXIT_USAGE, _Failure, compose_report

from .launch import ROOT, clean_env, run_job

_SCRIPT = textwrap.dedent("""
    import sys, time, numpy as np, mpicomm
    comm = mpicomm.init()
    mode = sys.argv[1]
    if mode == "same":            # what an argument check does: the same on every rank
        time.sleep(0.3 * comm.rank)   # ranks that reach it at different times
        raise ValueError("--lr must be positive, got -0.1")
    if mode == "some":            # two ranks fail differently, the others wait forever
        if comm.rank in (1, 3):
            time.sleep(0.2 + 0.1 * comm.rank)
            raise RuntimeError(f"boom on rank {comm.rank}")
        mpicomm.allreduce(np.ones(4), comm=comm)
    if mode == "sleep":           # until Ctrl-C
        sys.stdout.write(f"ready {comm.rank}\\n"); sys.stdout.flush()
        while True:
            time.sleep(0.05)
""")


#: Lines of MPICH's hydra when it sees a rank exit before it handles the abort (a race
#: of the launcher's that a loaded machine shows): its box of ``=`` lines and the three
#: sentences after it.
_HYDRA_CLEANUP = ("=", "YOUR APPLICATION TERMINATED WITH THE EXIT STRING",
                  "This typically refers to a problem with your application",
                  "Please see the FAQ page for debugging suggestions")


def lines(output: str) -> list[str]:
    """Output lines, less the launcher's own (MPICH's mpiexec announces Ctrl-C and may
    box a rank's exit during the abort)."""
    return [line for line in output.splitlines()
            if line.strip() and not line.startswith(("[mpiexec@", *_HYDRA_CLEANUP))]


@pytest.mark.parametrize("ranks", [1, 3, 5])
def test_the_same_error_on_every_rank_is_one_message_from_rank_zero_exit_2(ranks):
    result = run_job(ranks, [sys.executable, "-c", _SCRIPT, "same"], timeout=120)
    assert result.returncode == EXIT_USAGE, result.output
    out = lines(result.output)
    assert out[0] == "python -c: error: --lr must be positive, got -0.1", result.output
    on = f" on all {ranks} ranks" if ranks > 1 else ""
    assert len(out) == 2 and f"(ValueError{on}, raised at <string>:7" in out[1], out


def test_a_bad_environment_value_is_one_line():
    result = run_job(2, [sys.executable, "-c", "import mpicomm; mpicomm.init()"],
                     timeout=120, MPICOMM_CHECK="banana")
    assert result.returncode == EXIT_USAGE, result.output
    out = lines(result.output)
    assert len(out) == 2, out
    assert out[0].startswith("python -c: error: MPICOMM_CHECK='banana': expected one of"), out


def test_an_unexpected_error_is_one_traceback_naming_the_ranks_that_failed():
    result = run_job(5, [sys.executable, "-c", _SCRIPT, "some"], timeout=120)
    assert result.returncode == 1, result.output
    out = lines(result.output)
    # rank 3 fails 0.2 s after rank 1: within the report window (1 s) on an idle
    # machine, possibly after it on a loaded one, when rank 1 reports alone
    assert out[0] in (f"[mpicomm rank 1/5] uncaught exception; aborting the job (ranks that "
                      f"failed: {ranks} of 5):" for ranks in ("1, 3", "1")), result.output
    assert result.output.count("Traceback") == 1 and out[-1] == "RuntimeError: boom on rank 1"
    assert "MPI_Abort" not in result.output and "boom on rank 3" not in result.output
    assert result.seconds < 60, result


_IMPLICIT = textwrap.dedent("""
    import time, numpy as np, mpicomm
    mpicomm.allreduce(np.ones(4))     # no init: the first collective makes the world
    rank = mpicomm.world().rank
    if rank == 1:
        time.sleep(0.3)
        raise RuntimeError("boom on rank 1")
    mpicomm.allreduce(np.ones(4))     # the others wait for rank 1
""")


@pytest.mark.parametrize("ranks", [3, 5])
def test_without_init_a_failure_on_one_rank_still_ends_the_job(ranks):
    result = run_job(ranks, [sys.executable, "-c", _IMPLICIT], timeout=120)
    assert result.returncode == 1, result.output
    out = lines(result.output)
    assert out[0] == (f"[mpicomm rank 1/{ranks}] uncaught exception; aborting the job "
                      f"(ranks that failed: 1 of {ranks}):"), result.output
    assert result.output.count("Traceback") == 1 and out[-1] == "RuntimeError: boom on rank 1"
    assert result.seconds < 60, result


@pytest.mark.parametrize("ranks", [3, 5])
def test_without_init_a_bad_argument_before_any_collective_is_one_message(ranks):
    script = "from mpicomm import strategies\nstrategies.make('gtopk', density=2)"
    result = run_job(ranks, [sys.executable, "-c", script], timeout=120)
    assert result.returncode == EXIT_USAGE, result.output
    out = lines(result.output)
    assert out[0] == "python -c: error: density must be in (0, 1], got 2", result.output
    assert len(out) == 2 and f"(ValueError on all {ranks} ranks" in out[1], out


def test_init_without_abort_on_error_removes_the_handler_the_import_installed():
    script = ("import sys, mpicomm\nassert sys.excepthook is not sys.__excepthook__\n"
              "mpicomm.init(abort_on_error=False)\n"
              "assert sys.excepthook is sys.__excepthook__\nprint('RESTORED', flush=True)")
    result = run_job(3, [sys.executable, "-c", script], timeout=120)
    assert result.returncode == 0, result.output
    assert result.output.count("RESTORED") == 3, result.output


_NAMED_SEGMENTS = """
from mpi4py import MPI                # MPI_Init: MPICH maps its named node segment
named = [line.split()[-1] for line in open("/proc/self/maps")
         if "/dev/shm/mpich_shm_" in line and not line.rstrip().endswith("(deleted)")]
print("SEGMENTS", *sorted(set(named)), flush=True)
"""

_ABORTED = _NAMED_SEGMENTS + textwrap.dedent("""
    import time, numpy as np, mpicomm
    comm = mpicomm.init()
    mpicomm.allreduce(np.ones(4), comm=comm)
    if comm.rank == 1:
        time.sleep(0.3)
        raise RuntimeError("boom on rank 1")
    mpicomm.allreduce(np.ones(4), comm=comm)
""")

_KILLED = _NAMED_SEGMENTS + textwrap.dedent("""
    import os, signal, numpy as np, mpicomm
    comm = mpicomm.init()
    mpicomm.allreduce(np.ones(4), comm=comm)
    if comm.rank == 1:            # no handler runs: the launcher ends the others
        os.kill(os.getpid(), signal.SIGKILL)
    mpicomm.allreduce(np.ones(4), comm=comm)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
@pytest.mark.parametrize("script", [_ABORTED, _KILLED], ids=["aborted", "killed"])
def test_a_failed_job_leaves_no_mpi_shared_memory_behind(script):
    result = run_job(3, [sys.executable, "-c", script], timeout=120)
    assert result.returncode != 0, result.output
    named = {p for line in result.output.splitlines() if line.startswith("SEGMENTS")
             for p in line.split()[1:]}
    if not named:
        pytest.skip("this MPI library keeps no named segment in /dev/shm (not MPICH)")
    assert [p for p in named if os.path.exists(p)] == []


def _alive(marker: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def test_ctrl_c_prints_interrupted_once_and_leaves_no_process():
    marker = f"mpicomm-ctrl-c-{uuid.uuid4().hex}"
    # a terminal's Ctrl-C: SIGINT to the foreground process group, here the launcher's
    proc = subprocess.Popen([sys.executable, "-m", "mpicomm", "run", "-n", "3", "--", "python",
                             "-c", _SCRIPT, "sleep", marker], cwd=ROOT, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    chunks: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            chunks.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # the launcher may join the ranks' lines ("ready 0ready 1\n\n"): count words
        deadline = time.monotonic() + 120
        while "".join(chunks).count("ready") < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "".join(chunks).count("ready") == 3, "".join(chunks)
        before = len(chunks)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    rest = "".join(chunks[before:])
    assert proc.returncode == EXIT_INTERRUPTED, rest
    assert lines(rest) == ["python -c: interrupted"], rest
    time.sleep(0.5)
    assert _alive(marker) == []


# ---------------------------------------------------------------------- the rules
def failure(rank: int, kind: str = "usage", type_: str = "ValueError", message: str = "bad",
            t: float = 0.0, explicit: bool = False) -> _Failure:
    return _Failure(rank=rank, kind=kind, type=type_, message=message, where="x.py:3 in f",
                    text=f"Traceback ...\n{type_}: {message} (rank {rank})\n",
                    header=f"[mpicomm rank {rank}/4]", explicit=explicit, time=t)


@pytest.mark.parametrize(("failures", "first_line", "code"), [
    ([failure(r) for r in range(4)], "prog: error: bad", EXIT_USAGE),
    ([failure(r, explicit=True) for r in range(4)], "prog: error: bad", EXIT_USAGE),
    ([failure(0), failure(1, "interrupt", "KeyboardInterrupt", "")], "prog: interrupted",
     EXIT_INTERRUPTED),
    ([failure(r) for r in range(3)],
     "[mpicomm rank 0/4]; aborting the job (ranks that failed: 0, 1, 2 of 4):", 1),
    ([failure(r, "error", "KeyError", "k") for r in range(4)],
     "[mpicomm rank 0/4]; aborting the job (the same on all 4 ranks):", 1),
    ([failure(0, t=2.0), failure(2, message="other", t=1.0)],
     "[mpicomm rank 2/4]; aborting the job (ranks that failed: 0, 2 of 4):", 1),
])
def test_compose_report(failures, first_line, code):
    text, status = compose_report({f.rank: f for f in failures}, 4, "prog")
    assert text.splitlines()[0] == first_line and status == code
    explicit = all(f.explicit for f in failures)
    if first_line == "prog: error: bad":
        assert len(text.splitlines()) == (1 if explicit else 2)
    if code == 1:   # the earliest failure's traceback, once
        first = min(failures, key=lambda f: (f.time, f.rank))
        assert text.count("Traceback") == 1 and f"(rank {first.rank})" in text


def test_compose_report_with_traceback_requested():
    text, status = compose_report({r: failure(r) for r in range(4)}, 4, "prog", True)
    assert status == EXIT_USAGE and "Traceback" in text and "(rank 0)" in text
