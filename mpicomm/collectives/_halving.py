"""Recursive halving / doubling over a power-of-two set of (virtual) ranks.

A non-power-of-two rank count ``p`` is handled by folding (see ``fold_layout``): the
first ``2*rem`` ranks pair up, the even rank of a pair hands its vector to the odd one
before the power-of-two phase and gets the result back after it.

``vbounds`` splits the work array into ``p2`` virtual blocks, one per virtual rank. After
:func:`halve`, virtual rank ``v`` holds the full reduction of virtual block ``v``; the
``history`` it returns lets :func:`double` replay the exchanges backwards to gather
every block again (Rabenseifner's reduce-scatter + allgather).
"""

from __future__ import annotations

from typing import Any

from ..p2p import Ctx, real_rank
from ..tags import TAG_FOLD


def fold_in(work: Any, op: str, ctx: Ctx, rem: int, scratch: Any) -> None:
    """Paired ranks combine their vectors onto the odd rank of each pair."""
    r = ctx.rank
    if r >= 2 * rem:
        return
    if r % 2 == 0:
        ctx.send(work, r + 1, TAG_FOLD)
    else:
        n = work.shape[0]
        ctx.recv(scratch[:n], r - 1, TAG_FOLD)
        ctx.ops.reduce_(work, scratch[:n], op)


def fold_out(work: Any, ctx: Ctx, rem: int) -> None:
    """The odd rank of each pair returns the finished vector to the even one."""
    r = ctx.rank
    if r >= 2 * rem:
        return
    if r % 2 == 0:
        ctx.recv(work, r + 1, TAG_FOLD)
    else:
        ctx.send(work, r - 1, TAG_FOLD)


History = list[tuple[int, tuple[int, int], tuple[int, int]]]


def halve(work: Any, vbounds: list[int], v: int, p2: int, rem: int, op: str, ctx: Ctx,
          scratch: Any, tag: int) -> History:
    """Recursive-halving reduce-scatter among the ``p2`` virtual ranks.

    At the step with distance ``mask`` (p2/2, p2/4, ..., 1) virtual rank ``v`` keeps the
    half of its current block range on its side of the partner ``v ^ mask``, sends the
    other half and reduces what it receives into the half it keeps.
    """
    lo, hi = 0, p2
    history: History = []
    mask = p2 >> 1
    while mask:
        partner = v ^ mask
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if v < partner else ((mid, hi), (lo, mid))
        k0, k1 = vbounds[keep[0]], vbounds[keep[1]]
        g0, g1 = vbounds[give[0]], vbounds[give[1]]
        peer = real_rank(partner, rem)
        ctx.sendrecv(work[g0:g1], peer, scratch[:k1 - k0], peer, tag)
        ctx.ops.reduce_(work[k0:k1], scratch[:k1 - k0], op)
        history.append((peer, keep, give))
        lo, hi = keep
        mask >>= 1
    return history


def double(work: Any, vbounds: list[int], history: History, ctx: Ctx, tag: int) -> None:
    """Recursive-doubling allgather that undoes :func:`halve` step by step."""
    for peer, keep, give in reversed(history):
        ctx.sendrecv(work[vbounds[keep[0]]:vbounds[keep[1]]], peer,
                     work[vbounds[give[0]]:vbounds[give[1]]], peer, tag)
