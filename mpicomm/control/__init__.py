"""Controllers that adapt communication during training (pure: decisions, no MPI).

``AdaComm``   the local-SGD averaging period (Wang & Joshi, SysML 2019)
"""

from .adacomm import AdaComm

__all__ = ["AdaComm"]
