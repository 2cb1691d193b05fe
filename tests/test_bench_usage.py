"""``python -m mpicomm.bench`` under mpiexec: a bad option ends the job with one
argparse-style error line from rank 0 and exit status 2, never a traceback per rank.

Serial tests that start child ``mpiexec`` jobs (tests/launch.py); about 5 s each.
"""

from __future__ import annotations

import sys

import pytest

from .launch import run_job


@pytest.mark.parametrize("args, message", [
    # found by the suite in run() (UsageError), after MPI is up
    (["ps", "--sections", "communication"], "unknown sections ['communication']"),
    # found by argparse in the suite's sub-parser
    (["crossover", "--steps", "many"], "argument --steps: invalid int value"),
])
def test_a_bad_option_is_one_error_line_from_rank_zero(args, message):
    result = run_job(2, [sys.executable, "-m", "mpicomm.bench", *args], timeout=120)
    assert result.returncode == 2, result.output
    errors = [line for line in result.output.splitlines() if "error:" in line]
    assert len(errors) == 1, result.output
    assert errors[0].startswith(f"python -m mpicomm.bench {args[0]}: error: "), errors
    assert message in errors[0]
    assert "Traceback" not in result.output and "MPI_Abort" not in result.output
