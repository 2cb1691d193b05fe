"""``python -m mpicomm run`` and ``launchers/mpicomm-run`` run a bare ``python`` command
with their own interpreter (the venv's), not the first ``python`` on ``PATH``.

Serial; two 1-rank child jobs with a ``PATH`` whose first ``python`` is a decoy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpicomm.emulate.mpienv import own_python

from .launch import ROOT, clean_env

_SHOW = "import sys; print('EXE', sys.executable)"


def test_own_python_replaces_only_a_bare_python_of_this_version():
    major, minor = sys.version_info[:2]
    assert own_python(["python", "x.py"]) == [sys.executable, "x.py"]
    assert own_python([f"python{major}", "-c", "1"]) == [sys.executable, "-c", "1"]
    assert own_python([f"python{major}.{minor}"]) == [sys.executable]
    assert own_python(["/usr/bin/python3", "x.py"]) == ["/usr/bin/python3", "x.py"]
    assert own_python(["python2", "x.py"]) == ["python2", "x.py"]
    assert own_python(["env", "python"]) == ["env", "python"]
    assert own_python([]) == []
    assert own_python(["python"], "/opt/py") == ["/opt/py"]


def _decoy_env(tmp_path: Path) -> dict[str, str]:
    decoy = tmp_path / "bin"
    decoy.mkdir()
    for name in ("python", "python3"):
        script = decoy / name
        script.write_text("#!/bin/sh\necho DECOY\nexit 3\n")
        script.chmod(0o755)
    env = clean_env()
    env["PATH"] = os.pathsep.join([str(decoy), env.get("PATH", "")])
    for name in ("VIRTUAL_ENV", "MPICOMM_PYTHON"):
        env.pop(name, None)
    return env


def _executable(output: str) -> str:
    found = [line.split(" ", 1)[1] for line in output.splitlines() if line.startswith("EXE ")]
    assert found, output
    return found[0]


def test_python_m_mpicomm_run_uses_its_own_interpreter(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mpicomm", "run", "-n", "1", "--", "python",
                           "-c", _SHOW], cwd=ROOT, env=_decoy_env(tmp_path), timeout=240,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0 and "DECOY" not in proc.stdout, proc.stdout
    assert Path(_executable(proc.stdout)).resolve() == Path(sys.executable).resolve()


def test_shell_launcher_uses_the_checkouts_venv(tmp_path):
    venv_python = ROOT / ".venv" / "bin" / "python"
    if not venv_python.exists():
        pytest.skip("no .venv in this checkout (make install)")
    env = _decoy_env(tmp_path)
    env["PATH"] = os.pathsep.join([env["PATH"], str(Path(sys.executable).parent)])
    proc = subprocess.run(["bash", str(ROOT / "launchers" / "mpicomm-run"), "-n", "1",
                           "python", "-c", _SHOW], cwd=ROOT, env=env, timeout=240,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0 and "DECOY" not in proc.stdout, proc.stdout
    assert Path(_executable(proc.stdout)) == venv_python


def test_machine_record_drops_the_nul_open_mpi_counts_in_its_version(monkeypatch):
    """Open MPI 4.1 counts the terminating NUL in ``MPI_Get_library_version``'s length
    and mpi4py hands it on; every result's ``machine.mpi`` (and BENCHMARKS.md) must stay
    text."""
    from mpi4py import MPI

    from mpicomm.emulate import mpienv

    monkeypatch.setattr(MPI, "Get_library_version",
                        lambda: "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6\x00")
    assert mpienv.library_version() == "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6"
    assert mpienv.machine()["mpi"] == "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6"
    assert mpienv.mpi_flavor(mpienv.library_version()) == "openmpi"


def test_machine_record_names_the_cpu_and_torchs_kernels(monkeypatch):
    """Every result records the CPU model and, where the benchmark loaded torch, its
    version and CPU kernel level: training runs repeat bit for bit on one kind of CPU
    only. Without torch loaded the record leaves it out (and does not import it)."""
    import torch

    from mpicomm.emulate import mpienv

    m = mpienv.machine()
    assert isinstance(m["cpu"], str) and m["cpu"]
    assert m["torch"] == {"version": str(torch.__version__),
                          "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    monkeypatch.delitem(sys.modules, "torch")
    assert "torch" not in mpienv.machine() and "torch" not in sys.modules
    def no_cpuinfo(*args, **kwargs):
        raise OSError("no /proc/cpuinfo")

    monkeypatch.setattr(mpienv, "open", no_cpuinfo, raising=False)  # this module's only
    assert mpienv.cpu_model()   # platform.processor() or the machine's architecture
