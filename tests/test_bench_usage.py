"""``python -m mpicomm.bench`` under mpiexec: a bad option ends the job with one
argparse-style error line from rank 0 and exit status 2, never a traceback per rank.

Serial tests that start child ``mpiexec`` jobs (tests/launch.py); about 5 s each.
"""

from __future__ import annotations

import sys

import pytest

from .launch import run_job


@pytest.mark.parametrize("args, message", [
    # a density above 1, rejected by argparse (`--densities 0.5,3`)
    (["sparse", "--densities", "0.5,3"], "values must be in (0, 1]"),
    # found by the suite in run() (UsageError), after MPI is up
    (["ps", "--sections", "communication"], "unknown sections ['communication']"),
    # found by argparse in the suite's sub-parser
    (["crossover", "--steps", "many"], "argument --steps: invalid int value"),
    # a virtual link's framing, checked before any virtual cluster starts
    (["vclock", "--nets", "1gbit:1ms", "--framing", "jumbo"],
     "MPICOMM_VIRTUAL_FRAMING='jumbo'"),
])
def test_a_bad_option_is_one_error_line_from_rank_zero(args, message):
    result = run_job(2, [sys.executable, "-m", "mpicomm.bench", *args], timeout=120)
    assert result.returncode == 2, result.output
    errors = [line for line in result.output.splitlines() if "error:" in line]
    assert len(errors) == 1, result.output
    assert errors[0].startswith(f"python -m mpicomm.bench {args[0]}: error: "), errors
    assert message in errors[0]
    assert "Traceback" not in result.output and "MPI_Abort" not in result.output


def test_help_is_plain_text_with_a_line_per_suite(capsys):
    from mpicomm.bench.__main__ import available, main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":class:" not in out and ":mod:" not in out, out
    for name in available():
        entry = [line for line in out.splitlines() if line.strip().startswith(name + " ")]
        assert entry and len(entry[0].split(None, 1)[1]) > 20, (name, out)
    assert "compressed against dense push on digits" in " ".join(out.split())  # ps whole
    with pytest.raises(SystemExit):
        main(["ps", "--help"])
    suite = capsys.readouterr().out
    assert suite.count("Parameter server:") == 1 and "``" not in suite
