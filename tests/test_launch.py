"""tests/launch.py: child jobs see the project first and keep the inherited PYTHONPATH."""

from __future__ import annotations

import os
import sys

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
