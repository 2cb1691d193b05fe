"""The MPI installation and the machine a job runs on (standard library and mpi4py only).

* :func:`library_version` / :func:`mpi_flavor`: which MPI mpi4py uses (asked without
  initializing MPI);
* :func:`find_mpiexec`: ``$MPICOMM_MPIEXEC``, else the ``mpiexec`` beside this Python (an
  MPI wheel in a virtual environment puts it there), else the first on ``PATH``;
* :func:`own_python`: a command whose program is a bare ``python``/``python3`` runs this
  interpreter instead (the one that has mpicomm, not the first on ``PATH``);
* :func:`launcher_env`: for Open MPI, unless already set: ``OMPI_ALLOW_RUN_AS_ROOT=1``
  and ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`` when running as root (containers),
  ``PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe`` when the rank count exceeds
  the usable cores, and ``OMPI_MCA_btl=^ofi`` (skips the slow OFI probe on machines
  without such a network). MPICH needs none of these;
* :func:`machine` / :func:`network`: the conditions a benchmark records (the emulated
  cluster's ``MPICOMM_EMU_*`` variables, or one host's shared memory).

Used by ``python -m mpicomm run``, the emulated cluster's launcher and the benchmarks.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

from .vnet import ENV_HOST_NICS, parse_nics

__all__ = ["library_version", "mpi_flavor", "find_mpiexec", "own_python", "usable_cores",
           "cpu_model", "launcher_env", "machine", "network", "SHAPING_ACK_FIRST",
           "shaping_name"]

#: ``MPICOMM_EMU_SHAPING`` of an emulated cluster run with ``--ack-priority``.
SHAPING_ACK_FIRST = "htb-ack-first"


def shaping_name(ack_priority: bool) -> str:
    """``MPICOMM_EMU_SHAPING`` of an emulated cluster: ``htb-ack-first`` with
    ``--ack-priority``, else ``tbf``."""
    return SHAPING_ACK_FIRST if ack_priority else "tbf"


def library_version() -> str:
    """``MPI_Get_library_version()`` of the MPI that mpi4py uses, without initializing MPI
    and without the terminating NUL some libraries count in its length (Open MPI 4.1)."""
    import mpi4py

    if not _mpi_imported():
        mpi4py.rc.initialize = False  # the query is legal before MPI_Init
    from mpi4py import MPI

    return MPI.Get_library_version().rstrip("\x00")


def _mpi_imported() -> bool:
    return "mpi4py.MPI" in sys.modules


def mpi_flavor(version: str) -> str:
    """``"openmpi"``, ``"mpich"`` (MPICH and its derivatives) or ``"other"``."""
    if "Open MPI" in version:
        return "openmpi"
    if "MPICH" in version or "Intel(R) MPI" in version or "MVAPICH" in version:
        return "mpich"
    return "other"


def find_mpiexec(python: str | None = None) -> str:
    """``$MPICOMM_MPIEXEC``, else the ``mpiexec`` beside ``python`` (default: this one),
    else the one on ``PATH``; ``FileNotFoundError`` when there is none."""
    explicit = os.environ.get("MPICOMM_MPIEXEC")
    if explicit:
        return explicit
    beside = Path(python or sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError("no mpiexec beside this Python nor on PATH; install an MPI "
                                "(pip install mpich) or set MPICOMM_MPIEXEC")
    return found


def own_python(command: list[str], python: str | None = None) -> list[str]:
    """``command`` with its program replaced by ``python`` (default: this interpreter)
    when it is a bare ``python``, ``python3`` or ``python3.X`` of this version: what a
    user typing ``... run -n 4 python train.py`` means is the Python the launcher runs
    under (a virtual environment's), not the first one on ``PATH``. A path
    (``/usr/bin/python3``, ``.venv/bin/python``) or another version is kept."""
    if not command:
        return list(command)
    ours = {"python", f"python{sys.version_info[0]}",
            f"python{sys.version_info[0]}.{sys.version_info[1]}"}
    if command[0] in ours:
        return [python or sys.executable, *command[1:]]
    return list(command)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def launcher_env(flavor: str, ranks: int, base: dict[str, str] | None = None
                 ) -> dict[str, str]:
    """The environment for ``mpiexec``: ``base`` (default ``os.environ``) plus, for Open
    MPI, the settings of the module docstring; variables already set are kept (``ranks``
    decides oversubscription)."""
    env = dict(os.environ if base is None else base)
    if flavor != "openmpi":
        return env
    wanted = {"OMPI_MCA_btl": "^ofi"}
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        wanted.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if ranks > usable_cores():
        wanted["PRTE_MCA_rmaps_default_mapping_policy"] = ":oversubscribe"
    for key, value in wanted.items():
        env.setdefault(key, value)
    return env


def machine() -> dict[str, Any]:
    """The machine a measurement ran on (host, cores, CPU model, Python, MPI library,
    torch's version and the CPU kernels it dispatches to when torch is loaded, ranks,
    load average) and its :func:`network`, as recorded in every benchmark's JSON.

    The CPU model and torch's kernel level matter for training results: the same code,
    data and seed repeat bit for bit on one machine, but another CPU (AVX2 against
    AVX-512 kernels) rounds differently, and a long run then ends elsewhere."""
    from mpi4py import MPI

    out = {"host": platform.node(), "cpus": os.cpu_count(), "cpu": cpu_model(),
           "python": platform.python_version(),
           "mpi": library_version().splitlines()[0].strip(),
           "ranks": MPI.COMM_WORLD.Get_size(), "loadavg": list(os.getloadavg()),
           "network": network()}
    torch = sys.modules.get("torch")   # recorded where the benchmark uses it, not imported
    if torch is not None:
        out["torch"] = {"version": str(torch.__version__),
                        "cpu_capability": str(torch.backends.cpu.get_cpu_capability())}
    return out


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def network() -> dict[str, Any]:
    """The network the ranks ran on: the emulated cluster's conditions (from the
    ``MPICOMM_EMU_*`` variables ``launchers/emulated-cluster`` sets) or one host's
    shared memory."""
    hosts = os.environ.get("MPICOMM_EMU_HOSTS")
    if not hosts:
        return {"kind": "shared memory", "hosts": 1}
    return {"kind": "emulated cluster", "hosts": int(hosts),
            "ranks_per_host": int(os.environ.get("MPICOMM_EMU_RANKS_PER_HOST", "1")),
            "nics_per_host": parse_nics(os.environ.get(ENV_HOST_NICS)),
            "rate": os.environ.get("MPICOMM_EMU_RATE", "unshaped"),
            "delay_s": float(os.environ.get("MPICOMM_EMU_DELAY", "0") or 0),
            "schedule": os.environ.get("MPICOMM_EMU_SCHEDULE") or None,
            "rate_by": ("kernel (tc htb on both ends of each host link, small packets "
                        "first)" if os.environ.get("MPICOMM_EMU_SHAPING") == SHAPING_ACK_FIRST
                        else "kernel (tc tbf on both ends of each host link)"),
            "burst_bytes": int(os.environ.get("MPICOMM_EMU_BURST", "0") or 0) or None,
            "queue_s": float(os.environ.get("MPICOMM_EMU_QUEUE", "0") or 0) or None,
            "delay_by": "injected in mpicomm's point-to-point layer (Ctx/Wire); "
                        "MPI's own collectives bypass it"}
