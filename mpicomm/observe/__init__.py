"""Observability, above the core: it registers itself, the core never imports it.

* :mod:`.timeline`  a thread-safe recorder of Chrome-trace events (``Timeline``);
* :mod:`.trace`     the whole-run recording of every traced call (``MPICOMM_TIMELINE``,
                    ``trace.recording(path, comm)``): the timeline becomes the recorder of
                    :mod:`mpicomm.hooks`;
* :mod:`.stall`     the stall inspector (``MPICOMM_STALL_S``): the watch of
                    :mod:`mpicomm.hooks`, reporting who has not arrived in a collective;
* :mod:`.metrics`   per-step records as JSON lines (``MPICOMM_METRICS``);
* :mod:`.plot`      PNG plots of a metrics file or a trace (``python -m mpicomm plot``).

Importing this package (``import mpicomm`` does) adds one hook to :func:`mpicomm.init`
(:func:`mpicomm.comm.on_init`) that starts the timeline recording and the stall
inspector from the environment.
"""

from __future__ import annotations

from ..comm import Communicator, on_init

__all__ = ["start_from_env"]


def start_from_env(comm: Communicator, *, world: bool, check: bool) -> None:
    """The :func:`mpicomm.init` hook: ``MPICOMM_TIMELINE`` starts recording the whole run
    (no communication); on the world communicator, ``MPICOMM_STALL_S`` or checked mode
    (``check``) starts the stall inspector (collective over the world, so only there)."""
    from . import stall, trace

    trace.start_from_env()
    if world:
        stall.start_from_env(check)


on_init(start_from_env)
