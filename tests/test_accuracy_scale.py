"""Accuracy at scale: an 8-rank training child job on real data (digits).

At 8 ranks the digits task gives each rank 10 steps per epoch. AR-Top-k (STAR) with plain
error feedback at density 0.01 then oscillates late in training (with fixed per-rank
shards, seed 2 ended at 85% test accuracy against 97.8% for dense; with the workloads'
per-epoch shards, plain error feedback ends 0.1-3.6 points below momentum correction on
seeds 0-6, and on seed 1, the case checked here, at twice its training loss). The cause:
the updates are residual bursts (the mean update norm is ~5x dense's, ~2x gTop-k's,
because one source rank's top-k drains the global residual poorly) and the optimizer's
momentum keeps pushing every burst for ~1/(1-m) more steps while the residual rebuilds in
the same direction. DGC's momentum correction with momentum factor masking (the velocity
accumulated before sparsification and cleared where sent, the optimizer without
momentum) removes the amplification. This job checks that the corrected strategy beats
plain error feedback on that seed by a clear margin. The full 3-seed, multi-strategy
table is examples/compression_accuracy.py
(docs/compression.md, "Accuracy at many ranks", for the options; BENCHMARKS.md for the numbers).
"""

from __future__ import annotations

import json
import sys

from .launch import load_script, run_job


def test_momentum_correction_fixes_the_artopk_collapse_at_8_ranks(tmp_path):
    out = tmp_path / "acc.json"
    res = run_job(8, [sys.executable, "examples/compression_accuracy.py", "--seeds", "1",
                      "--epochs", "12", "--lr-decay", "0", "--no-dense", "--strategies",
                      "artopk+ef", "artopk+mc", "--json", str(out)], timeout=400)
    assert res.returncode == 0, res.output[-3000:]
    runs = {r["strategy"]: r for r in json.loads(out.read_text())["results"]}
    plain, corrected = runs["artopk+ef"], runs["artopk+mc"]
    assert plain["steps"] == corrected["steps"] == 120  # 12 epochs x 10 steps per rank
    # seed 1: plain EF oscillates (92.67%, training loss 0.160), the corrected run does
    # not (96.22%, 0.069); the margins leave room for other float summation orders
    assert corrected["accuracy"] >= plain["accuracy"] + 2.0, (plain, corrected)
    assert corrected["train_loss"] < plain["train_loss"] / 2, (plain, corrected)
    assert corrected["accuracy"] >= 95.0, corrected
    # same traffic: the fix costs no bytes
    assert corrected["sent_bytes_per_step"] == plain["sent_bytes_per_step"]


def _example():
    return load_script("examples/compression_accuracy.py")


def test_labels_name_any_schedule_and_the_dense_warmup():
    """The recipes of the accuracy-at-scale table are labels: any ``parse_schedule``
    form (by epochs of this run's steps per epoch, or ``@step``) and ``wd``."""
    import pytest

    ex = _example()
    cfg = ex.Config(density=0.001, lr=0.1, lr_decay=9)
    r = ex.recipe("gtopk+ef+own+linear:8+wd", cfg, steps_per_epoch=5)
    s = r.strategy
    assert (type(s).__name__, s.density, s.own_contribution, s.warmup_dense) == \
        ("GTopK", 0.001, True, True)
    assert s.schedule.spec() == "linear:8" and s.schedule.warmup_steps == 40
    assert r.momentum == cfg.momentum
    s = ex.recipe("artopk+warmup:0.25,0.0625/3", cfg, 5).strategy
    assert s.schedule.densities(31, 0.001)[::15] == [0.25, 0.0625, 0.001]
    assert s.warmup_dense is False and s.error_feedback is True
    assert ex.recipe("topk+ef+dgc:10@step", cfg, 5).strategy.schedule.warmup_steps == 40
    assert ex.recipe("topk+linear2", cfg, 5).strategy.schedule.warmup_steps == 10
    for bad in ("artopk+foo", "artopk+dgc+linear", "topk+linear:0", "dense+wd"):
        with pytest.raises(ValueError, match="unknown strategy label"):
            ex.recipe(bad, cfg, 5)
