"""PyTorch integration: make any training loop distributed with a few lines.

``GradientSync``            averages gradients during backward (buckets, overlap, no_sync)
``DistributedOptimizer``    the same, shaped as a wrapper around your optimizer
``LocalSGD``                periodic parameter averaging, fixed period or AdaComm
``GossipAveraging``         decentralized neighbour averaging (ring / exponential graph)
``ddp_comm_hook``           any mpicomm strategy inside PyTorch DDP (``init_process_group``
                           from the MPI ranks, ``MpicommHookState`` + ``mpicomm_hook``)
``PSOptimizer``             train through a parameter server (``mpicomm.ps.KVStore``)
``TorchJob``                a model + optimizer + data as a Crossover scheduler job

Where a wrapper takes a ``strategy`` (GradientSync, DistributedOptimizer, ddp_comm_hook,
TorchJob) it is one of dense, topk, gtopk, artopk, randomk, qsgd, powersgd, fp16, bf16,
sign, hier_topk, hier_gtopk, hier_artopk, auto, or a ``mpicomm.strategies.Strategy``
instance, and the strategy's options follow as keywords:
``GradientSync(model, strategy="gtopk", density=0.05)``.
``help(mpicomm.torch.GradientSync)`` has the table of names and options.

Imported lazily so that ``import mpicomm`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "GradientSync": "mpicomm.torch.gradsync",
    "DistributedOptimizer": "mpicomm.torch.optimizer",
    "broadcast_module": "mpicomm.torch.replicas",
    "LocalSGD": "mpicomm.torch.localsgd",
    "GossipAveraging": "mpicomm.torch.gossip",
    "ddp_comm_hook": "mpicomm.torch.ddp",
    "mpicomm_hook": "mpicomm.torch.ddp",
    "MpicommHookState": "mpicomm.torch.ddp",
    "init_process_group": "mpicomm.torch.ddp",
    "destroy_process_group": "mpicomm.torch.ddp",
    "process_group": "mpicomm.torch.ddp",
    "PSOptimizer": "mpicomm.torch.ps",
    "TorchJob": "mpicomm.torch.crossover",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mpicomm.torch' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    """The public names (``dir(mpicomm.torch)``), though none is imported until used."""
    return list(__all__)
