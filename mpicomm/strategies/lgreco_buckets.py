r"""L-GreCo's per-layer settings inside one fused bucket: compress, exchange, predict.

:class:`mpicomm.control.LGreco` chooses one setting per layer; a fused bucket holds
several layers (``segments``: ``(layer, numel, shape)`` in bucket order). These functions
compress every segment with *its* setting and still run one collective sequence per
bucket, so fusion keeps its latency saving:

``topk_bucket`` (family ``"topk"``): each layer's own top-k at its density
(:func:`segment_topk_indices`, the union in bucket order), then either a sparse allgather
of the union (``allgather_topk``: ``(P-1)·Σ_l k_l`` pairs per rank) or AR-Top-k
(``artopk_ring``/``artopk_tree``: the source rank's union, its size agreed by a
broadcast from the source, then the allreduce of those entries).

``qsgd_bucket`` (family ``"qsgd"``), on rank r, bucket ``c`` (error-fed), layer l with
``b_l`` bits::

    q_{r,l} = QSGD(b_l, bucket_size, seed, salt=r).compress(c_l, name=l, step)
    wire_r  = pack(q_{r,1} levels, q_{r,1} scales, ..., q_{r,L} scales)   # ONE byte vector
    wires   = ring allgather(wire_r)           # the same length on every rank
    u_l     = (1/P) Σ_r decode(q_{r,l})        # rank order, float32 (float64 for float64)

  bytes sent per rank ``(P-1)·Σ_l m_l`` with ``m_l = ceil(n_l(b_l+1)/8) + 4·ceil(n_l/B)``
  (:meth:`~mpicomm.compress.QSGD.wire_bytes`: the sizes the L-GreCo DP minimized).
  Independent rounding per rank (``salt=r``), as :class:`~mpicomm.strategies.QSGDAllgather`.
  Unbiased, so no error feedback (``auto`` keeps none for this family: at 2-4 bits the
  rank's own error ``c - decode(q_r)``, returned too, is as large as the gradient).

``powersgd_bucket`` (family ``"powersgd"``), layer l with rank ``r_l`` as an
``n_l x m_l`` matrix (:func:`~mpicomm.compress.powersgd.matrix_shape`)::

    P_l = M_l Q_l   (warm-started Q per layer)   for layers PowerSGD compresses at r_l
    [P_1..P_k, c_dense] = allreduce-sum(...)      # ONE ring allreduce: factors + the
                                                  # layers sent dense (vectors, small)
    Q_l = M_l^T orthonormalize(P_l)
    [Q_1..Q_k]          = allreduce-sum(...)      # ONE ring allreduce
    U_l = orthonormalize(P_l) Q_l^T / P ;  dense layers: c_dense / P

  elements on the wire ``Σ (n_l + m_l)·r_l + Σ_dense n_l`` (float32; float64 for float64
  input): :meth:`~mpicomm.compress.PowerSGD.wire_bytes` per layer, again the DP's sizes.
  Ours, not PyTorch's hook: the uncompressed layers ride in the P allreduce (one
  collective fewer than :class:`~mpicomm.strategies.PowerSGDAllreduce`). The residual is
  ``c - U`` for compressed layers (error-fed PowerSGD) and 0 for layers sent dense.

:func:`predict_bucket` is the alpha-beta-gamma time of the QSGD or PowerSGD exchange
(the collectives' formulas in :mod:`mpicomm.collectives.cost` plus the compute the
strategies model), used by :class:`~mpicomm.strategies.AutoStrategy` to choose between
dense and the per-layer scheme, and with ``beta = 1`` the bytes one rank sends.

Tuning: per-layer settings pay off when layers differ in how compressible their
gradients are (a low-rank layer next to a noisy one); identical layers get the uniform
setting back (the DP then has nothing to trade).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..collectives import allgather, allreduce, cost
from ..compress import QSGD, PowerSGD
from ..compress.base import Payload
from ..compress.powersgd import matrix_shape
from ..compress.topk_select import topk_indices
from ..p2p import pack_bytes, unpack_bytes
from ..sparse import artopk, topk_allgather
from ..sparse.artopk import star_source

__all__ = ["Segment", "qsgd_bucket", "powersgd_bucket", "predict_bucket", "FAMILY_SCHEMES",
           "segment_topk_indices", "topk_bucket"]

#: ``(layer name, numel, shape)`` of one layer inside a fused bucket.
Segment = tuple[str, int, tuple[int, ...]]

#: The scheme name under which ``auto`` runs a family's per-layer settings.
FAMILY_SCHEMES: dict[str, str] = {"qsgd": "lgreco_qsgd", "powersgd": "lgreco_powersgd"}


def _work(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def segment_topk_indices(c: torch.Tensor, segments: Sequence[Segment],
                         densities: Mapping[str, float]) -> torch.Tensor:
    """Each segment's top-k of ``c`` (``k = max(1, min(n, ceil(density·n)))``), as sorted
    bucket indices (int64). Deterministic (|value| desc, index asc)."""
    picks, offset = [], 0
    for layer, n, _ in segments:
        k = max(1, min(n, math.ceil(densities[layer] * n)))
        picks.append(topk_indices(c[offset:offset + n], k).to(torch.int64) + offset)
        offset += n
    return torch.cat(picks).sort().values


def topk_bucket(scheme: str, c: torch.Tensor, segments: Sequence[Segment],
                densities: Mapping[str, float], comm: Any, step: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices this rank sent, the dense mean over ranks) of the flat error-fed bucket
    ``c`` with every segment at its own top-k density (collective).

    ``scheme``: ``"allgather_topk"`` (every rank's union of per-segment picks, sparse
    allgather) or ``"artopk_ring"``/``"artopk_tree"`` (the picks of the source rank
    ``step mod P``; every rank sends its entries at those indices). The caller keeps the
    error-feedback residual: ``c`` outside the returned indices."""
    numel = c.shape[0]
    idx = segment_topk_indices(c, segments, densities)
    if scheme == "allgather_topk":
        return idx, topk_allgather(idx, c[idx], numel, op="avg", comm=comm)
    source = star_source(step, comm.size)
    k = int(comm.bcast_object(int(idx.shape[0]), root=source))
    got, mean = artopk(c, k, step, "star", comm, None, scheme.split("_")[1],
                       source_indices=idx if comm.rank == source else None)
    out = torch.zeros(numel, dtype=c.dtype, device=c.device)
    out[got] = mean
    return got, out


def qsgd_bucket(c: torch.Tensor, segments: Sequence[Segment], bits: Mapping[str, int],
                comm: Any, step: int, *, bucket_size: int = 512, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean over ranks, this rank's own decoding) of the flat bucket ``c``, each segment
    quantized with ``bits[layer]`` (collective: one ring allgather)."""
    work = _work(c.dtype)
    payloads, arrays, layout = [], [], []
    offset = 0
    for layer, n, _ in segments:
        q = QSGD(int(bits[layer]), bucket_size, seed, salt=comm.rank)
        payload = q.compress(c[offset:offset + n], name=layer, step=step)
        levels, scales = payload.arrays["levels"], payload.arrays["scales"]
        payloads.append(payload)
        arrays += [levels, scales]
        layout += [(torch.uint8, levels.shape[0]), (torch.float32, scales.shape[0])]
        offset += n
    own = torch.cat([_decode(p, work) for p in payloads]) if payloads else c.new_zeros(0)
    wire = pack_bytes(arrays)
    m = wire.shape[0]
    gathered = allgather(wire, algorithm="ring", comm=comm) if comm.size > 1 else wire
    acc = torch.zeros(c.shape[0], dtype=work, device=c.device)
    for r in range(comm.size):
        parts = unpack_bytes(gathered[r * m:(r + 1) * m], layout)
        offset = 0
        for i, (payload, (_, n, _)) in enumerate(zip(payloads, segments)):
            got = Payload({"levels": parts[2 * i], "scales": parts[2 * i + 1]}, payload.ctx)
            acc[offset:offset + n] += _decode(got, work)
            offset += n
    if comm.size > 1:
        acc /= comm.size
    return acc.to(c.dtype), own.to(c.dtype)


def _decode(payload: Payload, work: torch.dtype) -> torch.Tensor:
    from ..buffers import to_torch

    return to_torch(QSGD().decompress(payload)).reshape(-1).to(work)


def powersgd_bucket(c: torch.Tensor, segments: Sequence[Segment], ranks: Mapping[str, int],
                    comm: Any, step: int, compressors: dict[int, PowerSGD], *, seed: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean approximation, what this rank counts as sent) of the flat bucket ``c``, each
    matrix segment at rank ``ranks[layer]`` (collective: two ring allreduces).

    ``compressors`` (rank -> :class:`~mpicomm.compress.PowerSGD` with warm start) is the
    caller's, kept across steps: it holds each layer's warm-start Q."""
    from ..buffers import to_torch

    work = _work(c.dtype)
    low, dense, offset = [], [], 0
    for layer, n, shape in segments:
        r = int(ranks[layer])
        psgd = compressors.get(r)
        if psgd is None:
            psgd = compressors[r] = PowerSGD(rank=r, warm_start=True, seed=seed)
        part = c[offset:offset + n]
        if psgd.should_compress(tuple(shape)):
            low.append((layer, offset, n, shape, psgd, part.view(shape)))
        else:
            dense.append((offset, n))
        offset += n
    ps = [to_torch(psgd.p_phase(mat, layer, step)).to(work)
          for layer, _, _, _, psgd, mat in low]
    flat = torch.cat([p.reshape(-1) for p in ps]
                     + [c[o:o + n].to(work) for o, n in dense]) if (ps or dense) \
        else c.new_zeros(0, dtype=work)
    if comm.size > 1 and flat.numel():
        allreduce(flat, op="sum", algorithm="ring", comm=comm, out=flat)
    out = torch.zeros(c.shape[0], dtype=work, device=c.device)
    sent = c.to(work).clone()
    at, qs = 0, []
    p_sums = []
    for (layer, _, _, _, psgd, mat), p in zip(low, ps):
        p_sum = flat[at:at + p.numel()].view(p.shape)
        at += p.numel()
        p_sums.append(p_sum)
        qs.append(to_torch(psgd.q_phase(mat, layer, p_sum)).to(work))
    for o, n in dense:
        out[o:o + n] = flat[at:at + n] / comm.size
        at += n
    if qs:
        qflat = torch.cat([q.reshape(-1) for q in qs])
        if comm.size > 1:
            allreduce(qflat, op="sum", algorithm="ring", comm=comm, out=qflat)
        at = 0
        for (layer, o, n, _, psgd, _), p_sum, q in zip(low, p_sums, qs):
            q_sum = qflat[at:at + q.numel()].view(q.shape)
            at += q.numel()
            approx = to_torch(psgd.reconstruct(layer, p_sum, q_sum, comm.size))
            out[o:o + n] = approx.reshape(-1).to(work)
            sent[o:o + n] = out[o:o + n]
    return out.to(c.dtype), sent.to(c.dtype)


def predict_bucket(family: str, shapes: Sequence[tuple[int, ...]], values: Sequence[float],
                   itemsize: int, p: int, params: cost.CostParams,
                   compute: cost.ComputeParams, bucket_size: int = 512) -> dict[str, float]:
    """``{"comm", "compute"}`` seconds of :func:`qsgd_bucket` / :func:`powersgd_bucket`
    for layers of ``shapes`` at settings ``values`` (bits or ranks, in order).

    Communication: the ring allgather of ``Σ m_l`` bytes per rank (QSGD), or the ring
    allreduces of ``(Σ n_l r_l + Σ_dense n_l)·w`` and ``Σ m_l r_l·w`` bytes (PowerSGD),
    by :func:`mpicomm.collectives.cost.predict`; compute as the uniform strategies model
    it (QSGD: encode once, decode P times, a few passes each; PowerSGD: three
    ``n·m·r`` products per matrix and the residual update)."""
    if family not in FAMILY_SCHEMES:
        raise ValueError(f"family must be one of {sorted(FAMILY_SCHEMES)}, got {family!r}")
    numel = sum(math.prod(s) for s in shapes)
    if family == "qsgd":
        m = sum(QSGD(int(b), bucket_size).wire_bytes(math.prod(s))
                for s, b in zip(shapes, values))
        work = (1 + p) * numel * itemsize * compute.copy * 4
        return {"comm": cost.predict("allgather", "ring", m * p, p, params), "compute": work}
    w = 8 if itemsize == 8 else 4
    first = second = flops = compressed = 0
    for shape, r in zip(shapes, values):
        psgd = PowerSGD(rank=int(r))
        if psgd.should_compress(tuple(shape)):
            n, m = matrix_shape(tuple(shape))
            rr = psgd.rank_for(tuple(shape))
            first, second = first + n * rr, second + m * rr
            flops += 3 * n * m * rr
            compressed += n * m
        else:
            first += math.prod(shape)
    total = sum(cost.predict("allreduce", "ring", elems * w, p, params)
                for elems in (first, second) if elems)
    return {"comm": total, "compute": flops * compute.flop + 2 * compressed * itemsize
            * compute.copy}
