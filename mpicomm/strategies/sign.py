"""EF-SignSGD: one sign bit per element and one scale per tensor, gathered and averaged."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..buffers import from_torch, to_torch
from ..collectives import allreduce, cost
from ..compress import SignSGD
from ..compress.base import Payload
from ._compressed import CompressedStrategy, pack_bytes, unpack_bytes
from .base import DEFAULT_FUSION_BYTES, fuse, fused_groups, measure
from .qsgd import check_allgather_algorithm, gather_payloads

__all__ = ["SignAllgather"]


class SignAllgather(CompressedStrategy):
    r"""Error-fed scaled sign compression + Allgather (EF-SignSGD; "sign").

    Per tensor ``g`` of ``d`` elements on rank r (layer by layer, so every tensor has its
    own scale, but all tensors of a fused buffer travel in one allgather)::

        c_r = g_r + e_r                          # error feedback (default on)
        s_r = (||c_r||_1 / d)·sign(c_r)          # SignSGD(scale=True); zeros count as +
        e_r = c_r - s_r
        u   = (1/P) Σ_r s_r                      # allgather of every rank's packed signs
                                                 # and scales; decoded in rank order

    The scale makes the compressor a contraction, so with error feedback it converges
    like SGD (Karimireddy et al., 2019); without error feedback plain scaled signs are
    biased. Every rank gets the same bits (sum of the P decodings in rank order, in
    float32, or float64 for float64 input, then / P).

    Bytes sent per rank (ring allgather of one payload per rank):
    ``(P-1)·Σ_t (ceil(d_t/8) + 4)`` over the tensors t of the buffer, for any dtype.

    ``schedule`` (a density warm-up, :mod:`mpicomm.control.schedules`): read as a byte
    budget, the buffer is averaged densely (ring allreduce of the compensated buffer,
    residual flushed) while the scheduled density exceeds this strategy's wire bytes /
    dense bytes, e.g. the first epoch of ``linear_warmup``. ``momentum_correction``,
    ``momentum_masking``, ``clip_norm``: see
    :class:`~mpicomm.strategies._compressed.CompressedStrategy`.

    Cost model: :func:`mpicomm.collectives.cost.allgather_ring` ``(P·m, P)`` with
    ``m = Σ_t (ceil(d_t/8) + 4)`` (:meth:`predict`), plus O(P·d) to decode.

    Tuning: each rank's payload is 32x smaller than float32, but the allgather grows with
    P: it sends fewer bytes than a dense ring allreduce (2(P-1)/P·d·itemsize) while
    P < 16·itemsize, i.e. up to 63 ranks for float32 gradients. Always keep error
    feedback on. The scale is per tensor (as SignSGD's docs advise), not per fused buffer.
    """

    name = "sign"

    def __init__(self, *, error_feedback: bool = True, algorithm: str = "ring",
                 comm: Any = None, fusion_bytes: int = DEFAULT_FUSION_BYTES,
                 schedule: Any = None, momentum_correction: float = 0.0,
                 momentum_masking: bool = True, clip_norm: float | None = None):
        self.compressor = SignSGD(scale=True)
        self.algorithm = check_allgather_algorithm(algorithm)
        super().__init__(comm, error_feedback=error_feedback, fusion_bytes=fusion_bytes,
                         schedule=schedule,
                         momentum_correction=momentum_correction,
                         momentum_masking=momentum_masking, clip_norm=clip_norm)

    def aggregate(self, tensors: Sequence[Any], names: Sequence[str] | None = None
                  ) -> list[Any]:
        tensors, names = self._floating_inputs(tensors, names)
        as_torch = [to_torch(t) for t in tensors]
        results: list[Any] = [None] * len(tensors)
        with measure(self, as_torch):
            for buf in fuse(as_torch, names, self.fusion_bytes):
                parts = [v.reshape(-1) for v in buf.split(buf.flat)]
                averaged = self._aggregate_parts(parts, [names[i] for i in buf.indices])
                for i, part in zip(buf.indices, averaged):
                    results[i] = from_torch(part.view(as_torch[i].shape), like=tensors[i])
        return results

    def aggregate_flat(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """One flat vector, one scale."""
        return self._aggregate_parts([flat], [name])[0]

    def _aggregate_parts(self, parts: list[torch.Tensor], names: list[str]
                         ) -> list[torch.Tensor]:
        sign, comm = self.compressor, self.comm
        wire = sum(sign.wire_bytes(p.shape[0]) for p in parts)
        dense = sum(p.numel() * p.element_size() for p in parts)
        if self.dense_step(self._steps.get(names[0], 0), wire / dense):
            return self._dense_parts(parts, names)
        payloads, arrays, layout = [], [], []
        for part, name in zip(parts, names):
            self._step(name)
            c = self._compensate(name, part)
            payload = sign.compress(c, name=name)
            if self.memory is not None:
                self.memory.update(name, c, sign.decompress(payload))
            payloads.append(payload)
            signs, scale = payload.arrays["signs"], payload.arrays["scale"]
            arrays += [signs, scale]
            layout += [(torch.uint8, signs.shape[0]), (torch.float32, 1)]
        work = torch.float64 if parts[0].dtype == torch.float64 else torch.float32
        acc = [torch.zeros(p.shape[0], dtype=work, device=p.device) for p in parts]
        for wire in gather_payloads(pack_bytes(arrays), comm, self.algorithm):
            got = unpack_bytes(wire, layout)
            for j, payload in enumerate(payloads):
                theirs = Payload({"signs": got[2 * j], "scale": got[2 * j + 1]}, payload.ctx)
                acc[j] += sign.decompress(theirs).to(work)
        p = comm.size
        return [(a / p if p > 1 else a).to(part.dtype) for a, part in zip(acc, parts)]

    def _dense_parts(self, parts: list[torch.Tensor], names: list[str]
                     ) -> list[torch.Tensor]:
        """A warm-up step: the parts' exact mean by one allreduce (residuals flushed)."""
        for name in names:
            self._step(name)
        sizes = [p.shape[0] for p in parts]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        compensated = [self._compensate(name, p) for name, p in zip(names, parts)]
        if self.memory is not None:
            for name, c in zip(names, compensated):
                self.memory.update(name, c, c)
        flat = torch.cat(compensated)
        self.stats.extra["dense_steps"] = self.stats.extra.get("dense_steps", 0) + 1
        mean = allreduce(flat, op="avg", algorithm="ring", comm=self.comm)
        return [mean[a:b] for a, b in zip(offsets, offsets[1:])]

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "compressor": "sign(scaled, per tensor)",
                "collective": f"allgather({self.algorithm})"}

    def _predict_shapes(self, shapes: list[tuple[int, ...]], itemsize: int, p: int,
                        params: cost.CostParams, compute: cost.ComputeParams
                        ) -> dict[str, float]:
        """Per fused buffer, one allgather of the packed signs and scales of its tensors;
        compute: compensation, encode, decode of P payloads."""
        algorithm = "mpi" if self.algorithm == "auto" else self.algorithm
        comm_s = work = 0.0
        for group in fused_groups(shapes, itemsize, self.fusion_bytes):
            numels = [math.prod(shapes[i]) for i in group]
            m = sum(self.compressor.wire_bytes(n) for n in numels)
            comm_s += cost.predict("allgather", algorithm, m * p, p, params)
            work += (2 + p) * sum(numels) * itemsize * compute.copy
        return {"comm": comm_s, "compute": work}
