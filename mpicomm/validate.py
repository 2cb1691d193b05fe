"""The one argument-checking kit: integers and named choices (algorithms, modes).

Every layer checks its arguments with these helpers so that the same mistake raises the
same exception type with the same wording wherever it is made:

* :func:`check_int` -- an ``int`` (``bool`` refused) within bounds. A value that is not an
  integer at all (``2.5``, ``"4"``, ``True``) raises :class:`NotAnIntegerError`, which is
  both a ``TypeError`` (its type is wrong) and a ``ValueError`` (the value is unusable,
  and the project's contract is "bad ``k``, sizes, roles raise ``ValueError``"): callers
  may catch either. An integer out of range raises ``ValueError``.
* :func:`check_choice` / :func:`check_algorithm` -- a string from a fixed set; anything
  else raises ``ValueError`` listing the choices.
* :func:`check_poll_s` -- an optional polling interval in seconds, in ``(0, 1)``.

No MPI here: the pure layers (``mpicomm.compress``) use it too. Collective front-ends run
these checks inside :meth:`mpicomm.Communicator.validating`, which makes a failure on one
rank raise on every rank.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

__all__ = ["NotAnIntegerError", "check_int", "check_choice", "check_algorithm",
           "check_poll_s"]


class NotAnIntegerError(TypeError, ValueError):
    """An integer argument got something else (a float, a string, a bool, None)."""


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an ``int`` in ``[low, high]`` (either bound optional).

    ``NotAnIntegerError`` (a ``TypeError`` and a ``ValueError``) when ``value`` is not an
    integer (``bool`` included: ``True`` is almost always a mistake); ``ValueError`` when
    it is out of range. numpy and torch integer scalars are accepted (recognised by
    ``__index__``) and returned as ``int``.
    """
    if isinstance(value, bool) or not _is_integer(value):
        raise NotAnIntegerError(f"{name} must be an integer, got {value!r} "
                                f"({type(value).__name__})")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        if high is None:
            bound = f">= {low}"
        elif low is None:
            bound = f"<= {high}"
        else:
            bound = f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def _is_integer(value: Any) -> bool:
    """``int``, or an integer scalar that converts exactly (numpy/torch, via ``__index__``)."""
    if isinstance(value, int):
        return True
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_poll_s(name: str, value: Any) -> float | None:
    """``None``, or a polling interval in seconds strictly between 0 and 1 as a float.

    ``TypeError`` for a non-number (``bool`` included), ``ValueError`` out of range.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be None or seconds (a float), got {value!r} "
                        f"({type(value).__name__})")
    if not 0 < value < 1:
        raise ValueError(f"{name} must be None or seconds in (0, 1), got {value!r}")
    return float(value)


def check_choice(what: str, value: Any, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices``; ``ValueError`` naming them otherwise."""
    names = tuple(choices)
    if not isinstance(value, str) or value not in names:
        raise ValueError(f"{what} must be one of {', '.join(names)}; got {value!r}")
    return value


def check_algorithm(collective: str, algorithm: Any, known: Iterable[str], *,
                    auto: bool = True) -> str:
    """An algorithm name for ``collective``: one of ``known`` (or ``"auto"`` when allowed).

    ``ValueError`` "unknown <collective> algorithm ...; choose one of ..." otherwise.
    """
    names = (("auto",) if auto else ()) + tuple(known)
    if not isinstance(algorithm, str) or algorithm not in names:
        raise ValueError(
            f"unknown {collective} algorithm {algorithm!r}; choose one of {', '.join(names)}"
        )
    return algorithm
