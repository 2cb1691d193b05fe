"""tests/launch.py: child jobs see the project first and keep the inherited PYTHONPATH;
the launcher's leftover topology files are cleaned up."""

from __future__ import annotations

import os
import sys
import time

from . import launch
from .launch import ROOT, clean_env, python_path, run_job


def test_python_path_prepends_the_project_root():
    assert python_path(None) == str(ROOT)
    assert python_path("") == str(ROOT)
    assert python_path(os.pathsep.join(["/a", "/b"])) == os.pathsep.join([str(ROOT), "/a",
                                                                          "/b"])
    # the root is not listed twice when the parent already had it
    assert python_path(os.pathsep.join([str(ROOT), "/a"])) == os.pathsep.join([str(ROOT),
                                                                               "/a"])


def test_clean_env_keeps_the_inherited_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/site")
    assert clean_env()["PYTHONPATH"] == os.pathsep.join([str(ROOT), "/somewhere/site"])
    monkeypatch.delenv("PYTHONPATH")
    assert clean_env()["PYTHONPATH"] == str(ROOT)


def test_child_job_imports_from_the_inherited_path(tmp_path, monkeypatch):
    """As on the GPU machine, where pytest-mpi came from PYTHONPATH: a module found only
    through the parent's PYTHONPATH is importable in the child, next to mpicomm."""
    (tmp_path / "only_on_inherited_path.py").write_text("VALUE = 42\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    result = run_job(1, [sys.executable, "-c",
                         "import only_on_inherited_path as m, mpicomm; print('got', m.VALUE)"],
                     timeout=60)
    assert result.returncode == 0, result.output
    assert "got 42" in result.output


def test_hydra_topology_files_go_only_when_no_launcher_is_alive(tmp_path):
    """The clean-up at the end of the serial run: this user's leftover topology files are
    removed when no launcher runs, kept while one does; other names stay."""
    left = [tmp_path / "hydra_hwloc_xmlfile_a1B2c3", tmp_path / "hydra_hwloc_xmlfile_Zz9"]
    other = tmp_path / "hydra_pmi_other"
    for path in (*left, other):
        path.write_text("<topology/>")
    past = time.time() - 5
    for path in (*left, other):
        os.utime(path, (past, past))
    assert launch.remove_hydra_topology_files(str(tmp_path), running=lambda: True) == []
    assert all(p.exists() for p in left)
    removed = launch.remove_hydra_topology_files(str(tmp_path), running=lambda: False)
    assert sorted(removed) == sorted(map(str, left))
    assert not any(p.exists() for p in left) and other.exists()


def test_launchers_running_reads_the_process_names(tmp_path):
    for pid, name in (("12", "python3\n"), ("34", "bash\n"), ("self", "mpiexec\n")):
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "comm").write_text(name)
    assert not launch.launchers_running(str(tmp_path))  # "self" is not a process number
    (tmp_path / "56").mkdir()
    (tmp_path / "56" / "comm").write_text("hydra_pmi_proxy\n")
    assert launch.launchers_running(str(tmp_path))
