"""A plain PyTorch training loop made data-parallel by the lines marked ``# mpicomm``.

They are all that differs from an ordinary single-process script: with them every rank
trains on its own shard of the data and the gradients are averaged during ``backward``::

    mpiexec -n 4 python examples/custom_loop.py

The task comes from :mod:`mpicomm.workloads`: scikit-learn's bundled digits (no download)
and a small MLP, with this rank's shard of every epoch. With ``MPICOMM_METRICS=run.jsonl``
every step's loss, bytes and times and the final test accuracy go to ``run.jsonl``
(``python -m mpicomm plot run.jsonl`` draws them).
``DistributedOptimizer`` is the same thing shaped as an optimizer wrapper::

    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)
    ...; loss.backward(); opt.step()
"""

from __future__ import annotations

import torch

import mpicomm  # mpicomm
from mpicomm import workloads  # mpicomm: the task, this rank's shard of the data
from mpicomm.torch import GradientSync  # mpicomm


def main(epochs: int = 10, batch_size: int = 32) -> float:
    torch.set_num_threads(1)  # several ranks share this machine's cores
    comm = mpicomm.init()  # mpicomm: communicator; an error on any rank ends the job
    task = workloads.get("digits-mlp", rank=comm.rank, size=comm.size, seed=0,  # mpicomm
                         batch=batch_size, hidden=64, layers=1)

    model = task.model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sync = GradientSync(model, comm=comm)  # mpicomm: same start weights, averaged grads

    for epoch in range(epochs):
        for x, y in task.shard.batches(epoch):  # mpicomm: a disjoint shard every epoch
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            sync.step(opt, loss=loss)  # mpicomm: wait for the averaged gradients, opt.step()

    accuracy = task.evaluate(model, comm)["accuracy"]  # mpicomm: each rank scores a part
    if sync.metrics is not None:  # mpicomm: MPICOMM_METRICS set: the accuracy too
        sync.metrics.record("eval", accuracy=accuracy)
    if comm.rank == 0:  # mpicomm: print once
        print(f"test accuracy {accuracy:.4f} on {comm.size} rank(s)")
    sync.close()  # mpicomm
    return accuracy


if __name__ == "__main__":
    main()
