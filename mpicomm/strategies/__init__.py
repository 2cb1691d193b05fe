"""Gradient aggregation strategies: error feedback + compressor + collective.

Every strategy implements ``aggregate(tensors, names=None) -> tensors`` (see
:class:`~mpicomm.strategies.base.Strategy`).
"""

from .base import Strategy, StrategyStats
from .dense import Dense

__all__ = ["Strategy", "StrategyStats", "Dense"]
