"""``python -m mpicomm --version`` and ``python -m mpicomm strategies`` (serial, in process;
the pipe closed early is a child process)."""

from __future__ import annotations

import pytest

import mpicomm
from mpicomm.cli import main, strategies_table
from mpicomm.strategies import available
from mpicomm.torch.strategy_options import strategy_option_names


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"mpicomm {mpicomm.__version__}"


def test_strategies_lists_every_name_with_its_options(capsys):
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == strategies_table().strip()
    rows = {}
    for line in out.splitlines()[1:]:
        if line and not line.startswith(" "):
            name = line.split()[0]
            rows[name] = line
        elif line.startswith(" ") and rows:
            rows[name] += " " + line.strip()
    assert set(available()) <= set(rows), sorted(set(available()) - set(rows))
    for name in available():
        for option in strategy_option_names(name) or ():
            assert f"{option}=" in rows[name] or f" {option}," in rows[name], (name, option)
    assert "density=None" in rows["gtopk"] and "rank=4" in rows["powersgd"]
    assert max(len(line) for line in out.splitlines()) <= 100


def test_output_into_a_closed_pipe_is_no_traceback():
    """``python -m mpicomm strategies | head -1``: the reader leaves, no traceback."""
    import os
    import subprocess
    import sys

    from .launch import ROOT, clean_env

    read, write = os.pipe()
    os.close(read)   # before the child writes: its first write fails with EPIPE
    proc = subprocess.run([sys.executable, "-m", "mpicomm", "strategies"], cwd=ROOT,
                          env=clean_env(), stdout=write, stderr=subprocess.PIPE, text=True,
                          timeout=120)
    os.close(write)
    assert "Traceback" not in proc.stderr and proc.returncode == 1, proc.stderr
