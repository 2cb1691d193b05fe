"""Two training jobs time-share the same ranks under the Crossover scheduler.

Job ``wide`` (synchronous SGD, dense gradient averaging) and job ``narrow`` (local SGD,
parameters averaged every 4 steps) train on scikit-learn's bundled digits; while one of
them averages, the other computes. Each job computes exactly what it would compute
alone. The script prints both jobs' test accuracy and how much of their synchronization
was hidden, and writes a Chrome trace (one row per job per rank; open it in
ui.perfetto.dev)::

    mpiexec -n 4 python examples/crossover.py --trace crossover-trace.json
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from sklearn.datasets import load_digits

import mpicomm
from mpicomm.sched import CrossoverScheduler
from mpicomm.torch import TorchJob


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--trace", default=None, help="write the merged Chrome trace here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    comm = mpicomm.init()

    x, y = load_digits(return_X_y=True)
    x = torch.tensor((x - x.mean(0)) / (x.std(0) + 1e-8), dtype=torch.float32)
    y = torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = order[:1400][comm.rank::comm.size], order[1400:][comm.rank::comm.size]

    def job(name: str, hidden: int, seed: int, **how) -> TorchJob:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(hidden, 10))
        g = torch.Generator().manual_seed(100 * seed + comm.rank)
        data = [(x[b], y[b]) for b in
                (train[torch.randint(len(train), (args.batch,), generator=g)]
                 for _ in range(args.steps))]
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return TorchJob(name, model, opt, data, torch.nn.functional.cross_entropy, **how)

    jobs = [job("wide", 256, 1, strategy="dense"), job("narrow", 32, 2, local_sgd=4)]
    with CrossoverScheduler(jobs, comm=comm, timeline=args.trace is not None) as sched:
        stats = sched.run()
        jobs[1].sync_object.average()  # local SGD: leave every rank with the same model
        events = sched.timeline.gather(comm) if args.trace else None

    accuracy = {}
    for j in jobs:
        with torch.no_grad():
            correct = (j.model(x[test]).argmax(1) == y[test]).sum().item()
        counts = mpicomm.allreduce(np.array([correct, len(test)]), op="sum", comm=comm)
        accuracy[j.name] = counts[0] / counts[1]
    if comm.rank == 0:
        for j in jobs:
            s = stats.jobs[j.name]
            print(f"job {j.name}: {s.steps} steps, test accuracy {accuracy[j.name]:.4f}, "
                  f"compute {s.compute_seconds:.2f} s, sync {s.sync_seconds:.2f} s, "
                  f"{s.hidden_fraction:.0%} of it hidden")
        print(f"both jobs in {stats.seconds:.2f} s on {comm.size} rank(s)")
        if args.trace:
            print(f"trace: {sched.timeline.save(args.trace, events)}")
    return accuracy


if __name__ == "__main__":
    main()
