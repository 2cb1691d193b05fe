r"""Agreeing on a step's measurements across ranks, one step late and without a stop.

:class:`StepAgreement` carries :class:`~mpicomm.strategies.AutoStrategy`'s per-step
measurements (every bucket's time and squared norms, the step's sums) through one small
nonblocking allreduce per step, so that every rank decides on the same numbers.

When decisions take effect, for steps ``t = 0, 1, ...`` (the aggregations of step t,
then ``step_done`` after its ``optimizer.step()``):

* the measurements of step ``t`` are agreed *during step t+1*: the allreduce is posted
  (:meth:`StepAgreement.post`) at its first aggregation and completed
  (:meth:`StepAgreement.complete`) at the end of that aggregation, after the buckets'
  exchanges; ``step_done`` of step t+1 decides with them (refined alpha/beta and compute
  factors, re-chosen schemes, the CR controller's ratio, L-GreCo's settings, solved at
  the first aggregation of step t+2 when ``(t + 2) % lgreco_every == 0``) for *every*
  bucket of step t+2, and carries out a ``"save"``/``"restore"`` at once (after step
  t+1's update). So a decision uses the measurements of two steps back.
* why not sooner: agreeing before step t+1's first bucket (one step back) makes every
  rank wait there for the slowest one's backward pass, and then select its top-k at the
  same moment as the others; after the buckets instead (deciding at ``step_done`` of
  step t, no lag) makes every rank wait for the slowest one's unpacking, and start its
  next forward pass with all the others. Where ranks share cores both cost: on the
  adaptive bench (4 ranks on 2 cores, Allgather Top-k at a fixed ratio) 67.5 and about
  80 ms a step, against 61 ms without any agreement and 59 ms for the static strategy.
  Posted at the first aggregation, the allreduce moves along inside the buckets' own
  exchanges (MPI progresses every pending request in any call), so completing it after
  them waits for nothing new.
* what the extra step changes: a scheme on trial runs ``trial_steps`` steps, counting
  those still being agreed, before the next is tried; a CR exploration window runs each
  ratio ``window`` steps plus one whose gain arrives after the ratio moved on (it adds
  to that ratio's mean: :meth:`mpicomm.control.CRController.observe` ``ratio=``), and
  its restore discards that one too; the step after a probe runs at the probe's ratio
  again.
* decisions are the same on every rank: every rank calls ``step_done`` as often and
  aggregates the same buckets in the same order (the ``GradientSync`` contract, checked
  in ``comm.check`` mode), the allreduces are posted and completed at the same
  aggregations on every rank, and every input of a decision is agreed (this allreduce;
  L-GreCo: rank 0's solution broadcast).

Cost: one allreduce of ``4·buckets + 4 + candidates`` float64 per step, overlapped with
the step's exchanges.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import vwire
from ..comm import wait_all

__all__ = ["StepAgreement", "AGREE_POLL_S", "FIELDS"]

#: Longest sleep (seconds) between tests of the agreement allreduce still pending after
#: a step's exchanges (:func:`~mpicomm.comm.wait_all`; mostly it is complete by then): a
#: spinning rank takes a core from the others where ranks share cores.
AGREE_POLL_S = 5e-4
#: The per-bucket fields agreed, in this order (then the step's sums): the bucket's
#: seconds are averaged over ranks, its squared norms summed.
FIELDS = ("seconds", "kept_sq", "e_sq", "ref_sq")

#: A finished step: its buckets' records and its step sums (local or agreed).
Step = tuple[list[dict[str, Any]], Any]


class StepAgreement:
    """Finished steps waiting to be agreed, agreements under way, agreed steps.

    :meth:`finish` queues a step (at ``step_done``); :meth:`post` starts agreeing on the
    queued ones (at the next step's first aggregation); :meth:`complete` waits for them
    (at the end of that aggregation); :meth:`take` hands the agreed ones over (at the
    next ``step_done``). Agreed values: per bucket, the mean seconds over ranks and the
    summed squared norms (:data:`FIELDS`), then the summed step sums.
    """

    def __init__(self) -> None:
        self.done: list[tuple[list[dict[str, Any]], list[float]]] = []
        #: Agreements under way: (records, local sums, agreed sums, request, virtual
        #: clock record or None).
        self.posted: list[tuple[list[dict[str, Any]], Any, Any, Any, Any]] = []
        #: Agreed steps waiting for the next ``step_done``: (records, agreed sums).
        self.ready: list[Step] = []

    def finish(self, pending: list[dict[str, Any]], sums: Sequence[float]) -> None:
        """Queue a finished step: its buckets' records and its step sums."""
        self.done.append((pending, list(sums)))

    def post(self, comm: Any) -> None:
        """Start agreeing on the queued steps: one small nonblocking allreduce per step
        (with one rank, the local values are the agreed ones). In ``comm.check`` mode the
        ranks first check that they aggregated as many buckets (``RuntimeError``)."""
        for pending, sums in self.done:
            local = np.array([r[f] for f in FIELDS for r in pending] + sums,
                             dtype=np.float64)
            if comm.size == 1:
                self.ready.append((pending, local))
                continue
            if comm.check:  # checked mode: the ranks aggregated the same buckets
                counts = comm.allgather_object(len(pending))
                if len(set(counts)) != 1:
                    raise RuntimeError(f"auto strategy: ranks aggregated different numbers "
                                       f"of buckets in a step: {counts}")
            agreed = np.empty_like(local)
            timed = vwire.start_collective(comm.ctl) if vwire.active() else None
            self.posted.append((pending, local, agreed,
                                comm.ctl.Iallreduce(local, agreed, op=MPI.SUM), timed))
        self.done = []

    def complete(self, comm: Any) -> None:
        """Finish the agreements under way (waiting asleep, :data:`AGREE_POLL_S`). Under
        the virtual clock each costs a small allreduce from the latest rank's post
        (:func:`mpicomm.vwire.small_collective_cost`)."""
        posted, self.posted = self.posted, []
        nbytes = max((8 * local.shape[0] for _, local, *_ in posted), default=8)
        vwire.complete_collectives(
            [timed for *_, timed in posted if timed is not None],
            [request for *_, request, _ in posted], AGREE_POLL_S, wait_all,
            lambda a, b, p: vwire.small_collective_cost("allreduce", nbytes, p, a, b))
        for pending, _, agreed, *_ in posted:
            agreed[:len(pending)] /= comm.size
            self.ready.append((pending, agreed))

    def take(self) -> list[Step]:
        """The agreed steps, oldest first (and forget them)."""
        ready, self.ready = self.ready, []
        return ready
