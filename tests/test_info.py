"""``python -m mpicomm info`` under MPI (mpicomm.jobinfo): placement, links, backends.

Multi-rank: every rank agrees on the placement (nodes partition the ranks, local ranks
count from 0 on each node), the intra-node link is measured whenever two ranks share a
node, the inter-node one exactly when there are several nodes, numpy and torch CPU
buffers are usable, and ``info`` prints the report on rank 0 only.
"""

from __future__ import annotations

import pytest

import mpicomm
from mpicomm import cli
from mpicomm.jobinfo import describe_job, format_job


@pytest.mark.mpi
def test_describe_job(comm: mpicomm.Communicator) -> None:
    job = describe_job(comm)
    root = comm.bcast_object(job)
    assert (job["nodes"], job["local ranks"], job["links"]) == (
        root["nodes"], root["local ranks"], root["links"])  # every rank gets rank 0's view
    assert job["ranks"] == comm.size
    ranks = sorted(r for node in job["nodes"].values() for r in node["ranks"])
    assert ranks == list(range(comm.size))
    for node in job["nodes"].values():
        assert sorted(job["local ranks"][r] for r in node["ranks"]) == list(
            range(len(node["ranks"])))
    intra, inter = job["links"]["intra-node"], job["links"]["inter-node"]
    shares_node = len(job["nodes"][min(job["nodes"])]["ranks"]) > 1
    assert (intra is not None) == shares_node
    if intra is not None:
        assert intra["alpha_s"] >= 0 and intra["beta_s_per_byte"] >= 0
        assert intra["alpha_s"] + intra["beta_s_per_byte"] > 0  # something was measured
    assert (inter is None) == (len(job["nodes"]) == 1)
    assert job["buffer backends"]["numpy"] == "yes"
    assert job["buffer backends"]["torch cpu"] == "yes"
    lines = format_job(job)
    assert lines["ranks"] == str(comm.size) and "backend numpy" in lines


@pytest.mark.mpi
def test_info_command(comm: mpicomm.Communicator, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    if comm.rank != 0:
        assert out == ""
        return
    assert "MPI library" in out and "backend numpy      yes" in out
    assert f"ranks              {comm.size}" in out and "link intra-node" in out
    assert "link inter-node" in out
