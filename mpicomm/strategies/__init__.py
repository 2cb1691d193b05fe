"""Gradient aggregation strategies: error feedback + compressor + collective.

Every strategy implements ``aggregate(tensors, names=None) -> tensors`` (see
:class:`~mpicomm.strategies.base.Strategy`). :func:`make` builds one by name, for
command lines and configuration files.
"""

from __future__ import annotations

from typing import Any

from .base import Strategy, StrategyStats
from .dense import Dense

__all__ = ["Strategy", "StrategyStats", "Dense", "make", "available"]

_BY_NAME: dict[str, type[Strategy]] = {
    "dense": Dense,
}


def available() -> tuple[str, ...]:
    """Names accepted by :func:`make`."""
    return tuple(sorted(_BY_NAME))


def make(name: str, **kwargs: Any) -> Strategy:
    """Build the strategy called ``name`` with keyword arguments for its constructor."""
    cls = _BY_NAME.get(name)
    if cls is None:
        raise ValueError(f"unknown strategy {name!r}; available: {', '.join(available())}")
    return cls(**kwargs)
