"""Controllers that adapt communication during training.

``AdaComm``        the local-SGD averaging period (Wang & Joshi, SysML 2019); pure
``Schedule``       density warm-up of compressing strategies (gTop-k, DGC, linear anneal)
``predict``        the paper's alpha-beta cost of a synchronization scheme (Tyagi & Swany
                   2023, Table I / Eq. 4); pure
``lgreco_solve``   L-GreCo's per-layer choice under an error budget (MLSys 2024); pure
``CRController``   multi-objective compression ratio (Tyagi & Swany 2023, section 3.E); pure
``select``         the collective selector per fused bucket; pure
``calibrate``      ping-pong over several links + compute kernels; ``OnlineCalibration``
``AutoStrategy``   ``strategy="auto"``: all of the above in the training loop
"""

from .adacomm import AdaComm
from .costmodel import predict
from .cr import CRController
from .lgreco import LGreco, lgreco_solve
from .schedules import Schedule, dgc_warmup, gtopk_warmup, linear_warmup, parse_schedule
from .selector import Record, select

__all__ = ["AdaComm", "Schedule", "gtopk_warmup", "dgc_warmup", "linear_warmup",
           "parse_schedule", "predict", "lgreco_solve", "LGreco", "CRController", "select",
           "Record", "calibrate", "OnlineCalibration", "AutoStrategy"]


def __getattr__(name: str):  # noqa: ANN202 - lazy: these import MPI and torch
    if name in ("calibrate", "OnlineCalibration"):
        from . import calibration

        return getattr(calibration, name)
    if name == "AutoStrategy":
        from .auto import AutoStrategy

        return AutoStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names: ``__all__`` and the submodules already imported (not the
    helpers this module imports for itself)."""
    from types import ModuleType

    loaded = (n for n, v in globals().items() if not n.startswith("_")
              and isinstance(v, ModuleType) and v.__name__.startswith(__name__ + "."))
    return sorted({*__all__, *loaded})
