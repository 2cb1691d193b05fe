"""Run a child ``mpiexec`` job from a (serial) test and capture what happened."""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

from mpicomm.emulate.mpienv import find_mpiexec

ROOT = Path(__file__).resolve().parent.parent
# Variables a parent MPI launcher sets; a child job must not inherit them.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "OMPI_COMM_", "OMPI_MCA_orte_", "MPI_LOCAL",
                      "PRTE_MCA_ess", "MPIR_CVAR_CH3_INTERFACE")


def mpiexec() -> str:
    """The launcher ``python -m mpicomm run`` would use (``MPICOMM_MPIEXEC``, else the one
    beside this Python, else the one on PATH)."""
    return find_mpiexec()


def python_path(existing: str | None) -> str:
    """The project root put in front of an inherited ``PYTHONPATH`` (kept, not replaced:
    packages such as pytest-mpi may come from it, as on the GPU machine)."""
    rest = [p for p in (existing or "").split(os.pathsep) if p and p != str(ROOT)]
    return os.pathsep.join([str(ROOT), *rest])


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
               PYTHONPATH=python_path(os.environ.get("PYTHONPATH")), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


@dataclass
class Result:
    returncode: int
    output: str
    seconds: float


def run_job(ranks: int, args: list[str], timeout: float = 120, **env: str) -> Result:
    """``mpiexec -n ranks <args>`` with a clean environment; stdout+stderr together."""
    start = time.monotonic()
    proc = subprocess.run([mpiexec(), "-n", str(ranks), *args], cwd=ROOT, env=clean_env(**env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    return Result(proc.returncode, proc.stdout, time.monotonic() - start)


# MPICH's launcher (hydra) writes the machine's hwloc topology to a file of this name in
# /tmp for its proxies and removes it only when the job ends cleanly: every job ended by
# MPI_Abort (the failure tests) leaves one behind.
HYDRA_TOPOLOGY_FILES = "hydra_hwloc_xmlfile_*"
LAUNCHERS = frozenset({"mpiexec", "mpiexec.hydra", "mpirun", "hydra_pmi_proxy"})


def launchers_running(proc: str = "/proc") -> bool:
    """Whether any MPI launcher or hydra proxy process is alive on this machine."""
    for entry in os.listdir(proc):
        if entry.isdigit():
            try:
                with open(os.path.join(proc, entry, "comm")) as f:
                    if f.read().strip() in LAUNCHERS:
                        return True
            except OSError:  # the process ended meanwhile
                continue
    return False


def remove_hydra_topology_files(folder: str = "/tmp",
                                running: Callable[[], bool] = launchers_running) -> list[str]:
    """Delete this user's hydra topology files in ``folder`` when no launcher is alive
    (only a live job reads its file, at start-up); the paths removed. Files written after
    the check (a job started meanwhile) are newer than it and kept."""
    checked = time.time()
    if running():
        return []
    removed = []
    for path in glob.glob(os.path.join(folder, HYDRA_TOPOLOGY_FILES)):
        try:
            info = os.stat(path)
            if info.st_uid == os.getuid() and info.st_mtime < checked:
                os.unlink(path)
                removed.append(path)
        except OSError:  # removed by someone else meanwhile
            continue
    return removed


def load_script(relative: str) -> ModuleType:
    """Import a script of the repository (``examples/train.py``, ``benchmarks/x.py``,
    ``docs/build_api.py``) as a module named after its file, once per process.

    It is registered in ``sys.modules`` before it runs (dataclasses look their module up
    there), and its folder is on ``sys.path`` while it runs (for its sibling modules).
    """
    path = ROOT / relative
    name = path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(str(path.parent))
    return module
