"""Test-suite set-up: the mpicomm pytest plugin (fail-fast abort, rank-0 output, fixtures).

Serial tests run with a plain ``pytest``; tests marked ``@pytest.mark.mpi`` run only with
``--with-mpi`` under ``mpiexec`` (pytest-mpi), at every rank count the Makefile lists.
"""

pytest_plugins = ["mpicomm.testing"]
