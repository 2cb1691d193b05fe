"""A plain PyTorch training loop made data-parallel by the lines marked ``# mpicomm``.

They are all that differs from an ordinary single-process script: with them every rank
trains on its own shard of the data and the gradients are averaged during ``backward``::

    mpiexec -n 4 python examples/custom_loop.py

The task is scikit-learn's bundled digits (no download) and a small MLP.
``DistributedOptimizer`` is the same thing shaped as an optimizer wrapper::

    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)
    ...; loss.backward(); opt.step()
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits

import mpicomm  # mpicomm
from mpicomm.torch import GradientSync  # mpicomm


def main(epochs: int = 10, batch_size: int = 32) -> float:
    torch.set_num_threads(1)  # several ranks share this machine's cores
    comm = mpicomm.init()  # mpicomm: communicator; an error on any rank ends the job

    x, y = load_digits(return_X_y=True)
    x = torch.tensor((x - x.mean(0)) / (x.std(0) + 1e-8), dtype=torch.float32)
    y = torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = order[:1400], order[1400:]
    train = train[comm.rank::comm.size][:len(train) // comm.size]  # mpicomm: shard (equal)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sync = GradientSync(model, comm=comm)  # mpicomm: same start weights, averaged grads

    for _ in range(epochs):
        for batch in train[torch.randperm(len(train))].split(batch_size):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            sync.step(opt)  # mpicomm: wait for the averaged gradients, then opt.step()

    test = test[comm.rank::comm.size]  # mpicomm: each rank scores its part of the test set
    with torch.no_grad():
        correct = (model(x[test]).argmax(1) == y[test]).sum().item()
    counts = mpicomm.allreduce(np.array([correct, len(test)]), op="sum", comm=comm)  # mpicomm
    accuracy = counts[0] / counts[1]
    if comm.rank == 0:  # mpicomm: print once
        print(f"test accuracy {accuracy:.4f} on {comm.size} rank(s)")
    sync.close()  # mpicomm
    return accuracy


if __name__ == "__main__":
    main()
