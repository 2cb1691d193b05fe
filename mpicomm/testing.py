"""A pytest plugin for multi-rank test suites: fail fast, one summary, a communicator.

Turn it on with ``-p mpicomm.testing`` (or ``pytest_plugins = ["mpicomm.testing"]`` in a
top-level ``conftest.py``) and run the suite under MPI with pytest-mpi::

    mpiexec -n 4 python -m pytest --with-mpi -p mpicomm.testing --timeout=120 \\
        --timeout-method=thread -p no:cacheprovider

What it does when more than one rank runs:

* **Fail fast instead of hanging.** When a test fails (setup, call or teardown) or a
  module fails to import on some rank, that rank prints the failure with its rank number
  to stderr and calls ``MPI_Abort``. Without this, the other ranks wait forever in the
  test's next collective. ``--mpi-no-abort`` turns it off (for suites whose failures are
  always collective).
* **One summary.** Only rank 0 reports to the terminal; the other ranks' reporters write
  to ``/dev/null`` (their failures still reach stderr through the abort path).
  ``--mpi-all-output`` keeps every rank's report.
* **Fixtures.** ``comm``: a session-wide :class:`mpicomm.Communicator` over a duplicate of
  ``MPI.COMM_WORLD`` in checked mode. ``mpi_rank`` / ``mpi_size``: plain ints.

pytest-timeout must use ``--timeout-method=thread`` under MPI (signals and MPI mix badly).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest


def _world() -> Any:
    from mpi4py import MPI

    return MPI.COMM_WORLD


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mpicomm", "mpicomm multi-rank testing")
    group.addoption("--mpi-all-output", action="store_true", default=False,
                    help="let every rank write its own report (default: rank 0 only)")
    group.addoption("--mpi-no-abort", action="store_true", default=False,
                    help="do not call MPI_Abort when a test fails on one rank")


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    world = _world()
    if world.Get_size() == 1:
        return
    if not config.getoption("mpi_no_abort"):
        config.pluginmanager.register(_FailFast(config), "mpicomm-failfast")
    if world.Get_rank() != 0 and not config.getoption("mpi_all_output"):
        _silence_reporter(config)


def _silence_reporter(config: pytest.Config) -> None:
    from _pytest.terminal import TerminalReporter

    old = config.pluginmanager.get_plugin("terminalreporter")
    if old is None:
        return
    config.pluginmanager.unregister(old)
    sink = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the pytest session
    config.pluginmanager.register(TerminalReporter(config, sink), "terminalreporter")


class _FailFast:
    """Abort the MPI job as soon as anything fails on this rank."""

    def __init__(self, config: pytest.Config):
        self.config = config

    def _abort(self, what: str, text: str) -> None:
        world = _world()
        sys.stderr.write(
            f"\n[mpicomm.testing] rank {world.Get_rank()}/{world.Get_size()}: {what} failed;"
            f" aborting all ranks.\n{text}\n"
        )
        from .abort import abort_after_flush

        abort_after_flush(1)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item,
                                  call: pytest.CallInfo[Any]) -> Iterator[None]:
        outcome = yield
        report = outcome.get_result()
        if report.failed:
            self._abort(f"{report.nodeid} ({report.when})", report.longreprtext)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._abort(f"collecting {report.nodeid}", report.longreprtext)


@pytest.fixture(scope="session")
def comm() -> Iterator[Any]:
    """A checked-mode :class:`mpicomm.Communicator` over a duplicate of COMM_WORLD."""
    import mpicomm

    c = mpicomm.Communicator(_world().Dup(), check=True)
    yield c
    c.free()


@pytest.fixture(scope="session")
def mpi_rank() -> int:
    return _world().Get_rank()


@pytest.fixture(scope="session")
def mpi_size() -> int:
    return _world().Get_size()
