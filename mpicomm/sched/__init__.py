"""Scheduling several training jobs on the same ranks.

``CrossoverScheduler``   time-shares the ranks between n >= 2 data-parallel jobs so that
                         one job's synchronization runs while another computes
``Job``                  the interface: compute phase + sync phase per iteration
``FunctionJob``          a job given as a pair of callables
``Token``                the per-rank right to compute, cycling over the jobs

A model + optimizer + data job is :class:`mpicomm.torch.TorchJob` (it lives with the
PyTorch integration, which sits above this layer).
"""

from .crossover import CrossoverError, CrossoverScheduler, CrossoverStats, JobStats
from .job import FunctionJob, Job
from .token import Token

__all__ = ["CrossoverScheduler", "CrossoverError", "CrossoverStats", "JobStats", "Job",
           "FunctionJob", "Token"]
