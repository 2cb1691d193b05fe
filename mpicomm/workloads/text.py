"""``text-lm``: a word-level LSTM language model on the Python standard library's source.

Corpus: the ``*.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, sorted by relative path, test suites and
``site-packages`` left out; about 12 MB for CPython 3.11), present on every machine
that runs Python, never downloaded. It differs between Python versions, so every result
records the file list, byte count and SHA-256
(``info.data["corpus"]``); compare runs only when the checksums match.

Tokens: identifiers, numbers, single punctuation characters and line breaks
(``[A-Za-z_]\\w*|\\d+|\\n|[^\\s\\w]``); every 20th file (the last one of a
corpus of fewer than 20 files) is held out for validation. The
vocabulary is the ``vocab - 1`` most frequent training tokens plus ``<unk>``. Training
examples are the non-overlapping windows of ``seq_len + 1`` tokens of the training stream
(input: the first ``seq_len``, target: the last ``seq_len``); validation uses the same
windows over at most ``valid_tokens`` held-out tokens. Tokenizing takes a few seconds
once; the token arrays are cached (:mod:`.cache`).

Model: embedding ``vocab x embed`` -> one LSTM layer (``hidden``) -> linear ``hidden x
vocab``; untied. At the defaults (vocab 8 192, embed = hidden = 128) that is 2.24 M
parameters, 94% of them in the embedding and output layers, as in DGC's (Lin et al.,
"Deep Gradient Compression", ICLR 2018, arXiv:1712.01887) PTB language model, and a step
touches at most ``batch * seq_len`` embedding rows: the embedding gradient is sparse
(<= 96 of 8 192 rows at the default batch of 3 sequences).

Cost per token about ``6 * (embed + hidden) * 4 * hidden + 6 * hidden * vocab`` FLOPs
forward and backward (7 MFLOP at the defaults, the output layer dominating): about 0.16 ms
per token on one core, so 15 ms of compute per step at the default batch against 9 MB of
float32 gradient. The recipe (SGD, lr 5, the averaged gradient clipped at norm 0.5, batch 3
per rank, one epoch) takes 3 626 steps at 8 ranks. Metric: validation perplexity
``exp(mean token cross-entropy)``, lower is better.
"""

from __future__ import annotations

import hashlib
import os
import re
import sysconfig
from collections import Counter
from typing import Any

import numpy as np
import torch

from .base import (
    ArrayShard,
    Info,
    Workload,
    WorkloadError,
    count_parameters,
    cross_entropy,
    my_slice,
    step_flops,
    sums_over_ranks,
)
from .cache import cached_arrays

NAME = "text-lm"
OPTIONS = {"vocab": 8192, "embed": 128, "hidden": 128, "seq_len": 32,
           "valid_tokens": 32768, "max_bytes": 0}
DEFAULTS = {"lr": 5.0, "momentum": 0.0, "weight_decay": 0.0, "epochs": 1, "batch": 3,
            "clip_norm": 0.5}
TOKEN = re.compile(r"[A-Za-z_]\w*|\d+|\n|[^\s\w]")
HOLDOUT_EVERY = 20
#: Folders of the standard library left out of the corpus: test suites, third-party
#: packages, caches.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def corpus_files(max_bytes: int = 0) -> tuple[str, list[str]]:
    """The standard library folder and its ``.py`` files (relative paths, sorted; test
    suites and installed packages left out), the first ones whose sizes sum to at most
    ``max_bytes`` when it is > 0."""
    root = sysconfig.get_paths()["stdlib"]
    names = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        rel = os.path.relpath(folder, root)
        names += [os.path.normpath(os.path.join(rel, n)) for n in files if n.endswith(".py")]
    names.sort()
    if max_bytes > 0:
        kept, total = [], 0
        for n in names:
            total += os.path.getsize(os.path.join(root, n))
            if total > max_bytes and kept:
                break
            kept.append(n)
        names = kept
    return root, names


def describe_corpus(max_bytes: int = 0) -> dict[str, Any]:
    """File list, byte count and SHA-256 (over each name and content) of the corpus."""
    root, names = corpus_files(max_bytes)
    digest, total = hashlib.sha256(), 0
    for n in names:
        with open(os.path.join(root, n), "rb") as f:
            raw = f.read()
        digest.update(n.encode() + b"\0" + raw + b"\0")
        total += len(raw)
    return {"root": root, "files": names, "bytes": total, "sha256": digest.hexdigest()}


def tokenize(max_bytes: int, vocab: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Token id arrays ``train`` and ``valid`` (int32) and the corpus description."""
    corpus = describe_corpus(max_bytes)

    def build() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        train_tok: list[str] = []
        valid_tok: list[str] = []
        files = corpus["files"]
        for i, n in enumerate(files):
            with open(os.path.join(corpus["root"], n), encoding="utf-8",
                      errors="replace") as f:
                words = TOKEN.findall(f.read())
            held = i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 or (
                len(files) < HOLDOUT_EVERY and i == len(files) - 1)
            (valid_tok if held else train_tok).extend(words)
        counts = Counter(train_tok)
        kept = sorted(counts, key=lambda w: (-counts[w], w))[:vocab - 1]
        ids = {w: i + 1 for i, w in enumerate(kept)}  # 0: <unk>

        def encode(words: list[str]) -> np.ndarray:
            return np.fromiter((ids.get(w, 0) for w in words), dtype=np.int32,
                               count=len(words))

        arrays = {"train": encode(train_tok), "valid": encode(valid_tok)}
        covered = sum(counts[w] for w in kept) / max(1, len(train_tok))
        return arrays, {"vocab_coverage": covered, "train_tokens": len(train_tok),
                        "valid_tokens": len(valid_tok)}

    arrays, meta = cached_arrays(f"textlm-v1-{corpus['sha256'][:16]}-v{vocab}", build)
    return arrays, {"corpus": corpus, **meta}


def windows(tokens: np.ndarray, seq_len: int, limit: int = 0) -> tuple[torch.Tensor,
                                                                      torch.Tensor]:
    """Non-overlapping (input, target) windows of ``seq_len`` tokens, as int64 tensors."""
    n = (len(tokens) - 1) // seq_len
    if limit:
        n = min(n, max(1, limit // seq_len))
    body = torch.from_numpy(tokens[:n * seq_len + 1].astype(np.int64))
    x = body[:-1].view(n, seq_len)
    y = body[1:].view(n, seq_len)
    return x, y


class LSTMLanguageModel(torch.nn.Module):
    """Embedding -> one LSTM layer -> linear decoder over the vocabulary (untied)."""

    def __init__(self, vocab: int, embed: int, hidden: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, embed)
        self.lstm = torch.nn.LSTM(embed, hidden, batch_first=True)
        self.decoder = torch.nn.Linear(hidden, vocab)
        torch.nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        torch.nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        torch.nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(tokens))
        return self.decoder(out)


def build(*, rank: int, size: int, seed: int, batch: int, vocab: int, embed: int, hidden: int,
          seq_len: int, valid_tokens: int, max_bytes: int) -> Workload:
    for key, value, low in (("vocab", vocab, 2), ("embed", embed, 1), ("hidden", hidden, 1),
                            ("seq_len", seq_len, 1), ("valid_tokens", valid_tokens, 1)):
        if value < low:
            raise WorkloadError(f"workload {NAME!r}: {key} must be >= {low}, got {value}")
    arrays, meta = tokenize(max_bytes, vocab)
    if min(len(arrays["train"]), len(arrays["valid"])) <= seq_len:
        raise WorkloadError(f"workload {NAME!r}: the corpus (max_bytes={max_bytes}) is too "
                            f"small for seq_len {seq_len}")
    x, y = windows(arrays["train"], seq_len)
    vx, vy = windows(arrays["valid"], seq_len, valid_tokens)
    shard = ArrayShard(x, y, rank=rank, size=size, seed=seed, batch=batch, name=NAME)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LSTMLanguageModel(vocab, embed, hidden)

    @torch.no_grad()
    def evaluate(m: torch.nn.Module, comm: Any, split: str) -> dict[str, float]:
        ex, ey = (x, y) if split == "train" else (vx, vy)
        mine = my_slice(len(ey), comm)
        xs, ys = ex[mine], ey[mine]
        nll = 0.0
        was_training = m.training
        m.eval()
        for i in range(0, len(ys), 256):
            out = m(xs[i:i + 256])
            nll += float(torch.nn.functional.cross_entropy(
                out.reshape(-1, out.shape[-1]), ys[i:i + 256].reshape(-1), reduction="sum"))
        m.train(was_training)
        nll, count = sums_over_ranks([nll, ys.numel()], comm)
        loss = nll / count
        return {"loss": loss, "perplexity": float(np.exp(min(loss, 50.0)))}

    params = count_parameters(model)
    in_tables = model.embedding.weight.numel() + sum(p.numel()
                                                     for p in model.decoder.parameters())
    info = Info(NAME, f"stdlib source LM, vocab {vocab}, LSTM {embed}/{hidden}, seq {seq_len}",
                params, in_tables, len(y), len(vy), batch, shard.steps_per_epoch,
                "perplexity", "min", False, step_flops(model, x[:batch]), dict(DEFAULTS), data=meta,
                options={"vocab": vocab, "embed": embed, "hidden": hidden, "seq_len": seq_len,
                         "valid_tokens": valid_tokens, "max_bytes": max_bytes})
    return Workload(NAME, model, shard, cross_entropy, evaluate, info)
