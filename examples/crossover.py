"""Two training jobs time-share the same ranks under the Crossover scheduler.

Job ``wide`` (synchronous SGD, dense gradient averaging) and job ``narrow`` (local SGD,
parameters averaged every 4 steps) train on scikit-learn's bundled digits (the
``digits-mlp`` workload's data); while one of them averages, the other computes. Each job
computes exactly what it would compute
alone. The script prints both jobs' test accuracy and how much of their synchronization
was hidden, and writes a Chrome trace (one row per job per rank; open it in
ui.perfetto.dev)::

    mpiexec -n 4 python examples/crossover.py --trace crossover-trace.json
"""

from __future__ import annotations

import argparse

import torch

import mpicomm
from mpicomm import workloads
from mpicomm.sched import CrossoverScheduler
from mpicomm.torch import TorchJob
from mpicomm.workloads.digits import mlp


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--trace", default=None, help="write the merged Chrome trace here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    comm = mpicomm.init()

    task = workloads.get("digits-mlp", rank=comm.rank, size=comm.size, batch=args.batch)
    x, y = task.shard.inputs, task.shard.targets
    train = task.shard.indices(0)  # this rank's examples

    def job(name: str, hidden: int, seed: int, **how) -> TorchJob:
        model = mlp([64, hidden, 10], seed)
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

    accuracy = {j.name: task.evaluate(j.model, comm)["accuracy"] for j in jobs}
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
