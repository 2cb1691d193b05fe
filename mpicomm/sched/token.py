"""The per-rank token: the right to compute, passed round a fixed cycle of jobs.

Every rank holds one :class:`Token`. Only its holder may run a compute phase; the holder
hands it to the next job of the cycle when its compute phase ends, and a job that has
finished all its iterations leaves the cycle. The cycle is the scheduler's job order,
the same on every rank, so the ranks of one job reach that job's collectives in the same
order relative to the other jobs. The token is local: passing it costs no message.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Token"]


class Token:
    """Mutual exclusion of compute phases on one rank, in a fixed cyclic order.

    ``turn`` is the job whose compute phase comes next; :meth:`acquire` takes the token
    for it (only it), :meth:`pass_on` gives the turn to the next job of the cycle and
    :meth:`leave` removes the holder from the cycle (the turn moves on). Not
    thread-safe: one thread (the scheduler's) drives it.
    """

    def __init__(self, order: Sequence[str]):
        names = list(order)
        if len(set(names)) != len(names):
            raise ValueError(f"job names must be unique, got {names}")
        self.order = names
        self.holder: str | None = None
        self._pos = 0
        #: Handovers so far (each completed compute phase counts one).
        self.passes = 0

    def __repr__(self) -> str:
        return f"Token(order={self.order}, holder={self.holder!r})"

    @property
    def turn(self) -> str | None:
        """The job that computes next (``None`` when every job has left)."""
        return self.order[self._pos] if self.order else None

    def acquire(self, name: str) -> None:
        """Take the token for ``name``; ``RuntimeError`` when it is not ``name``'s turn."""
        if self.holder is not None:
            raise RuntimeError(f"job {name!r} wants the token while {self.holder!r} holds it")
        if name != self.turn:
            raise RuntimeError(f"job {name!r} wants the token but it is {self.turn!r}'s turn")
        self.holder = name

    def pass_on(self) -> None:
        """The holder's compute phase ended: the next job of the cycle has the turn."""
        self._require_holder()
        self.holder = None
        self._pos = (self._pos + 1) % len(self.order)
        self.passes += 1

    def leave(self) -> None:
        """The holder has finished for good: drop it from the cycle, the next one's turn."""
        self._require_holder()
        self.holder = None
        del self.order[self._pos]
        if self._pos >= len(self.order):
            self._pos = 0

    def _require_holder(self) -> None:
        if self.holder is None:
            raise RuntimeError("the token is not held")
