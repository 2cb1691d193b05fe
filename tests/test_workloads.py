"""``mpicomm.workloads``: the registry, its errors, determinism, shards, the data cache,
the model sizes the workloads promise, and the ``workloads`` listing.

Serial and fast: small slices of the generated data sets (``train_examples=400`` of
MNIST-1D, the first 200 kB of the standard library for the language model), each cached
in the test's own cache folder.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from mpicomm import workloads
from mpicomm.workloads import MissingPackageError, WorkloadError, cache, mnist1d, text
from mpicomm.workloads.synthetic import vgg_like

SMALL_TEXT = {"max_bytes": 200_000, "vocab": 512, "valid_tokens": 2048}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(workloads.ENV_CACHE_DIR, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_bad_requests_raise_one_clear_error():
    with pytest.raises(WorkloadError, match="unknown workload 'mnist'; available: digits-mlp"):
        workloads.get("mnist", rank=0, size=1)
    with pytest.raises(WorkloadError, match="no option widht; its options: hidden=128"):
        workloads.get("digits-mlp", rank=0, size=1, widht=3)
    with pytest.raises(WorkloadError, match="option hidden must be int, got 2.5"):
        workloads.get("digits-mlp", rank=0, size=1, hidden=2.5)
    # 1437 training images over 8 ranks: 179 per shard
    with pytest.raises(WorkloadError, match=r"batch 200 is larger than a rank's shard "
                       r"\(1437 examples / 8 ranks = 179\)"):
        workloads.get("digits-mlp", rank=0, size=8, batch=200)
    with pytest.raises(WorkloadError, match="2000 ranks but only 1437 training examples"):
        workloads.get("digits-mlp", rank=0, size=2000, batch=1)
    with pytest.raises(WorkloadError, match="rank must be in"):
        workloads.get("digits-mlp", rank=4, size=4)
    assert issubclass(WorkloadError, ValueError)


def test_same_seed_same_model_and_batches_other_seed_differs(cache_dir):
    a = workloads.get("mnist1d-cnn", rank=1, size=3, seed=5, train_examples=400)
    b = workloads.get("mnist1d-cnn", rank=1, size=3, seed=5, train_examples=400)
    c = workloads.get("mnist1d-cnn", rank=1, size=3, seed=6, train_examples=400)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    assert not torch.equal(next(a.model.parameters()), next(c.model.parameters()))
    xa, ya = next(a.shard.batches(2))
    xb, yb = next(b.shard.batches(2))
    xc, _ = next(c.shard.batches(2))
    assert torch.equal(xa, xb) and torch.equal(ya, yb) and not torch.equal(xa, xc)
    # building a workload leaves the global generators alone
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    workloads.get("digits-mlp", rank=0, size=1, seed=3)
    assert torch.equal(torch.rand(1), before)


def test_shards_are_disjoint_and_reshuffled_every_epoch():
    size = 3
    ws = [workloads.get("digits-mlp", rank=r, size=size, seed=0, batch=16) for r in range(size)]
    for epoch in (0, 1):
        idx = [w.shard.indices(epoch).tolist() for w in ws]
        flat = [i for part in idx for i in part]
        assert len(flat) == len(set(flat)) == size * (1437 // size)
    assert ws[0].shard.indices(0).tolist() != ws[0].shard.indices(1).tolist()
    steps = list(ws[0].shard.batches(0))
    assert len(steps) == ws[0].info.steps_per_epoch == (1437 // size) // 16
    assert all(x.shape == (16, 64) for x, _ in steps)


def test_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(workloads.ENV_CACHE_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == str(tmp_path / "xdg" / "mpicomm")
    monkeypatch.setenv(workloads.ENV_CACHE_DIR, str(tmp_path / "own"))
    assert cache.cache_dir() == str(tmp_path / "own")
    built = []

    def build():
        built.append(1)
        return {"a": np.arange(3)}, {"made": "here"}

    for _ in range(2):
        arrays, meta = cache.cached_arrays("thing-v1", build)
        assert arrays["a"].tolist() == [0, 1, 2] and meta == {"made": "here"}
    assert built == [1]  # the second call read the file
    assert (tmp_path / "own" / "thing-v1.npz").exists()


def test_mnist1d_is_generated_by_the_package_and_cached(cache_dir):
    w = workloads.get("mnist1d-cnn", rank=0, size=2, seed=0, batch=32, train_examples=400)
    assert w.info.train_examples == 400 and w.info.eval_examples == 100
    assert w.info.data["generator"] == "mnist1d.data.make_dataset"
    assert w.info.data["args"]["seed"] == mnist1d.DATA_SEED
    assert len(list(cache_dir.glob("mnist1d-*.npz"))) == 1
    x, y = next(w.shard.batches(0))
    assert x.shape == (32, 40) and w.model(x).shape == (32, 10)
    ev = w.evaluate(w.model, None)
    assert set(ev) == {"loss", "accuracy"} and 0.0 <= ev["accuracy"] <= 1.0
    # the paper's CNN at 25 channels, and the default width
    assert sum(p.numel() for p in mnist1d.ConvNet1d(25).parameters()) == 5210
    assert w.info.parameters == sum(p.numel() for p in mnist1d.ConvNet1d(128).parameters())


def test_missing_package_is_one_clear_message(cache_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "mnist1d", None)  # import mnist1d now fails
    monkeypatch.delitem(sys.modules, "mnist1d.data", raising=False)
    with pytest.raises(MissingPackageError, match=r"workload 'mnist1d-cnn' needs the package "
                       r"'mnist1d'.*pip install mnist1d"):
        workloads.get("mnist1d-cnn", rank=0, size=1, train_examples=200)


def test_text_lm_records_its_corpus_and_puts_its_weights_in_the_tables(cache_dir):
    w = workloads.get("text-lm", rank=0, size=2, seed=0, batch=4, **SMALL_TEXT)
    corpus = w.info.data["corpus"]
    assert corpus["files"] and corpus["bytes"] <= 200_000
    assert len(corpus["sha256"]) == 64 and corpus == text.describe_corpus(200_000)
    x, y = next(w.shard.batches(0))
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 512
    ev = w.evaluate(w.model, None)
    assert ev["perplexity"] == pytest.approx(np.exp(ev["loss"]))
    # 6 x (LSTM + decoder multiply-adds) per token, 4 x 32 tokens a step
    per_token = 4 * 128 * (128 + 128) + 128 * 512
    assert w.info.flops_per_step == 6 * 4 * 32 * per_token
    assert 100 < ev["perplexity"] < 2000  # untrained: about the vocabulary size
    assert w.info.metric == "perplexity" and w.info.direction == "min"
    # the defaults: >= 2 M parameters, most in the embedding and output layers
    model = text.LSTMLanguageModel(8192, 128, 128)
    total = sum(p.numel() for p in model.parameters())
    tables = model.embedding.weight.numel() + sum(p.numel()
                                                  for p in model.decoder.parameters())
    assert total >= 2_000_000 and tables / total > 0.9


def test_large_synthetic_cnn_has_ten_million_parameters():
    assert sum(p.numel() for p in vgg_like(1.0, 32).parameters()) >= 10_000_000
    w = workloads.get("cnn-large-synthetic", rank=1, size=2, batch=2, width=0.125,
                      steps_per_epoch=3)
    batches = list(w.shard.batches(0))
    assert len(batches) == 3 and batches[0][0].shape == (2, 3, 32, 32)
    assert w.info.timing_only and set(w.evaluate(w.model, None)) == {"loss"}


def test_listing_prints_sizes(capsys):
    from mpicomm.bench.__main__ import main

    assert main(["workloads", "--workload", "digits-mlp", "--ranks", "4"]) == 0
    out = capsys.readouterr().out
    assert "digits-mlp" in out and "26122" in out and "steps/epoch@4" in out
    with pytest.raises(SystemExit):
        main(["workloads", "--workload", "nope"])
