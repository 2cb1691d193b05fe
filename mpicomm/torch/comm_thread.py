"""What a background communication thread needs around it: its device, CUDA ordering,
MPI's thread level, and a guard that ends the job when it cannot stop.

``GradientSync`` averages gradient buckets on one such thread while backward runs on the
caller's. The helpers here keep that safe:

* ``thread_multiple`` tells whether MPI allows calls from several threads at once
  (``MPI_THREAD_MULTIPLE``); without it no thread is started.
* ``bind_thread_device`` makes the model's first CUDA device the thread's current one
  (a new thread starts on device 0 whatever the model uses).
* ``record_events`` marks, on the autograd side, the point after which a bucket's
  gradients are written; the thread waits for those events before reading them.
* ``abort_at_exit_if_alive`` calls ``MPI_Abort`` at interpreter exit when the thread is
  stuck inside a collective that the other ranks left, since ``MPI_Finalize`` would hang.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["EXIT_JOIN_S", "thread_multiple", "bind_thread_device", "record_events",
           "abort_at_exit_if_alive"]

#: Seconds ``GradientSync.__exit__`` waits for its thread after an exception.
EXIT_JOIN_S = 2.0


def thread_multiple() -> bool:
    """Whether MPI may be called from several threads at once."""
    from mpi4py import MPI

    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def bind_thread_device(buckets: Sequence[Any]) -> torch.device | None:
    """Make the first CUDA device of the buckets (objects with ``cuda_devices``) the
    calling thread's current device.

    Without this the communication thread would open a context on GPU 0 on every rank,
    and its device-less calls (``torch.cuda.current_stream()``, allocations) would target
    GPU 0 rather than the model's ``cuda:N``. Returns the device, ``None`` for a host
    model.
    """
    devices = [d for b in buckets for d in b.cuda_devices]
    if not devices:
        return None
    device = devices[0]
    torch.cuda.set_device(device)
    return device


def record_events(devices: Sequence[torch.device]) -> list[Any]:
    """One CUDA event recorded on the current stream of each device (none on the host)."""
    events = []
    for dev in devices:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        events.append(ev)
    return events


def abort_at_exit_if_alive(thread: threading.Thread) -> None:
    """At interpreter exit (before mpi4py's ``MPI_Finalize``), abort the job if ``thread``
    is still inside MPI: finalizing under it would hang or crash."""

    def guard() -> None:
        thread.join(timeout=1.0)
        if not thread.is_alive():
            return
        from ..abort import abort_job

        abort_job("GradientSync's communication thread is still inside an MPI collective "
                  "that the other ranks left (its with block ended with an exception); "
                  "calling MPI_Abort so that MPI_Finalize cannot hang")

    atexit.register(guard)
