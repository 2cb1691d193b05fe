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

Chunks (``chunk_bytes``; ``KVStore``'s default is 2 MiB across hosts and none on one
host, ``MPICOMM_PS_CHUNK_BYTES``; 0: off): a piece of
more than ``chunk_bytes`` bytes is cut further into ``k = ceil(bytes / chunk_bytes)``
near-equal contiguous pieces on the same server, each with its own state on the server
(version, sequence numbers, sum, reply). A server then updates and answers chunk ``i``
of a push while chunk ``i + 1`` is still arriving, so a pipelined push + pull
(:meth:`mpicomm.ps.KVStore.push_pull`) of ``n`` bytes through one server takes about
``alpha + n (beta + gamma) + k o + (n/k) beta`` instead of
``2 alpha + 2 n beta + n gamma + o`` (``gamma``: the update pass per byte, ``o``: a
chunk's fixed cost on the server, its header and reply, some tens of microseconds of
Python). Tuning: chunks much larger than ``o / beta`` (about 256 KiB on shared memory at
5-10 GB/s) keep the fixed costs small; with ``k = 1`` nothing overlaps. Over TCP on a
shaped 1 Gbit/s link small chunks cost far more than their fixed part: with 512 KiB
chunks a 4-16 MB push + pull took 2.3x a ping-pong of the same bytes (many messages in
flight both ways on one link), with 2 MiB chunks 0.7-1.0x, hence the 2 MiB default.
Stores with a push or pull compressor do not chunk (a compressor sees whole pieces).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import env_int
from ..p2p import block_bounds

__all__ = ["Piece", "ShardPlan", "DEFAULT_SPLIT_BYTES", "DEFAULT_CHUNK_BYTES"]

#: Keys at least this large are split over all servers.
DEFAULT_SPLIT_BYTES = 1 << 16
#: Pieces larger than this are cut into chunks (module docstring; 0: never).
DEFAULT_CHUNK_BYTES = 1 << 21


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened key ``key_id``, held by ``server``.

    ``index`` numbers the pieces of one key (0..pieces-1) in the order of ``start``;
    ``chunk`` is the piece's position among the key's pieces on its server.
    """

    key_id: int
    index: int
    server: int
    start: int
    stop: int
    chunk: int = 0

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass
class ShardPlan:
    """The placement of every key initialised so far (see the module docstring)."""

    servers: int
    split_bytes: int = field(default_factory=lambda: env_int("MPICOMM_PS_SPLIT_BYTES",
                                                             DEFAULT_SPLIT_BYTES, 1))
    #: 0: no chunks. :class:`~mpicomm.ps.KVStore` passes the size it resolved (its
    #: argument, ``MPICOMM_PS_CHUNK_BYTES``, else :data:`DEFAULT_CHUNK_BYTES` across hosts).
    chunk_bytes: int = 0
    load: list[int] = field(default_factory=list)
    pieces: dict[int, tuple[Piece, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.servers < 1:
            raise ValueError(f"servers must be >= 1, got {self.servers}")
        if self.split_bytes < 1:
            raise ValueError(f"split_bytes must be >= 1, got {self.split_bytes}")
        if self.chunk_bytes < 0:
            raise ValueError(f"chunk_bytes must be >= 0, got {self.chunk_bytes}")
        if not self.load:
            self.load = [0] * self.servers

    def place(self, key_id: int, numel: int, itemsize: int) -> tuple[Piece, ...]:
        """Place key ``key_id`` of ``numel`` elements and return its pieces."""
        if key_id in self.pieces:
            raise ValueError(f"key id {key_id} is already placed")
        nbytes = numel * itemsize
        if self.servers > 1 and nbytes >= self.split_bytes and numel >= self.servers:
            bounds = block_bounds(numel, self.servers)
            parts = [(i, bounds[i], bounds[i + 1]) for i in range(self.servers)]
        else:
            server = min(range(self.servers), key=lambda s: (self.load[s], s))
            parts = [(server, 0, numel)]
        pieces = tuple(Piece(key_id, i, server, start, stop, chunk) for i, (server, start,
                       stop, chunk) in enumerate(c for part in parts
                                                 for c in self.chunks(*part, itemsize)))
        for p in pieces:
            self.load[p.server] += p.numel * itemsize
        self.pieces[key_id] = pieces
        return pieces

    def chunks(self, server: int, start: int, stop: int, itemsize: int
               ) -> list[tuple[int, int, int, int]]:
        """``(server, start, stop, chunk)`` of the chunks of elements ``[start, stop)``:
        ``ceil(bytes / chunk_bytes)`` near-equal ones (one if ``chunk_bytes`` is 0)."""
        nbytes = (stop - start) * itemsize
        count = 1 if self.chunk_bytes == 0 else max(1, -(-nbytes // self.chunk_bytes))
        count = min(count, max(stop - start, 1))
        bounds = block_bounds(stop - start, count)
        return [(server, start + bounds[i], start + bounds[i + 1], i) for i in range(count)]
