"""Train a ``torch.nn.Module`` through a parameter server (``mpicomm.ps.KVStore``).

``PSOptimizer`` takes the optimizer's place in a training loop: the update rule runs
on the servers, the worker only pushes its gradients and pulls the new parameters::

    kv = mpicomm.ps.KVStore(servers=1, mode="ssp", staleness=2, lr=0.05, momentum=0.9)
    if kv.is_server:
        kv.serve()                          # until every worker has closed
    else:
        opt = PSOptimizer(model, kv)        # init: every worker starts from worker 0's model
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()                      # push every gradient, pull every parameter
        opt.close()

One parameter = one key (its name in ``named_parameters``). On a store restored from a
checkpoint (``KVStore.restore <mpicomm.ps.KVStore.restore>``, e.g. by
``mpicomm.checkpoint.Checkpointer``) it adopts the restored keys instead of
initialising them, and the first pull loads the saved parameters into the module.

``step`` pushes all gradients first (nonblocking sends) and then pulls all parameters
with every request in flight at once, so the servers work on all keys in parallel; the
pulled values are copied into ``param.data`` in place. A parameter without a gradient
pushes zeros (for plain SGD a no-op; with weight decay or momentum the rule still
applies, as ``torch.optim`` would).
"""

from __future__ import annotations

from typing import Any

import torch

from ..ps import KVStore

__all__ = ["PSOptimizer"]


class PSOptimizer:
    """Optimizer-shaped client of a ``mpicomm.ps.KVStore`` for one module (workers)."""

    def __init__(self, module: torch.nn.Module, kv: KVStore) -> None:
        if not isinstance(kv, KVStore):
            raise TypeError(f"kv must be an mpicomm.ps.KVStore, got {type(kv).__name__}")
        if not kv.is_worker:
            raise ValueError("PSOptimizer runs on workers; servers call kv.serve()")
        self.kv = kv
        self.params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the module has no trainable parameters")
        self._worker = kv._as_worker("init")
        if self._worker.keys:  # restored from a checkpoint (KVStore.restore)
            self._adopt()
        else:
            self._worker.init_many([(n, p.detach()) for n, p in self.params])
        self._infos = [self._worker.info(n) for n, _ in self.params]
        self.steps = 0
        self.pull()

    def _adopt(self) -> None:
        """Use the keys a restored store holds: exactly the module's trainable parameters
        (names, shapes, dtypes), else ``ValueError`` naming the first difference."""
        held = {k: (tuple(i.shape), i.dtype) for k, i in self._worker.keys.items()}
        mine = {n: (tuple(p.shape), p.dtype) for n, p in self.params}
        if held != mine:
            diff = sorted(set(held.items()) ^ set(mine.items()), key=str)[0]
            raise ValueError(f"the restored store holds {len(held)} keys, the module has "
                             f"{len(mine)} trainable parameters; first difference: "
                             f"{diff[0]!r} {diff[1][0]} {diff[1][1]} (another model?)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Push every gradient and pull every parameter (in place), pipelined
        (``mpicomm.ps.KVStore.push_pull``: each chunk's push asks for its pull). The
        pushes read the gradients in place (no copy); the step returns once every send
        is complete."""
        worker = self.kv._as_worker("push")
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach()
                 .reshape(-1).cpu() for _, p in self.params]
        self.steps += 1
        direct = self._direct()
        values = worker.push_pull_many(self._infos, grads, direct)
        self._copy(values, direct)
        worker.flush()

    def _direct(self) -> list[torch.Tensor | None]:
        """The parameters a reply is received into straight (contiguous CPU ones)."""
        return [p.detach().reshape(-1) if p.device.type == "cpu" and p.is_contiguous()
                else None for _, p in self.params]

    def _copy(self, values: list[torch.Tensor], direct: list[torch.Tensor | None]) -> None:
        for (_, p), v, d in zip(self.params, values, direct):
            if d is None:
                p.copy_(v.reshape(p.shape))

    @torch.no_grad()
    def pull(self) -> None:
        """Overwrite the module's parameters with the servers' current values (dense
        values are received straight into CPU parameters)."""
        direct = self._direct()
        self._copy(self.kv._as_worker("pull").pull_many(self._infos, direct), direct)

    def stats(self) -> dict[str, Any]:
        return self.kv.stats()

    def close(self) -> None:
        self.kv.close()
