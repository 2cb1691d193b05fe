"""Controllers that adapt communication during training (pure: decisions, no MPI).

``AdaComm``   the local-SGD averaging period (Wang & Joshi, SysML 2019)
``Schedule``  density warm-up of compressing strategies (gTop-k, DGC, linear anneal)
"""

from .adacomm import AdaComm
from .schedules import Schedule, dgc_warmup, gtopk_warmup, linear_warmup, parse_schedule

__all__ = ["AdaComm", "Schedule", "gtopk_warmup", "dgc_warmup", "linear_warmup",
           "parse_schedule"]
