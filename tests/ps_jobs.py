"""Child jobs for tests/test_ps_compression_checkpoints.py: ``python tests/ps_jobs.py
SCENARIO`` under mpiexec.

``worker-raises``   worker 1 raises in the middle of training (servers and the other
                    workers are waiting on it): the job must end, naming rank 1.
``worker-dies``     worker 1 exits abruptly (``os._exit``): the job must end.
``server-raises``   a worker sends a push that skips a sequence number (a lost update);
                    the server holding the key stops the job, naming its rank.
``train``           examples/train_ps.py several times in one job (one start-up): SSP,
                    async with a 3x straggler, top-k / PowerSGD compressed push, QSGD
                    compressed pull, dense sync; JSON summaries go to the folder given
                    as the second argument.

Before a fault, the job prints ``FAULT AT <unix time>`` so the test can measure how long
the job took to end after it.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import mpicomm
from mpicomm.ps import KVStore, wire


def fault(scenario: str) -> None:
    comm = mpicomm.init()
    kv = KVStore(comm, servers=1, mode="sync")
    if kv.is_server:
        kv.serve()
        return
    kv.init("x", np.zeros(16))
    for step in range(1000):
        if step == 3 and kv.worker_rank == min(1, kv.workers - 1):
            print(f"FAULT AT {time.time()}", flush=True)
            if scenario == "worker-raises":
                raise RuntimeError("worker failed on purpose")
            if scenario == "worker-dies":
                os._exit(7)  # no traceback, no MPI_Abort: the launcher must notice
            worker = kv._worker
            info = worker.info("x")
            buf = wire.pack(wire.PUSH, info.key_id, 0, worker.seq[info.key_id] + 2,
                            kv.worker_rank, 0, arrays=[torch.zeros(16, dtype=torch.float64)])
            worker.mpi.Send([buf, MPI.BYTE], worker.server_rank(0), wire.TAG_REQUEST)
        kv.push("x", np.ones(16))
        kv.pull("x")
    kv.close()


def train(folder: str) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "examples"))
    import train_ps

    common = ["--no-progress", "--threads", "1", "--servers", "1"]
    runs = {"ssp": ["--mode", "ssp", "--staleness", "2", "--epochs", "1"],
            "async-straggler": ["--mode", "async", "--slow-worker", "0", "--epochs", "3"],
            "topk": ["--epochs", "2", "--compressor", "topk", "--density", "0.01"],
            "dense": ["--epochs", "2"],
            "powersgd": ["--epochs", "2", "--compressor", "powersgd", "--rank", "4"],
            "pull": ["--epochs", "2", "--pull-compressor", "qsgd"]}
    for name, extra in runs.items():
        train_ps.main([*common, *extra, "--json", os.path.join(folder, f"{name}.json")])


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2])
    else:
        fault(sys.argv[1])
