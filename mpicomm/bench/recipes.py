"""Strategy labels of the benchmarks and examples: one name for a strategy and its recipe.

``label_strategy(label, ...)`` builds what a label names:

* ``dense``: ring allreduce (the reference).
* ``topk``, ``gtopk``, ``artopk`` alone: the strategy's default recipe at ``density``
  (``strategies.make(BASE, density=density)``, what a user gets by name).
* ``BASE+MOD[+MOD...]`` / ``BASE-noef`` with BASE ``topk`` (Allgather Top-k), ``gtopk``,
  ``artopk`` (STAR, ring) at ``density``, every option off unless a modifier turns it
  on (the experiments' grammar): modifiers ``ef`` (error feedback, the
  default) / ``noef``, ``mc`` (DGC's momentum correction with momentum factor masking: the
  strategy keeps the velocity, the optimizer runs without momentum), ``mcnomask``,
  ``clip`` (local clipping at ``clip_norm / sqrt(P)``), ``own`` (gTop-k's
  ``own_contribution``), ``exact`` (gTop-k's ``exact_values``), ``log8`` (Top-k's
  and gTop-k's ``coding="log8"``), ``wd``
  (``warmup_dense``), ``layer`` (one fusion buffer per tensor, ``fusion_bytes=1``: each
  layer's own top-k at the density) and at most one
  warm-up schedule: ``gtopkwu``, ``dgc``, ``linear``, ``linear2`` or any
  :func:`mpicomm.control.parse_schedule` form (``linear:8,0.25``, ``dgc:2``,
  ``warmup:0.25,0.0625/3``, ``dgc:10@step``; by epochs unless ``@step``), and at most
  one final phase ``finish:D,S`` (density at least D from step S on,
  :class:`mpicomm.control.FinalPhase`, after the warm-up schedule if any).
* ``SCHEME@RATIO``: one of the auto selector's schemes at a fixed ratio
  (``allgather_topk@0.01``, ``gtopk@0.01``, ``artopk_tree@0.01``, ...).
* any other name of :func:`mpicomm.strategies.available` (``auto``, ``qsgd``,
  ``powersgd``, ...) with its defaults, or with options as ``NAME:KEY=VALUE[,KEY=VALUE]``
  (``powersgd:rank=2``, ``qsgd:bits=4,bucket_size=128``, ``artopk:source=largest``;
  numbers, ``true``/``false`` or a name);
  for ``topk``, ``gtopk`` and ``artopk`` that is the default recipe at ``density`` with
  those options changed (``gtopk:flush_every=100``).

``ValueError`` (naming the grammar) for anything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..control import parse_finish, parse_schedule
from ..strategies import ARTopK, Dense, GTopK, Strategy, TopKAllgather

#: Base strategies a label can start with.
BASES = {"topk": TopKAllgather, "gtopk": GTopK, "artopk": ARTopK}
#: Schedules a label can name (``mpicomm.control.parse_schedule`` forms).
SCHEDULES = {"gtopkwu": "gtopk", "dgc": "dgc", "linear": "linear:5", "linear2": "linear:2"}
#: Label modifiers besides the schedules.
FLAGS = ("ef", "noef", "mc", "mcnomask", "clip", "own", "exact", "largest", "log8", "wd",
         "layer")


@dataclass(frozen=True)
class Recipe:
    """What a label means: a strategy, and whether it owns the momentum (the optimizer
    then runs without)."""

    strategy: Strategy
    owns_momentum: bool


def _owned(strategy: Strategy) -> Recipe:
    """A strategy built with its own defaults: it owns the momentum from the start when
    those set a momentum correction factor (the sparsifiers' default, ``"optimizer"``,
    takes it from the optimizer at the first step instead)."""
    m = getattr(strategy, "momentum_correction", 0.0)
    return Recipe(strategy, isinstance(m, float) and m > 0.0)


def _is_schedule(spec: str, steps_per_epoch: int) -> bool:
    try:
        return parse_schedule(spec, steps_per_epoch) is not None
    except ValueError:
        return False


def _option_value(text: str) -> Any:
    """``true``/``false``, ``none`` (None), an int, a float, or a name (an identifier) as
    a string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.isidentifier():
        return text
    raise ValueError(text)


def named_options(label: str) -> tuple[str, dict[str, Any]] | None:
    """``("powersgd", {"rank": 2})`` for ``"powersgd:rank=2"``; ``None`` for a label
    without options. ``ValueError`` for a malformed option."""
    if "+" in label or ":" not in label:
        return None
    name, _, body = label.partition(":")
    out: dict[str, Any] = {}
    for item in body.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"strategy label {label!r}: expected NAME:KEY=VALUE[,KEY=VALUE]")
        try:
            out[key] = _option_value(value)
        except ValueError:
            raise ValueError(f"strategy label {label!r}: {key}={value!r} is not a number, "
                             "true/false or a name") from None
    return name, out


def label_density(label: str, density: float) -> float | None:
    """The final density a label runs at: ``density`` for the sparsifiers' labels
    (``topk``, ``gtopk``, ``artopk``, their ``+MOD`` forms and their ``BASE:KEY=VALUE``
    forms, whose own ``density`` wins), ``None`` otherwise."""
    named = named_options(label)
    if named is not None:
        if named[0] not in BASES or "k" in named[1]:
            return None
        return float(named[1].get("density", density))
    base = label.replace("-noef", "+noef").split("+")[0]
    return density if base in BASES else None


def label_strategy(label: str, *, density: float = 0.01, momentum: float = 0.9,
                   clip_norm: float = 1.0, steps_per_epoch: int = 1) -> Recipe:
    """The strategy a label names (module docstring)."""
    from .. import strategies

    if label == "dense":
        return Recipe(Dense(algorithm="ring"), False)
    if label in BASES:  # the default recipe
        return _owned(strategies.make(label, density=density))
    named = named_options(label)
    if named is not None and named[0] in strategies.available():
        options = dict(named[1])
        if named[0] in BASES and "k" not in options:
            options.setdefault("density", density)
        try:
            return _owned(strategies.make(named[0], **options))
        except TypeError as exc:
            raise ValueError(f"strategy label {label!r}: {exc}") from None
    if "@" in label and "+" not in label:
        from ..strategies.auto_schemes import build

        scheme, _, ratio = label.partition("@")
        try:
            built = build(scheme, float(ratio))
        except (ValueError, KeyError):
            built = None
        if built is None:
            raise ValueError(f"strategy label {label!r}: no scheme {scheme!r} at ratio "
                             f"{ratio!r}")
        return Recipe(built, False)
    base, *mods = label.replace("-noef", "+noef").split("+")
    if base not in BASES and not mods and base in strategies.available():
        return Recipe(strategies.make(base), False)
    finishes = [m for m in mods if m.startswith("finish:")]
    specs = [SCHEDULES.get(m, m) for m in mods if m not in FLAGS and m not in finishes]
    if base not in BASES or len(specs) > 1 or len(finishes) > 1 or \
            any(not _is_schedule(m, steps_per_epoch) for m in specs):
        raise ValueError(f"unknown strategy label {label!r}: dense, SCHEME@RATIO, a name of "
                         f"mpicomm.strategies.available(), or BASE[+MOD..] with BASE in "
                         f"{sorted(BASES)} and MOD in {sorted([*FLAGS, *SCHEDULES])} or "
                         "one mpicomm.control.parse_schedule form (e.g. linear:8, dgc:2, "
                         "warmup:0.25,0.0625/3), and at most one finish:DENSITY,START_STEP")
    mc = "mc" in mods or "mcnomask" in mods
    kwargs: dict[str, Any] = {
        "density": density,
        "error_feedback": "noef" not in mods,
        "schedule": parse_schedule(specs[0], steps_per_epoch) if specs else None,
        "warmup_dense": "wd" in mods,
        "momentum_correction": momentum if mc else 0.0,
        "momentum_masking": "mcnomask" not in mods,
        "clip_norm": clip_norm if "clip" in mods else None,
    }
    if finishes:
        try:
            kwargs["schedule"] = parse_finish(finishes[0], kwargs["schedule"])
        except ValueError as exc:
            raise ValueError(f"strategy label {label!r}: {exc}") from None
    if "layer" in mods:
        kwargs["fusion_bytes"] = 1
    for only_gtopk in ("own", "exact"):
        if only_gtopk in mods and base != "gtopk":
            raise ValueError(f"{label!r}: the {only_gtopk!r} modifier is for gtopk only")
    if "largest" in mods:
        if base != "artopk":
            raise ValueError(f"{label!r}: the 'largest' modifier is for artopk only")
        kwargs["source"] = "largest"
    if "log8" in mods:
        if base == "artopk":
            raise ValueError(f"{label!r}: the 'log8' modifier is for topk and gtopk only")
        kwargs["coding"] = "log8"
    if base == "gtopk":
        kwargs["own_contribution"] = "own" in mods
        kwargs["exact_values"] = "exact" in mods
    return Recipe(BASES[base](**kwargs), mc)
