"""Argument checks and the span describer shared by the dense collective algorithms
(the run context and rank folding they use are :mod:`mpicomm.p2p`)."""

from __future__ import annotations

import inspect
from typing import Any

from ..buffers import REDUCE_OPS, BufferInfo
from ..buffers import inspect as inspect_buffer
from ..hooks import Describe
from ..tags import (  # noqa: F401  (the one tag registry; re-exported for the algorithms)
    TAG_ALLGATHER,
    TAG_ALLREDUCE,
    TAG_BCAST,
    TAG_FOLD,
    TAG_HOST,
    TAG_LANE,
    TAG_REDUCE_SCATTER,
)
from ..validate import check_algorithm, check_int  # noqa: F401  (the one validation kit)
from . import cost


def check_op(op: Any) -> str:
    if not isinstance(op, str) or op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {', '.join(REDUCE_OPS)}, got {op!r}")
    return op


def check_op_dtype(op: str, info: BufferInfo) -> None:
    if op == "avg" and not info.is_float:
        raise TypeError(
            f"op='avg' needs a floating dtype, got {info.dtype} (use op='sum' and divide)"
        )


def check_root(root: Any, size: int) -> int:
    return check_int("root", root, 0, size - 1)


def layout_costs(comm: Any) -> cost.HostCosts | None:
    """The two-link-class model of ``comm``'s hosts when its layout is hierarchical
    (several hosts, one of them with several ranks), else ``None`` (the flat formulas)."""
    if comm is None or not comm.topology.hierarchical:
        return None
    return cost.host_costs(comm)


def choose_auto(collective: str, nbytes: float, comm: Any) -> str:
    """What ``algorithm="auto"`` runs: the cheapest under ``comm``'s calibration and,
    on a hierarchical layout, its two link classes (the hierarchical algorithm
    included)."""
    return cost.choose(collective, nbytes, comm.size, comm.resources.get("cost_params"),
                       layout_costs(comm))


def describe_dense(collective: str) -> Describe:
    """Span args of a dense collective for :func:`mpicomm.hooks.traced`: bytes, the
    algorithm ``auto`` resolves to and the cost model's prediction (``predicted_s``)."""

    def describe(bound: inspect.BoundArguments, comm: Any) -> dict[str, Any]:
        nbytes = inspect_buffer(bound.arguments["buf"]).nbytes
        algorithm = bound.arguments.get(
            "algorithm", bound.signature.parameters["algorithm"].default)
        p = comm.size if comm is not None else 1
        params = comm.resources.get("cost_params") if comm is not None else None
        model_bytes = nbytes * p if collective in ("allgather", "allgatherv") else nbytes
        out: dict[str, Any] = {"bytes": nbytes, "algorithm": algorithm}
        hosts = layout_costs(comm)
        if algorithm == "auto":
            algorithm = out["algorithm"] = cost.choose(collective, model_bytes, p, params,
                                                       hosts)
            out["chosen_by"] = "cost model"
        if p > 1:
            out["predicted_s"] = cost.predict(collective, algorithm, model_bytes, p, params,
                                              hosts)
        return out

    return describe
