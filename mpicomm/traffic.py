"""Byte counters of the library's own point-to-point traffic (``Communicator.traffic``).

Cost: three integer additions per message posted. Counting happens in
:mod:`mpicomm.p2p` at every send and receive the algorithms post.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Traffic"]


@dataclass
class Traffic:
    """Bytes this rank moved through the library's own point-to-point collectives.

    Counted at every send/receive the algorithms post (not for ``algorithm="mpi"``,
    whose internals MPI does not expose, nor for checked-mode and control messages).
    :meth:`measure` counts what one block of code moved (the one way to do it)::

        with comm.traffic.measure(into=my_totals) as moved:
            mpicomm.allreduce(x, comm=comm)
        print(moved.sent_bytes)
    """

    sent_bytes: int = 0
    recv_bytes: int = 0
    messages: int = 0

    def snapshot(self) -> Traffic:
        return Traffic(self.sent_bytes, self.recv_bytes, self.messages)

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(self.sent_bytes - other.sent_bytes, self.recv_bytes - other.recv_bytes,
                       self.messages - other.messages)

    def add(self, other: Traffic) -> None:
        """Add ``other``'s counts to these (in place)."""
        self.sent_bytes += other.sent_bytes
        self.recv_bytes += other.recv_bytes
        self.messages += other.messages

    @contextlib.contextmanager
    def measure(self, into: Traffic | None = None) -> Iterator[Traffic]:
        """Count what this counter gains inside the ``with`` block.

        Yields a :class:`Traffic` that holds the difference once the block ends (also when
        it raises: those bytes did move); ``into``, if given, is incremented by the same
        amounts (an object's running total). Only this counter's own communicator is
        seen, so measure on the communicator the work runs on.
        """
        moved = Traffic()
        before = self.snapshot()
        try:
            yield moved
        finally:
            delta = self - before
            moved.add(delta)
            if into is not None:
                into.add(delta)
