"""The examples' optimizer options (examples/train.py, examples/train_ps.py): ``--epochs``,
``--batch-size``, ``--lr``, ``--momentum`` and ``--weight-decay``, each the workload's
recipe (:func:`mpicomm.workloads.defaults`, what the benchmarks train it with) where not
given, checked before MPI starts.
"""

from __future__ import annotations

import argparse
import math

from mpicomm import workloads

#: The options that default to the workload's recipe (:func:`mpicomm.workloads.defaults`)
#: and that recipe's key for each.
RECIPE_OPTIONS = {"epochs": "epochs", "batch_size": "batch", "lr": "lr",
                  "momentum": "momentum", "weight_decay": "weight_decay"}
#: Those of them that are counts (integers, at least 1); the others are floats.
COUNT_OPTIONS = ("epochs", "batch_size")


def add_recipe_arguments(ap: argparse.ArgumentParser) -> None:
    """``--epochs``, ``--batch-size``, ``--lr``, ``--momentum``, ``--weight-decay``, each
    the workload's recipe where not given."""
    digits = workloads.defaults("digits-mlp")
    helps = {"epochs": "passes over the training set", "batch_size": "minibatch size per rank",
             "lr": "SGD learning rate", "momentum": "SGD momentum",
             "weight_decay": "SGD weight decay"}
    for opt, key in RECIPE_OPTIONS.items():
        ap.add_argument(f"--{opt.replace('_', '-')}", default=None,
                        type=int if opt in COUNT_OPTIONS else float,
                        help=f"{helps[opt]} (default: the workload's; digits-mlp: "
                             f"{digits[key]:g})")


def fill_recipe(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The recipe options left out take ``--workload``'s values (the optimizer settings
    the benchmarks train it with: ``text-lm`` at lr 5 without momentum, ``mnist1d-cnn``
    for 13 epochs), then all are checked before MPI starts; an unknown workload is one
    error line."""
    try:
        recipe = workloads.defaults(args.workload)
    except ValueError as exc:
        ap.error(str(exc))
    for opt, key in RECIPE_OPTIONS.items():
        if getattr(args, opt) is None:
            value = recipe[key]
            setattr(args, opt, int(value) if opt in COUNT_OPTIONS else value)
    for name in COUNT_OPTIONS:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    check_optimizer_arguments(ap, args)


def check_optimizer_arguments(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--lr`` > 0, ``0 <= --momentum < 1``, ``--weight-decay`` >= 0 (finite), checked
    before MPI starts."""
    if not (math.isfinite(args.lr) and args.lr > 0):
        ap.error(f"--lr must be a positive number, got {args.lr}")
    if not 0.0 <= args.momentum < 1.0:
        ap.error(f"--momentum must be in [0, 1), got {args.momentum}")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        ap.error(f"--weight-decay must be >= 0, got {args.weight_decay}")
