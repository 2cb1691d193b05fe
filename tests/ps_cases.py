"""Shared set-up of the parameter-server tests (tests/test_ps*.py): the (servers, workers)
splits a rank count allows, a fixture that splits the test keys over the servers, the
least-squares problem whose gradients the workers push, and the calls that end a store
and give the workers a communicator of their own.

At 2 ranks the split is (1, 1); at 3 ranks (1, 2) and (2, 1); at 4 ranks (1, 3) and
(2, 2); at 5 ranks (1, 4) and (2, 3). At 1 rank a parameter server cannot exist (it needs
a server and a worker), and the tests that ask for the splits skip.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpicomm.ps import KVStore


def splits(size: int) -> list[tuple[int, int]]:
    """The (servers, workers) splits exercised at ``size`` ranks."""
    if size < 2:
        pytest.skip("a parameter server needs >= 2 ranks (one server, one worker)")
    return [(s, size - s) for s in (1, 2) if size - s >= 1]


@pytest.fixture
def split_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split keys of >= 1 KiB over the servers, so that 2 servers share the big key."""
    monkeypatch.setenv("MPICOMM_PS_SPLIT_BYTES", "1024")


def problem(w: int, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Worker ``w``'s least-squares gradient maps ``g(p) = A p - b`` per key."""
    rng = np.random.default_rng([seed, w])
    return {"weight": (rng.standard_normal((320, 320)) / 40, rng.standard_normal(320)),
            "bias": (rng.standard_normal((7, 7)) / 10, rng.standard_normal(7))}


SHAPES = {"weight": (20, 16), "bias": (7,)}  # weight: 2560 bytes in float64 -> split


def grad(prob, key: str, p: np.ndarray) -> np.ndarray:
    a, b = prob[key]
    return (a @ p.reshape(-1) - b).reshape(p.shape)


def init_values(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s) for k, s in SHAPES.items()}


def finish(kv: KVStore) -> dict:
    """Servers serve; workers close. Returns this rank's stats."""
    if kv.is_server:
        kv.serve()
    else:
        kv.close()
    return kv.stats()


def worker_comm(comm, servers: int):
    """A communicator of the worker ranks (for reference allreduces), None on servers."""
    return comm.split(0 if comm.rank < comm.size - servers else None)
