"""Closed forms of every flat algorithm (one link class): see :mod:`mpicomm.collectives.cost`."""

from __future__ import annotations

import math
from collections.abc import Callable

from ...config import ring_segment_bytes
from .params import CostParams

__all__ = ["FORMULAS", "allreduce_ring", "allreduce_recursive_doubling",
           "allreduce_rabenseifner", "allgather_ring", "allgather_bruck", "allgather_direct",
           "allgather_recursive_doubling", "broadcast_binomial", "broadcast_scatter_allgather",
           "reduce_scatter_ring", "reduce_scatter_direct", "reduce_scatter_recursive_halving",
           "topk_allgather", "gtopk", "artopk_ring", "artopk_tree", "ps_push_pull",
           "ring_reduce_scatter_pass", "ring_allgather_pass", "folded_butterfly"]


def _lg(p: int) -> float:
    return math.log2(p) if p > 1 else 0.0


def _p2(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _fold(p: int) -> int:
    """1 when p is not a power of two (the fold steps run), else 0."""
    return int(p != _p2(p))


# ---------------------------------------------------------------------- dense
def _segments(block: float) -> tuple[float, float, float]:
    """``(first, middle, last)`` bytes of a ring block cut into segments of
    ``MPICOMM_RING_SEGMENT_BYTES``: the first segment, the full segments between it and
    the last, and the last one (0 when the block is a single segment)."""
    seg = float(ring_segment_bytes())
    if block <= seg:
        return block, 0.0, 0.0
    count = math.ceil(block / seg)
    last = block - (count - 1) * seg
    return seg, block - seg - last, last


def ring_reduce_scatter_pass(block: float, p: int, c: CostParams) -> float:
    r"""Critical path of the segmented ring reduce-scatter (``p-1`` steps of one block of
    ``B`` bytes, cut into segments: the first of ``s`` bytes, the last of ``r``, ``m`` in
    all; a segment is reduced and forwarded as soon as it arrives).

    The pass is a grid of events (step, segment): a segment's send follows its arrival
    and reduction (``α + c(β+γ)`` down the grid), and each rank's upload link and
    processor are serial (``cβ`` and ``cγ`` along it). The longest path is one of

    * latency-bound: ``(p-1)(α + s(β+γ)) + (B-s-r)·max(β,γ) + rγ`` or
      ``(p-1)α + (p-2)s(β+γ) + Bβ + rγ`` (every step waits for its first segment);
    * upload-bound: ``α + (p-1)Bβ + rγ`` (the link never idles: latency paid once);
    * reduction-bound: ``α + sβ + (p-1)Bγ`` (the processor never idles).

    With one segment (``m = 1``, ``s = B``, ``r = 0``) all are at most the textbook
    ``(p-1)(α + Bβ + Bγ)``. Sends leave when posted (eager), links are full duplex.
    """
    if p == 1:
        return 0.0
    s, mid, r = _segments(block)
    a, b, g = c.alpha, c.beta, c.gamma
    last = r if r else s
    tail = max(0.0, s * g - r * b) if r else 0.0  # last down at the last full segment
    return max((p - 1) * (a + s * (b + g)) + mid * max(b, g) + r * g,
               (p - 1) * a + (p - 2) * s * (b + g) + block * b + last * g + tail,
               a + (p - 1) * block * b + last * g + tail,
               a + s * b + (p - 1) * block * g)


def ring_allgather_pass(block: float, p: int, c: CostParams) -> float:
    r"""Critical path of the segmented ring allgather (``p-1`` steps of ``B`` bytes, the
    first segment ``s``; see :func:`ring_reduce_scatter_pass`):
    ``max((p-1)α + (p-2)sβ + Bβ, α + (p-1)Bβ)``: every step waits for its first segment,
    or the upload link never idles. One segment: ``(p-1)(α + Bβ)``."""
    if p == 1:
        return 0.0
    s = _segments(block)[0]
    return max((p - 1) * c.alpha + ((p - 2) * s + block) * c.beta,
               c.alpha + (p - 1) * block * c.beta)


def allreduce_ring(n: float, p: int, c: CostParams) -> float:
    """Segmented ring reduce-scatter then ring allgather of blocks ``B = n/p``
    (:func:`ring_reduce_scatter_pass` + :func:`ring_allgather_pass`). Blocks of one
    segment: the textbook ``2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ``; larger blocks pipeline
    and pay the latency about once per pass: ``2α + 2(p-1)/p·nβ`` when bandwidth-bound."""
    if p == 1:
        return 0.0
    return ring_reduce_scatter_pass(n / p, p, c) + ring_allgather_pass(n / p, p, c)


def folded_butterfly(p: int, a: float, b: float, g: float) -> float:
    r"""Critical path of a butterfly (recursive doubling) of ``lg p2`` exchanges costing
    ``a`` latency, ``b`` transfer and ``g`` local work (a reduction, a merge) each, with
    the fold of a non-power-of-two ``p`` (``rem = p - p2`` pairs: the even rank of a pair
    sends to the odd one, which works ``g`` on it, and gets the result back).

    Sends leave when posted, so the ``p2 - rem`` unfolded ranks start the first exchange
    at time 0 while the folded ones are still receiving; an exchange completes at
    ``max(own time, partner's time + a) + b + g``. Unrolled, virtual rank ``v`` finishes
    at ``L(b+g) + max_w(start_w + a·popcount(v XOR w))`` (``L = lg p2``), and the last
    rank is done at

    ``L(a+b+g)``  (``rem = 0``), else
    ``L(b+g) + a + b + g + max(b + (h+1)a, La)``,  ``h = bit_length(rem-1)``:

    the slowest path either starts at a folded rank and ends at one (``h`` = most bits in
    which two folded virtual ranks differ) or starts at a folded rank and ends at an
    unfolded one ``L`` bits away. ``rem ≥ p2/2 + 1`` gives the textbook
    ``L(a+b+g) + 2a + 2b + g``; ``p = 3`` gives ``2a + 3b + 2g``, one latency less.
    """
    if p == 1:
        return 0.0
    p2 = _p2(p)
    lg = p2.bit_length() - 1
    rem = p - p2
    if rem == 0:
        return lg * (a + b + g)
    h = (rem - 1).bit_length()
    return lg * (b + g) + a + b + g + max(b + (h + 1) * a, lg * a)


def allreduce_recursive_doubling(n: float, p: int, c: CostParams) -> float:
    """Fold-in, ``lg p2`` exchanges of the whole vector, fold-out:
    :func:`folded_butterfly` with ``a = α``, ``b = nβ``, ``g = nγ`` (at most
    ``lg p2·(α + nβ + nγ) + fold (2α + 2nβ + nγ)``)."""
    return folded_butterfly(p, c.alpha, n * c.beta, n * c.gamma)


def allreduce_rabenseifner(n: float, p: int, c: CostParams) -> float:
    if p == 1:
        return 0.0
    p2 = _p2(p)
    f = (p2 - 1) / p2
    fold = _fold(p) * (2 * c.alpha + 2 * n * c.beta + n * c.gamma)
    return 2 * _lg(p2) * c.alpha + 2 * f * n * c.beta + f * n * c.gamma + fold


def allgather_ring(n: float, p: int, c: CostParams) -> float:
    """Segmented ring of blocks ``n/p`` (:func:`ring_allgather_pass`): ``(p-1)α +
    (p-1)/p·nβ`` while a block is one segment."""
    return ring_allgather_pass(n / p, p, c)


def allgather_bruck(n: float, p: int, c: CostParams) -> float:
    """Bruck works in a rotated scratch buffer: it copies its own block in and the whole
    result back out (n + n/p bytes, charged at the local memory rate gamma). Without that
    term the model would prefer Bruck over ring for every large message from p = 4 on,
    where it is measured 2-3x slower."""
    if p == 1:
        return 0.0
    copies = (n + n / p) * c.gamma
    return math.ceil(_lg(p)) * c.alpha + (p - 1) / p * n * c.beta + copies


def allgather_direct(n: float, p: int, c: CostParams) -> float:
    """Every rank sends its n/p bytes to the p-1 others, all at once. Under the model's
    one-port assumption that serializes exactly like the ring (ties go to the ring); what
    it saves, the ring's chain of dependent steps, shows on a busy or oversubscribed
    node, not in alpha and beta."""
    return allgather_ring(n, p, c)


def allgather_recursive_doubling(n: float, p: int, c: CostParams) -> float:
    fold = _fold(p) * (2 * c.alpha + (n / p + n) * c.beta)
    return _lg(_p2(p)) * c.alpha + (p - 1) / p * n * c.beta + fold


def broadcast_binomial(n: float, p: int, c: CostParams) -> float:
    return math.ceil(_lg(p)) * (c.alpha + n * c.beta)


def broadcast_scatter_allgather(n: float, p: int, c: CostParams) -> float:
    if p == 1:
        return 0.0
    return (math.ceil(_lg(p)) + p - 1) * c.alpha + 2 * (p - 1) / p * n * c.beta


def reduce_scatter_ring(n: float, p: int, c: CostParams) -> float:
    """Segmented ring of blocks ``n/p`` (:func:`ring_reduce_scatter_pass`):
    ``(p-1)α + (p-1)/p·n(β + γ)`` while a block is one segment."""
    return ring_reduce_scatter_pass(n / p, p, c)


def reduce_scatter_direct(n: float, p: int, c: CostParams) -> float:
    """Each block goes straight to its owner: one-port, the same as the ring (see
    :func:`allgather_direct`)."""
    return reduce_scatter_ring(n, p, c)


def reduce_scatter_recursive_halving(n: float, p: int, c: CostParams) -> float:
    if p == 1:
        return 0.0
    p2 = _p2(p)
    fold = _fold(p) * (2 * c.alpha + n * (c.beta + c.gamma) + n / p * c.beta)
    return _lg(p2) * c.alpha + (p2 - 1) / p2 * n * (c.beta + c.gamma) + fold


# ---------------------------------------------------------------------- sparse
def topk_allgather(k: float, s: float, p: int, c: CostParams) -> float:
    """Every rank's k (index, value) pairs gathered by a ring: (p-1)α + (p-1)·k·s·β."""
    return (p - 1) * c.alpha + (p - 1) * k * s * c.beta


def gtopk(k: float, s: float, p: int, c: CostParams) -> float:
    """Butterfly gTop-k: lg p2 rounds of k pairs, plus the fold-in/fold-out step, on the
    critical path of :func:`folded_butterfly` (``a = α``, ``b = k·s·β``, no merge
    time): ``lg p2·(α + k·s·β)`` at a power of two, at most ``2(α + k·s·β)`` more."""
    return folded_butterfly(p, c.alpha, k * s * c.beta, 0.0)


def artopk_ring(k: float, index_bytes: float, value_bytes: float, p: int,
                c: CostParams) -> float:
    """AR-Top-k: binomial broadcast of k indices + ring allreduce of k values."""
    return (broadcast_binomial(k * index_bytes, p, c)
            + allreduce_ring(k * value_bytes, p, c))


def artopk_tree(k: float, index_bytes: float, value_bytes: float, p: int,
                c: CostParams) -> float:
    """AR-Top-k "tree": binomial broadcast of k indices + recursive-doubling allreduce of
    k values, which is how :func:`mpicomm.sparse.artopk` realises the paper's Tree-AR
    (the paper's binomial reduce + broadcast, 2 lg p rounds, is
    ``paper_predict("artopk_tree", ...)``)."""
    return (broadcast_binomial(k * index_bytes, p, c)
            + allreduce_recursive_doubling(k * value_bytes, p, c))


def ps_push_pull(n: float, workers: int, servers: int, c: CostParams) -> float:
    """One synchronous parameter-server step: every worker pushes ``n`` bytes and pulls
    ``n`` bytes, each key split evenly over ``servers``.

    The bottleneck is a server's port, which receives ``W`` pieces of ``n/S`` bytes and
    sends as many back, and sums the ``W`` pushed pieces, or with more servers than
    workers a worker's port, which carries ``n`` each way:
    ``2 alpha + 2 max(W/S, 1) n beta + W (n/S) gamma``. Reaching it needs the servers'
    replies (and the workers' pushes) staggered so that no port idles while another
    queues (:mod:`mpicomm.ps.server`). The latency counts once each way (the
    ``W`` messages are in flight together), as in Table I of Tyagi & Swany (their
    ``2 alpha + 2 (N-1) M beta`` with one server and ``N - 1 = W`` workers; their table
    has no gamma). Compare :func:`allreduce_ring` over the ``W`` workers, whose bandwidth
    term ``2 (W-1)/W n beta`` does not grow with ``W``: with ``S = 1`` a PS moves about
    ``W`` times more bytes through its busiest port; with ``S = W`` servers of their own
    bandwidth it matches the ring's term with a constant latency.
    """
    if workers < 1 or servers < 1:
        raise ValueError(f"need workers >= 1 and servers >= 1, got {workers}, {servers}")
    per_port = max(workers / servers, 1.0) * n
    return 2 * c.alpha + 2 * per_port * c.beta + workers * n / servers * c.gamma


FORMULAS: dict[str, dict[str, Callable[[float, int, CostParams], float]]] = {
    "allreduce": {
        "ring": allreduce_ring,
        "recursive_doubling": allreduce_recursive_doubling,
        "rabenseifner": allreduce_rabenseifner,
    },
    "allgather": {
        "ring": allgather_ring,
        "bruck": allgather_bruck,
        "recursive_doubling": allgather_recursive_doubling,
        "direct": allgather_direct,
    },
    "allgatherv": {"ring": allgather_ring, "direct": allgather_direct},
    "broadcast": {
        "binomial": broadcast_binomial,
        "scatter_allgather": broadcast_scatter_allgather,
    },
    "reduce_scatter": {
        "ring": reduce_scatter_ring,
        "recursive_halving": reduce_scatter_recursive_halving,
        "direct": reduce_scatter_direct,
    },
}

