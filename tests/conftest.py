"""Test-suite set-up: the mpicomm pytest plugin (fail-fast abort, rank-0 output, fixtures).

Serial tests run with a plain ``pytest``; tests marked ``@pytest.mark.mpi`` run only with
``--with-mpi`` under ``mpiexec`` (pytest-mpi), at every rank count the Makefile lists.
"""

import pytest

from .launch import remove_hydra_topology_files

pytest_plugins = ["mpicomm.testing"]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The serial run's controller removes the topology files that MPICH's launcher leaves
    in /tmp after each child job ended by MPI_Abort (nothing is removed while any
    launcher is alive, so a multi-rank run under mpiexec leaves them alone)."""
    if not hasattr(session.config, "workerinput"):  # not a pytest-xdist worker
        remove_hydra_topology_files()
