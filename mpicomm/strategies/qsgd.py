"""QSGD: every rank's bit-packed quantized buffer gathered and the decodings averaged."""

from __future__ import annotations

from typing import Any

import torch

from ..collectives import allgather, cost
from ..compress import QSGD
from ..compress.base import Payload
from ..validate import check_algorithm, check_int
from ._compressed import CompressedStrategy, pack_bytes, unpack_bytes
from .base import DEFAULT_FUSION_BYTES

__all__ = ["QSGDAllgather", "gather_payloads", "check_allgather_algorithm"]


def check_allgather_algorithm(algorithm: Any) -> str:
    """An allgather algorithm name of :func:`mpicomm.allgather` (or ``"auto"``)."""
    from ..collectives import ALGORITHMS

    return check_algorithm("allgather", algorithm, ALGORITHMS["allgather"])


def gather_payloads(wire: torch.Tensor, comm: Any, algorithm: str) -> list[torch.Tensor]:
    """Every rank's equally long uint8 ``wire`` (rank order), by one allgather."""
    m = wire.shape[0]
    gathered = allgather(wire, algorithm=algorithm, comm=comm)
    return [gathered[r * m:(r + 1) * m] for r in range(comm.size)]


class QSGDAllgather(CompressedStrategy):
    r"""QSGD quantization + Allgather of the packed payloads ("qsgd").

    Per fused buffer ``g`` of ``d`` elements on rank r, at the buffer's t-th aggregation::

        c_r = g_r + e_r                          # only with error_feedback (default off)
        q_r = QSGD(bits, bucket_size, seed, salt=r).compress(c_r, name, t)
        u   = (1/P) Σ_r decode(q_r)              # allgather of every q_r, then each rank
                                                 # decodes all P payloads (rank order)
        e_r = c_r - decode(q_r)                  # only with error feedback

    Every rank decodes the gathered payloads with its own context (shape, bits, bucket
    size: identical on all ranks), sums the P decodings in rank order in float32 (float64
    for float64 input), and divides by P, so all ranks get the same bits.

    Independent noise: rank r quantizes with ``salt=r``, i.e. its stochastic rounding
    comes from the stream ``(seed, r, buffer name, t)``. Independent errors average out:
    the variance of ``u`` is the mean per-rank variance divided by P (with a shared salt
    the ranks' rounding errors on equal inputs would be identical and not shrink).
    QSGD is unbiased, so error feedback is off by default.

    Bytes sent per rank (ring allgather of one fixed-size payload ``m``):
    ``(P-1)·m`` with ``m = ceil(d·(bits+1)/8) + 4·ceil(d/bucket_size)`` (packed sign +
    level codes, one float32 scale per bucket), for any input dtype.

    ``schedule`` (a density warm-up, :mod:`mpicomm.control.schedules`): read as a byte
    budget, the buffer is averaged densely (ring allreduce of the compensated buffer,
    residual flushed) while the scheduled density exceeds this strategy's wire bytes /
    dense bytes, e.g. the first epoch of ``linear_warmup``. ``momentum_correction``,
    ``momentum_masking``, ``clip_norm``: see
    :class:`~mpicomm.strategies._compressed.CompressedStrategy`.

    Cost model: :func:`mpicomm.collectives.cost.allgather_ring` ``(P·m, P)`` =
    (P-1)α + (P-1)·m·β (:meth:`predict`), plus O(P·d) to decode.

    Tuning: 4-8 bits with buckets of 128-512 keep accuracy without error feedback
    (relative error about sqrt(bucket_size) / (2·(2^bits - 1)) per rank). It moves
    (P-1)·m bytes per rank, so it sends fewer bytes than a dense ring allreduce
    (2(P-1)/P·d·itemsize) only while P < 16·itemsize / (bits+1): up to 7 ranks at 8 bits
    and 12 at 4 bits for float32 gradients; beyond that prefer an allreduce-compatible
    scheme. Measured at 8 ranks with ``bits=4`` against dense of the same seed: MNIST-1D's
    CNN (2 028 steps) +0.04 points (median of 3 seeds) and the language model
    (``text-lm``, 3 626 steps, seed 0) -1.50% of dense's perplexity, both at 1.58x fewer
    bytes.
    """

    name = "qsgd"

    def __init__(self, bits: int = 8, bucket_size: int = 512, *, seed: int = 0,
                 error_feedback: bool = False, algorithm: str = "ring", comm: Any = None,
                 fusion_bytes: int = DEFAULT_FUSION_BYTES, schedule: Any = None,
                 momentum_correction: float = 0.0, momentum_masking: bool = True,
                 clip_norm: float | None = None):
        QSGD(bits, bucket_size, seed)  # validates bits, bucket_size (ValueError)
        seed = check_int("seed", seed)
        self.bits, self.bucket_size, self.seed = bits, bucket_size, seed
        self.algorithm = check_allgather_algorithm(algorithm)
        self._quantizers: dict[int, QSGD] = {}
        super().__init__(comm, error_feedback=error_feedback, fusion_bytes=fusion_bytes,
                         schedule=schedule,
                         momentum_correction=momentum_correction,
                         momentum_masking=momentum_masking, clip_norm=clip_norm)

    def quantizer(self, rank: int) -> QSGD:
        """The :class:`~mpicomm.compress.QSGD` that rank ``rank`` uses (``salt=rank``)."""
        if rank not in self._quantizers:
            self._quantizers[rank] = QSGD(self.bits, self.bucket_size, self.seed, salt=rank)
        return self._quantizers[rank]

    def aggregate_flat(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        step = self._step(name)
        comm = self.comm
        q = self.quantizer(comm.rank)
        if self.dense_step(step, q.wire_bytes(flat.shape[0]) / (flat.numel()
                                                               * flat.element_size())):
            return self._aggregate_dense(name, flat)
        c = self._compensate(name, flat)
        payload = q.compress(c, name=name, step=step)
        if self.memory is not None:
            self.memory.update(name, c, q.decompress(payload))
        levels, scales = payload.arrays["levels"], payload.arrays["scales"]
        layout = [(torch.uint8, levels.shape[0]), (torch.float32, scales.shape[0])]
        work = torch.float64 if flat.dtype == torch.float64 else torch.float32
        acc = torch.zeros(flat.shape[0], dtype=work, device=flat.device)
        for wire in gather_payloads(pack_bytes([levels, scales]), comm, self.algorithm):
            lv, sc = unpack_bytes(wire, layout)
            acc += q.decompress(Payload({"levels": lv, "scales": sc}, payload.ctx)).to(work)
        if comm.size > 1:
            acc /= comm.size
        return acc.to(flat.dtype)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "bits": self.bits, "bucket_size": self.bucket_size,
                "seed": self.seed, "noise": "independent per rank (salt=rank)",
                "collective": f"allgather({self.algorithm})"}

    def _predict_flat(self, numel: int, itemsize: int, p: int, params: cost.CostParams,
                      compute: cost.ComputeParams) -> tuple[float, float]:
        """Allgather of every rank's packed payload; compute: encode once, decode P."""
        m = QSGD(self.bits, self.bucket_size).wire_bytes(numel)
        algorithm = "mpi" if self.algorithm == "auto" else self.algorithm
        work = (1 + p) * numel * itemsize * compute.copy * 4
        return cost.predict("allgather", algorithm, m * p, p, params), work
