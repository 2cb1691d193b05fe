"""Closed forms of what one rank sends in the message patterns the collectives use,
written from the algorithms' definitions (not from the implementation), for the traffic
tests to compare the communicator's counters with.
"""

from __future__ import annotations


def binomial_children(rel: int, p: int) -> list[int]:
    """Relative ranks a binomial-tree node ``rel`` (0 = root) sends to: ``rel + 2^j`` for
    every ``2^j`` below ``rel``'s lowest set bit (below ``p`` at the root) that is ``< p``."""
    limit = rel & -rel if rel else 1 << max(p - 1, 1).bit_length()
    return [rel + (1 << j) for j in range(limit.bit_length())
            if (1 << j) < limit and rel + (1 << j) < p]


def binomial_fanout(rank: int, root: int, p: int) -> int:
    """How many messages ``rank`` sends in a binomial broadcast rooted at ``root``."""
    return len(binomial_children((rank - root) % p, p))


def ring_allreduce_bytes(rank: int, p: int, n: int, itemsize: int) -> int:
    """Bytes ``rank`` sends in a ring allreduce of n elements cut into P near-equal
    blocks: every block but r+1 in the reduce-scatter pass, every block but r+2 in the
    allgather pass."""
    if p == 1 or n == 0:
        return 0
    size = [((j + 1) * n) // p - (j * n) // p for j in range(p)]
    return (2 * n - size[(rank + 1) % p] - size[(rank + 2) % p]) * itemsize


def doubling_messages(rank: int, p: int) -> int:
    """Messages ``rank`` sends in recursive doubling over P ranks with the fold of the
    first ``2·rem`` ranks (``rem = P - 2^floor(log2 P)``): an even folded rank sends once
    (to its partner), its odd partner ``log2 p2`` rounds plus the result back, every other
    rank ``log2 p2`` rounds. gTop-k's butterfly has the same pattern."""
    p2 = 1 << (p.bit_length() - 1)
    rem, rounds = p - p2, p2.bit_length() - 1
    if rank < 2 * rem:
        return 1 if rank % 2 == 0 else rounds + 1
    return rounds


def doubling_allreduce_bytes(rank: int, p: int, n: int, itemsize: int) -> int:
    """Bytes ``rank`` sends in a recursive-doubling allreduce of n elements."""
    return doubling_messages(rank, p) * n * itemsize
