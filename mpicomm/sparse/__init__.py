"""Sparse collectives for top-k gradient compression.

=========================  ================================================================
function                   what every rank gets
=========================  ================================================================
:func:`topk_allgather`     every rank's (indices, values) scatter-added into a dense vector
                           (ring allgatherv; exact; (P-1)·k·s bytes sent per rank)
:func:`gtopk`              approximate global top-k of the sum by butterfly merge-and-truncate
                           (lg P rounds of <= k pairs; exact for P <= 2)
:func:`artopk`             one source rank's top-k indices (STAR round-robin or VAR norm
                           EWMA) and the mean over ranks of the values there (bcast+allreduce)
:func:`exact_topk`         exact top-k of the sum (allgather all pairs; the reference)
:func:`hierarchical_topk`  dense sum inside each host, then top-k and gTop-k / AR-Top-k /
                           Allgather across hosts only, the result back to the host's ranks
                           (:mod:`mpicomm.sparse.hierarchical`)
=========================  ================================================================

Inputs are numpy arrays, torch tensors (CPU/CUDA) or cupy arrays; results come back in the
same framework and device, sorted by index ascending and identical on every rank. Every
selection uses the library's total order (``|v|`` desc, then index asc).
:mod:`mpicomm.sparse.reference` holds single-process numpy references (the spec),
:mod:`mpicomm.sparse.sets` the kernels on sparse sets (union, truncation, merge),
:mod:`mpicomm.sparse.coding` a compact wire format of pairs (``topk_allgather(...,
coding="log8")``, ``gtopk(..., coding="log8")``: one byte a value, varint index gaps).
Costs are in :mod:`mpicomm.collectives.cost` (``topk_allgather``, ``gtopk``,
``artopk_ring``, ``artopk_tree``).
"""

from . import coding, reference, sets
from .allgather import exact_topk, topk_allgather
from .artopk import ARTopKState, artopk
from .gtopk import gtopk
from .hierarchical import hierarchical_topk

__all__ = ["topk_allgather", "gtopk", "artopk", "ARTopKState", "exact_topk",
           "hierarchical_topk", "coding", "reference", "sets"]


def _cost_kernels() -> None:
    """Register the sparse layer's compute for the virtual clock's cost table
    (:mod:`mpicomm.costtable`): ``select`` (top-k of 1% of ``n`` float32 values, per
    value), ``select:kept`` (what keeping ``m`` more of 2^18 values adds, per index: the
    slope between ``m`` = 2^12 and 2^17, no per-call part), ``merge`` (sparse union of
    two sorted sets of ``n/2`` pairs each, a third of the indices shared, per pair),
    ``sort`` (sorting ``n`` distinct indices in random order, what a sparse collective does
    with a rank's input given unsorted, per element),
    ``scatter`` (zero a dense vector of ``n`` and scatter-add 1% of it, per element),
    ``encode:log8`` and ``decode:log8`` (:mod:`~mpicomm.sparse.coding` of ``n`` pairs
    spread over ``100·n`` elements, per pair)."""
    import torch

    from ..compress.topk_select import SELECT_COST_DENSITY
    from ..costtable import register_kernel
    from .coding import decode, encode
    from .sets import truncate, union

    def select(n: int):  # type: ignore[no-untyped-def]
        gen = torch.Generator().manual_seed(0)
        idx, val = torch.arange(n), torch.randn(n, generator=gen)
        return lambda: truncate(idx, val, max(1, int(SELECT_COST_DENSITY * n)))

    def select_kept(m: int):  # type: ignore[no-untyped-def]
        n = 1 << 18
        gen = torch.Generator().manual_seed(0)
        idx, val = torch.arange(n), torch.randn(n, generator=gen)
        return lambda: truncate(idx, val, int(SELECT_COST_DENSITY * n) + m)

    def merge(n: int):  # type: ignore[no-untyped-def]
        gen = torch.Generator().manual_seed(0)
        half = n // 2   # sorted distinct indices, about a third shared by both sets
        a = torch.arange(half) * 3 + torch.randint(0, 3, (half,), generator=gen)
        b = torch.arange(half) * 3 + torch.randint(0, 3, (half,), generator=gen)
        va, vb = torch.randn(n // 2, generator=gen), torch.randn(n // 2, generator=gen)
        return lambda: union((a, va), (b, vb))

    def sort(n: int):  # type: ignore[no-untyped-def]
        idx = torch.randperm(n << 4, generator=torch.Generator().manual_seed(0))[:n]
        return lambda: torch.sort(idx, stable=True)

    def scatter(n: int):  # type: ignore[no-untyped-def]
        gen = torch.Generator().manual_seed(0)
        idx = torch.randperm(n, generator=gen)[:max(1, n // 100)]
        val = torch.randn(idx.shape[0], generator=gen)

        def run() -> None:
            dense = torch.zeros(n)
            dense[idx] += val

        return run

    def pairs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        return torch.randperm(100 * n, generator=gen)[:n], torch.randn(n, generator=gen)

    def encode_log8(n: int):  # type: ignore[no-untyped-def]
        idx, val = pairs(n)
        return lambda: encode(idx, val)

    def decode_log8(n: int):  # type: ignore[no-untyped-def]
        buf = encode(*pairs(n))
        return lambda: decode(buf, torch.float32)

    register_kernel("select", select, "element", (1 << 14, 1 << 20))
    register_kernel("select:kept", select_kept, "kept element", (1 << 12, 1 << 17),
                    intercept=False)
    register_kernel("merge", merge, "pair", (1 << 12, 1 << 18))
    register_kernel("sort", sort, "element", (1 << 12, 1 << 18))
    register_kernel("scatter", scatter, "element", (1 << 14, 1 << 20))
    register_kernel("encode:log8", encode_log8, "pair", (1 << 10, 1 << 16))
    register_kernel("decode:log8", decode_log8, "pair", (1 << 10, 1 << 16))


_cost_kernels()
