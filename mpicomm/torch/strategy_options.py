"""A strategy given by name with its options as keywords, checked before any communication.

``GradientSync``, ``DistributedOptimizer`` and the DDP hook all take ``strategy`` as a
``mpicomm.strategies.Strategy`` instance, a name for ``mpicomm.strategies.make`` or
``None`` (dense allreduce), and the strategy's options as further keywords::

    GradientSync(model, strategy="gtopk", density=0.05, bucket_mb=4)

The wrapper keeps the keywords it knows (``bucket_mb`` here) and hands the rest to the
strategy's constructor. A keyword that neither knows raises one ``TypeError`` naming the
options of both (and the closest match), before the wrapper communicates: with the same
arguments every rank raises the same error. Options go only with a name or ``None``; an
instance is already configured.
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .. import strategies
from ..strategies import Strategy, available, make

__all__ = ["build_strategy", "keyword_names", "strategy_class", "strategy_option_names"]

# Constructor arguments of a strategy that a wrapper sets itself (it binds its own comm).
_SET_BY_WRAPPER = frozenset({"comm"})


def keyword_names(func: Callable[..., Any], exclude: Iterable[str] = ()) -> tuple[str, ...]:
    """Names ``func`` accepts as keywords, in signature order, without ``self``,
    ``*args``/``**kwargs`` and ``exclude``."""
    skip = {"self", *exclude}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in inspect.signature(func).parameters.values()
                 if p.kind in kinds and p.name not in skip)


def strategy_class(name: str) -> type[Strategy] | None:
    """The class that ``mpicomm.strategies`` exports under strategy name ``name``, or
    ``None`` when it exports none (``make`` may still know the name)."""
    for attr in getattr(strategies, "__all__", ()):
        obj = getattr(strategies, attr, None)
        if isinstance(obj, type) and issubclass(obj, Strategy) and \
                getattr(obj, "name", None) == name:
            return obj
    return None


def strategy_option_names(name: str) -> tuple[str, ...] | None:
    """The options strategy ``name`` takes as keywords (its constructor's, less ``comm``),
    or ``None`` when they cannot be listed beforehand (no exported class, or a
    constructor that takes ``**kwargs``)."""
    return _constructor_options(strategy_class(name))


def _constructor_options(cls: type | None) -> tuple[str, ...] | None:
    if cls is None:
        return None
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return keyword_names(cls.__init__, _SET_BY_WRAPPER)


def _unknown_options(owner: str, owner_options: Iterable[str], strategy: str | None,
                     unknown: Iterable[str], known: Iterable[str] | None) -> TypeError:
    """The one error for keywords that neither the wrapper nor the strategy takes."""
    unknown = sorted(unknown)
    mine = tuple(owner_options)
    theirs = tuple(known) if known is not None else ()
    words = ", ".join(repr(k) for k in unknown)
    plural = "s" if len(unknown) > 1 else ""
    message = f"{owner} got unknown option{plural} {words}: {owner} takes {', '.join(mine)}"
    if strategy is None:
        message += ("; strategy options go only with a strategy name, not with a "
                    "Strategy instance (configure the instance instead)")
    elif known is not None:
        message += f"; strategy {strategy!r} takes {', '.join(theirs) or 'no options'}"
    else:
        message += f"; strategy {strategy!r} does not take {'them' if plural else 'it'}"
    hints = []
    for k in unknown:
        close = difflib.get_close_matches(k, (*mine, *theirs), n=1)
        if close:
            hints.append(f"{close[0]!r}" + (f" for {k!r}" if len(unknown) > 1 else ""))
    if hints:
        message += f" (did you mean {', '.join(hints)}?)"
    return TypeError(message)


def build_strategy(strategy: Strategy | str | None, options: Mapping[str, Any], *,
                   owner: str, owner_options: Iterable[str]) -> Strategy:
    """The strategy that ``strategy`` and ``options`` describe, for wrapper ``owner``.

    ``strategy``: a ``Strategy`` instance (returned as it is; ``options`` must then be
    empty), a name from ``mpicomm.strategies.available()`` or ``None`` for ``"dense"``.
    ``options`` are the keywords the wrapper did not take; ``owner_options`` the ones it
    takes, listed in the error. Raises ``TypeError`` for a wrong ``strategy`` type or an
    unknown option, ``ValueError`` for an unknown name or a bad option value (from the
    strategy's constructor). Local: no communication.
    """
    owner_options = tuple(owner_options)
    if isinstance(strategy, Strategy):
        if options:
            raise _unknown_options(owner, owner_options, None, options, None)
        return strategy
    if strategy is None:
        strategy = "dense"
    elif not isinstance(strategy, str):
        raise TypeError("strategy must be an mpicomm Strategy, a strategy name or None, "
                        f"got {type(strategy).__name__}")
    if strategy not in available():
        raise ValueError(f"unknown strategy {strategy!r}; available: "
                         f"{', '.join(available())}")
    known = strategy_option_names(strategy)
    if known is not None:
        unknown = [k for k in options if k not in known]
        if unknown:
            raise _unknown_options(owner, owner_options, strategy, unknown, known)
    try:
        return make(strategy, **options)
    except TypeError as exc:  # a constructor whose options could not be listed beforehand
        found = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
        if found is None or found.group(1) not in options:
            raise
        try:  # name the options it does take: its class, from a default-built instance
            known = _constructor_options(type(make(strategy)))
        except Exception:  # noqa: BLE001 - only the message loses the list
            known = None
        unknown = [found.group(1)] if known is None else [k for k in options
                                                          if k not in known]
        raise _unknown_options(owner, owner_options, strategy, unknown, known) from None
