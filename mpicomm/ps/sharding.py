"""Where each key lives: keys sharded over the servers, balanced by bytes.

Rule (ours; ps-lite splits keys by a fixed key range, BytePS partitions tensors into
fixed-size chunks): keys are placed in the order the workers ``init`` them.

* A key of at least ``split_bytes`` bytes (default 64 KiB, ``MPICOMM_PS_SPLIT_BYTES``) is
  cut into ``S`` near-equal contiguous pieces, piece ``i`` on server ``i``, so one large
  layer spreads its traffic and its optimizer work over every server.
* A smaller key goes whole to the server holding the fewest bytes so far (ties: the lowest
  server index).

After ``K`` keys the load of two servers differs by at most the largest unsplit key plus
``S`` elements. Every worker computes the same plan from the same ``init`` sequence, so
no plan is ever sent; a server learns its pieces from the ``init`` messages.

Tuning: lower ``split_bytes`` for more even load with many medium-sized keys (each split
key costs ``S`` messages per push and per pull instead of one); raise it when latency
(``alpha``) dominates, i.e. with many small messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import env_int
from ..p2p import block_bounds

__all__ = ["Piece", "ShardPlan", "DEFAULT_SPLIT_BYTES"]

#: Keys at least this large are split over all servers.
DEFAULT_SPLIT_BYTES = 1 << 16


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened key ``key_id``, held by ``server``.

    ``index`` numbers the pieces of one key (0..pieces-1).
    """

    key_id: int
    index: int
    server: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass
class ShardPlan:
    """The placement of every key initialised so far (see the module docstring)."""

    servers: int
    split_bytes: int = field(default_factory=lambda: env_int("MPICOMM_PS_SPLIT_BYTES",
                                                             DEFAULT_SPLIT_BYTES, 1))
    load: list[int] = field(default_factory=list)
    pieces: dict[int, tuple[Piece, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.servers < 1:
            raise ValueError(f"servers must be >= 1, got {self.servers}")
        if self.split_bytes < 1:
            raise ValueError(f"split_bytes must be >= 1, got {self.split_bytes}")
        if not self.load:
            self.load = [0] * self.servers

    def place(self, key_id: int, numel: int, itemsize: int) -> tuple[Piece, ...]:
        """Place key ``key_id`` of ``numel`` elements and return its pieces."""
        if key_id in self.pieces:
            raise ValueError(f"key id {key_id} is already placed")
        nbytes = numel * itemsize
        if self.servers > 1 and nbytes >= self.split_bytes and numel >= self.servers:
            bounds = block_bounds(numel, self.servers)
            pieces = tuple(Piece(key_id, i, i, bounds[i], bounds[i + 1])
                           for i in range(self.servers))
        else:
            server = min(range(self.servers), key=lambda s: (self.load[s], s))
            pieces = (Piece(key_id, 0, server, 0, numel),)
        for p in pieces:
            self.load[p.server] += p.numel * itemsize
        self.pieces[key_id] = pieces
        return pieces
