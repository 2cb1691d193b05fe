"""``python -m mpicomm run --servers S``: the server count reaches every rank and the
exit status still passes through."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mpicomm import cli

from .launch import ROOT, clean_env

SCRIPT = ("import sys; from mpi4py import MPI; from mpicomm.cli import ps_servers; "
          "r = MPI.COMM_WORLD.Get_rank(); print(f'rank {r} servers {ps_servers()}'); "
          "sys.exit(4 if r == 2 else 0)")


def mpicomm_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpicomm", "run", *args], cwd=ROOT,
                          env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=60)


def test_servers_reach_every_rank_and_status_passes_through() -> None:
    res = mpicomm_run("-n", "3", "--servers", "2", "--", sys.executable, "-c", SCRIPT)
    assert res.returncode == 4, res.stdout
    for r in range(3):
        assert f"rank {r} servers 2" in res.stdout, res.stdout


@pytest.mark.parametrize("servers", ["0", "3", "-1"])
def test_servers_out_of_range(servers: str, capsys: pytest.CaptureFixture) -> None:
    code = cli.main(["run", "-n", "3", "--servers", servers, "--", sys.executable, "-c", "0"])
    assert code == 2 and "--servers must be in [1, 2]" in capsys.readouterr().err


def test_ps_servers_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.ENV_PS_SERVERS, raising=False)
    assert cli.ps_servers() is None and cli.ps_servers(1) == 1
    monkeypatch.setenv(cli.ENV_PS_SERVERS, "3")
    assert cli.ps_servers(1) == 3
    for bad in ("0", "two", "-2"):
        monkeypatch.setenv(cli.ENV_PS_SERVERS, bad)
        with pytest.raises(ValueError, match="MPICOMM_PS_SERVERS"):
            cli.ps_servers()


SLURM = str(ROOT / "launchers" / "slurm-mpicomm.sbatch")


def slurm_env(tmp_path, **extra: str) -> dict[str, str]:
    return clean_env(SLURM_SUBMIT_DIR=str(ROOT), SLURM_NTASKS="2", SLURM_JOB_NUM_NODES="2",
                     SLURM_JOB_NODELIST="node[01-02]", SLURM_CPUS_PER_TASK="1",
                     VENV=str(Path(sys.executable).parent.parent), INFO="0", **extra)


def test_slurm_template_mpiexec_branch_runs_the_job(tmp_path) -> None:
    """The batch script outside Slurm (its variables faked): the mpiexec branch starts
    SLURM_NTASKS ranks of the given command, passes --servers on, keeps the status."""
    res = subprocess.run(["bash", SLURM, sys.executable, "-c", SCRIPT], cwd=ROOT,
                         env=slurm_env(tmp_path, LAUNCH="mpiexec", SERVERS="1"),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=90)
    assert res.returncode == 0, res.stdout  # rank 2 (exit 4) does not exist with 2 ranks
    assert "rank 0 servers 1" in res.stdout and "rank 1 servers 1" in res.stdout, res.stdout


def test_slurm_template_srun_branch(tmp_path) -> None:
    fake = tmp_path / "srun"
    fake.write_text('#!/bin/sh\necho "srun $*"\nexit 3\n')
    fake.chmod(0o755)
    env = slurm_env(tmp_path, LAUNCH="srun")
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    res = subprocess.run(["bash", SLURM, "prog", "--flag"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=60)
    assert res.returncode == 3, res.stdout
    assert "srun --mpi=pmix --cpu-bind=cores prog --flag" in res.stdout, res.stdout
