"""Controllers that adapt communication during training: measurements in, decisions out.

Pure: no communication, no torch, no strategies. The strategies that run them
(:class:`mpicomm.strategies.AutoStrategy`, :class:`mpicomm.torch.LocalSGD`) measure,
agree across ranks and carry the decisions out.

``AdaComm``            the local-SGD averaging period (Wang & Joshi, SysML 2019);
                       ``initial_period`` its start from the step and round times
``Schedule``           density warm-up of compressing strategies (gTop-k, DGC, linear anneal)
``predict``            the paper's alpha-beta cost of a synchronization scheme (Tyagi &
                       Swany 2023, Table I / Eq. 4; :func:`mpicomm.collectives.cost.
                       paper_predict`)
``lgreco_solve``       L-GreCo's per-layer choice under an error budget (MLSys 2024);
                       ``LGreco`` the controller around it
``CRController``       multi-objective compression ratio (Tyagi & Swany 2023, section 3.E)
``OnlineCalibration``  the cost model refined from measured step times, drift detection
"""

from ..collectives.cost import paper_predict as predict
from .adacomm import AdaComm, initial_period
from .cost_refit import OnlineCalibration
from .cr import CRController
from .lgreco import LGreco, lgreco_solve
from .schedules import (
    BudgetRamp,
    FinalPhase,
    Schedule,
    dgc_warmup,
    exp_warmup,
    gtopk_warmup,
    linear_warmup,
    parse_finish,
    parse_schedule,
)

__all__ = ["AdaComm", "initial_period", "Schedule", "BudgetRamp", "FinalPhase",
           "gtopk_warmup", "dgc_warmup", "linear_warmup", "exp_warmup", "parse_schedule",
           "parse_finish", "predict", "lgreco_solve", "LGreco", "CRController",
           "OnlineCalibration"]


def __dir__() -> list[str]:
    """The public names: ``__all__`` and the submodules already imported (not the
    helpers this module imports for itself)."""
    from types import ModuleType

    loaded = (n for n, v in globals().items() if not n.startswith("_")
              and isinstance(v, ModuleType) and v.__name__.startswith(__name__ + "."))
    return sorted({*__all__, *loaded})
