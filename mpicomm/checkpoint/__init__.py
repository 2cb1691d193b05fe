"""Checkpoints that survive a dead rank: save in the background, resume exactly.

Standard MPI cannot keep a job alive after one of its ranks has died (a signal, an
uncaught exception, an out-of-memory kill): ``python -m mpicomm run -n N --restarts K
--checkpoint-dir DIR -- cmd`` (:mod:`mpicomm.supervise`) then ends the whole job and
starts it again, up to ``K`` times, with ``MPICOMM_CHECKPOINT_DIR=DIR`` in every rank's
environment; the training resumes from the newest complete checkpoint in ``DIR``.

:class:`Checkpointer` is the helper a training script uses for that, in both modes:

* **peers** (:class:`~mpicomm.torch.GradientSync`, :class:`~mpicomm.torch.LocalSGD`,
  :class:`~mpicomm.torch.DistributedOptimizer`): every rank saves the model, the
  optimizer, the synchronization state (error-feedback residuals, warm starts, the
  adaptive controllers' state, AdaComm's schedule), its position in the data and its
  random generators;
* **parameter server** (``kv=`` a :class:`~mpicomm.ps.KVStore`): worker 0 saves the
  store through :meth:`KVStore.snapshot <mpicomm.ps.KVStore.snapshot>` (shards,
  optimizer state, per-worker sequence numbers and residuals) and a restart loads it
  with :meth:`KVStore.restore <mpicomm.ps.KVStore.restore>`; every worker saves its
  position and generators. The sequence numbers make every push count exactly once.

Example (peers)::

    comm = mpicomm.init()
    model, opt = build()
    sync = GradientSync(model, strategy="topk", density=0.01, comm=comm)
    ckpt = Checkpointer(comm=comm, every=100, model=model, optimizer=opt, sync=sync)
    resumed = ckpt.restore()
    start = resumed.position["step"] if resumed else 0
    for step in range(start, total):
        opt.zero_grad(); loss_fn(model(x[step]), y[step]).backward(); sync.step(opt)
        ckpt.maybe_save(step + 1, {"step": step + 1})
    ckpt.close()

Guarantees: a checkpoint is a folder per step with one file and one manifest (SHA-256
and size of every file) per writing rank (:mod:`~mpicomm.checkpoint.layout`); files and
then manifests are written atomically (:mod:`mpicomm.durable`), by a background thread
so that training overlaps the disk; a checkpoint cut short by a kill fails its manifest
or checksum and the previous one is used; one of another model or world size is refused
on every rank (:class:`CheckpointError`) before anything is loaded or written.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Checkpointer", "CheckpointError", "Restored", "ENV_CHECKPOINT_DIR", "layout",
           "state"]


def __getattr__(name: str) -> Any:
    # layout is standard-library only (a launcher reads it without importing torch);
    # the Checkpointer and its state capture import torch on first use
    if name in ("Checkpointer", "CheckpointError", "Restored", "ENV_CHECKPOINT_DIR"):
        from . import checkpointer

        return getattr(checkpointer, name)
    if name in ("layout", "state"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
