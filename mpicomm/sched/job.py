"""What the Crossover scheduler runs: a :class:`Job` is one training loop cut into phases.

A job is a data-parallel training run over all ranks of the scheduler's communicator,
cut into iterations of two phases:

* **compute** (forward, backward, and whatever local work the job does) runs while the
  job holds its rank's token, so no other job computes at the same time on that rank;
  it must not communicate with other ranks (it may only touch local state);
* **sync** (the gradient or parameter averaging of that iteration) runs on the job's own
  synchronization thread, on the job's own communicator, concurrently with the next
  job's compute phase.

The scheduler calls, on every rank and in the same order: :meth:`Job.setup` once
(collective over the job's communicator), then for ``step = 0 .. steps-1`` the pair
``compute(step)`` / ``sync(step)``, with ``sync(step)`` finished before ``compute(step+1)``
begins, then :meth:`Job.finish` (under the token, after the last sync; e.g. the last
optimizer step) and :meth:`Job.close`.

Two kinds ship: :class:`FunctionJob` (a pair of callables) here, and
:class:`mpicomm.torch.TorchJob` (a model + optimizer + data, synchronized by
:class:`~mpicomm.torch.GradientSync` with any strategy, or by
:class:`~mpicomm.torch.LocalSGD`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from ..comm import Communicator
from ..validate import check_int

__all__ = ["Job", "FunctionJob"]


def check_steps(steps: Any) -> int:
    """``steps`` as an int >= 0, or ``TypeError``/``ValueError`` (:func:`check_int`)."""
    return check_int("steps", steps, 0)


class Job(ABC):
    """One job of a :class:`~mpicomm.sched.CrossoverScheduler` (see the module docstring).

    Parameters
    ----------
    name:
        Unique among the scheduler's jobs; names the job's timeline row and its errors.
    steps:
        Iterations to run (the same on every rank).
    """

    def __init__(self, name: str, steps: int):
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a job needs a non-empty name, got {name!r}")
        self.name = name
        self.steps = check_steps(steps)
        #: The job's own communicator (set by :meth:`setup`; owned by the scheduler).
        self.comm: Communicator | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, steps={self.steps})"

    def describe(self) -> tuple[Any, ...]:
        """What must agree across ranks for the job's collectives to match."""
        return (self.name, type(self).__name__, self.steps)

    def setup(self, comm: Communicator) -> None:
        """Attach the job to its communicator (collective over ``comm``)."""
        self.comm = comm

    @abstractmethod
    def compute(self, step: int) -> None:
        """Iteration ``step``'s local work; runs under the token, never communicates."""

    @abstractmethod
    def sync(self, step: int) -> None:
        """Iteration ``step``'s synchronization on :attr:`comm` (its own thread)."""

    def finish(self) -> None:
        """Local work after the last sync (under the token); default: nothing."""
        return None

    def close(self) -> None:
        """Release what :meth:`setup` created (collective when it frees communicators)."""
        return None


class FunctionJob(Job):
    """A job given as a pair of callables.

    ``compute(step)`` does iteration ``step``'s local work; ``sync(step, comm)``
    synchronizes it over ``comm``, the job's own :class:`~mpicomm.Communicator` (use it
    for every collective of the job, e.g. ``mpicomm.allreduce(g, op="avg", comm=comm)``);
    the optional ``finish()`` runs under the token after the last sync. Keep the job's
    state in the callables' closure; synchronous-SGD semantics hold because the scheduler
    never starts ``compute(step + 1)`` before ``sync(step)`` has returned::

        w = np.zeros(d); g = np.zeros(d)
        def compute(step):
            if step: w -= lr * g                 # apply the previous average
            g[:] = local_gradient(w, batch(step))
        def sync(step, comm):
            mpicomm.allreduce(g, op="avg", comm=comm, out=g)
        job = FunctionJob("ridge", compute, sync, steps=100, finish=lambda: w.__isub__(lr * g))
    """

    def __init__(self, name: str, compute: Callable[[int], Any],
                 sync: Callable[[int, Communicator], Any], steps: int,
                 finish: Callable[[], Any] | None = None):
        super().__init__(name, steps)
        for label, fn in (("compute", compute), ("sync", sync)):
            if not callable(fn):
                raise TypeError(f"job {name!r}: {label} must be callable, got "
                                f"{type(fn).__name__}")
        if finish is not None and not callable(finish):
            raise TypeError(f"job {name!r}: finish must be callable or None, got "
                            f"{type(finish).__name__}")
        self._compute = compute
        self._sync = sync
        self._finish = finish

    def compute(self, step: int) -> None:
        self._compute(step)

    def sync(self, step: int) -> None:
        assert self.comm is not None, "setup() was not called"
        self._sync(step, self.comm)

    def finish(self) -> None:
        if self._finish is not None:
            self._finish()
