"""mpicomm.torch's public surface: strategy options as keywords, one error for an unknown
option, ``dir()`` of the lazy packages, help text without raw markup.

Multi-rank (``-m mpi``, any size): a strategy named with its options averages exactly like
the configured instance, through ``GradientSync`` and ``DistributedOptimizer``; an unknown
option raises the same message on every rank before any communication and leaves the
communicator usable. Serial: the messages, every strategy name with the options that
``GradientSync``'s docstring lists, ``TorchJob``, ``dir()``, docstrings.
"""

from __future__ import annotations

import ast
import inspect
import pydoc
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from mpi4py import MPI

import mpicomm
import mpicomm.checkpoint
import mpicomm.control
import mpicomm.torch
from mpicomm.comm import Communicator
from mpicomm.strategies import Dense, GTopK, available, make
from mpicomm.torch import DistributedOptimizer, GradientSync, TorchJob, ddp_comm_hook
from mpicomm.torch.strategy_options import build_strategy, strategy_option_names

if MPI.COMM_WORLD.Get_size() > 1:
    torch.set_num_threads(1)  # several ranks share few cores

TINY = 0.0002  # MB: a bucket per parameter or two
TORCH_DIR = Path(mpicomm.torch.__file__).parent
ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj|ref|py:\w+):`")

# A value for every option that GradientSync's strategy table lists, chosen so that the
# strategy's describe() differs from the default one.
OPTION_VALUES: dict[str, Any] = {
    "algorithm": "rabenseifner", "density": 0.1, "k": 4, "source": "var", "seed": 3,
    "bits": 4, "bucket_size": 64, "rank": 2, "start_iter": 1, "ratios": (0.05, 0.2),
    "schemes": ("dense", "gtopk"), "sliced": True,
}


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(),
                               torch.nn.Linear(10, 3)).double()


def train(model: torch.nn.Module, rank: int, make_sync, steps: int = 3) -> torch.Tensor:
    """``steps`` SGD steps on this rank's own batches; the flat parameters after."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(50 + rank)
    with make_sync(model, opt) as sync:
        for _ in range(steps):
            x = torch.randn(4, 6, generator=gen, dtype=torch.float64)
            y = torch.randn(4, 3, generator=gen, dtype=torch.float64)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if isinstance(sync, GradientSync):
                sync.step(opt)
            else:
                sync.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def table_rows() -> dict[str, list[str]]:
    """GradientSync's strategy table: name -> the options of its last column."""
    doc = inspect.getdoc(GradientSync) or ""
    rows: dict[str, list[str]] = {}
    names = set(available())
    for line in doc.splitlines():
        words = line.split()
        if not words or words[0] not in names or "  " not in line.strip():
            continue
        last = re.split(r"\s{2,}", line.strip())[-1]
        rows[words[0]] = [] if last.startswith("(") else re.split(r",\s*|\s+or\s+", last)
    return rows


# ---------------------------------------------------------------------- multi-rank
@pytest.mark.mpi
@pytest.mark.parametrize("name, options", [("gtopk", {"density": 0.25}),
                                           ("qsgd", {"bits": 4, "seed": 7}),
                                           ("powersgd", {"rank": 1})])
def test_a_named_strategy_with_options_averages_like_the_instance(comm, name, options):
    def by_name(model, opt):
        return GradientSync(model, strategy=name, bucket_mb=TINY, comm=comm, **options)

    def by_instance(model, opt):
        return GradientSync(model, make(name, **options), bucket_mb=TINY, comm=comm)

    def wrapped(model, opt):
        return DistributedOptimizer(opt, model, strategy=name, bucket_mb=TINY, comm=comm,
                                    **options)

    reference = train(mlp(1), comm.rank, by_instance)
    for build in (by_name, wrapped):
        got = train(mlp(1), comm.rank, build)
        assert torch.equal(got, reference), build.__name__
    everyone = comm.allgather_object(reference.numpy())
    assert all((other == everyone[0]).all() for other in everyone)


@pytest.mark.mpi
def test_options_reach_the_strategy_and_the_wrapper(comm):
    model = mlp(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with DistributedOptimizer(opt, model, strategy="topk", density=0.3, bucket_mb=TINY,
                              comm=comm, on_nonfinite="skip") as dopt:
        assert isinstance(dopt.sync.strategy, type(make("topk")))
        assert dopt.sync.strategy.density == 0.3
        assert dopt.sync.bucket_mb == TINY and dopt.sync.on_nonfinite == "skip"
    with GradientSync(model, comm=comm, algorithm="ring") as sync:  # None: dense's options
        assert isinstance(sync.strategy, Dense) and sync.strategy.algorithm == "ring"


@pytest.mark.mpi
def test_an_unknown_option_fails_alike_on_every_rank_before_communicating(comm, monkeypatch):
    calls: list[str] = []
    for method in ("allgather_object", "bcast_object", "allreduce_value", "dup", "barrier"):
        original = getattr(Communicator, method)

        def spy(self, *args, _original=original, _method=method, **kwargs):
            calls.append(_method)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Communicator, method, spy)
    model = mlp(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    attempts = {
        "GradientSync": lambda: GradientSync(model, strategy="gtopk", comm=comm,
                                             dencity=0.05),
        "DistributedOptimizer": lambda: DistributedOptimizer(opt, model, "gtopk",
                                                             comm=comm, dencity=0.05),
        "ddp_comm_hook": lambda: ddp_comm_hook("gtopk", comm, dencity=0.05),
        "TorchJob": lambda: TorchJob("job", model, opt, [], lambda o, t: o.sum(),
                                     strategy="gtopk", dencity=0.05),
    }
    messages = []
    for owner, attempt in attempts.items():
        with pytest.raises(TypeError, match="unknown option 'dencity'") as info:
            attempt()
        assert str(info.value).startswith(owner), info.value
        messages.append(str(info.value))
    assert calls == []  # nothing was sent or duplicated before the error
    monkeypatch.undo()
    assert comm.allgather_object(messages) == [messages] * comm.size
    # every rank is still in step: a collective construction right after works
    with GradientSync(model, strategy="gtopk", density=0.5, comm=comm) as sync:
        assert sync.strategy.density == 0.5


# ---------------------------------------------------------------------- serial
def test_gradient_sync_takes_the_options_its_docstring_lists():
    rows = table_rows()
    assert sorted(rows) == sorted(available()), "the table lists every strategy name"
    model = mlp(0)
    for name, options in rows.items():
        for option in options:
            value = OPTION_VALUES[option]
            with GradientSync(model, strategy=name, **{option: value}) as sync:
                expected = make(name, **{option: value})
                assert type(sync.strategy) is type(expected), (name, option)
                assert sync.strategy.describe() == expected.describe(), (name, option)
                assert sync.strategy.describe() != make(name).describe(), (name, option)


def test_unknown_option_messages_name_both_sides_and_the_closest_match():
    model = mlp(0)
    with pytest.raises(TypeError) as info:
        GradientSync(model, strategy="gtopk", dencity=0.05)
    message = str(info.value)
    assert message.startswith("GradientSync got unknown option 'dencity'")
    assert "GradientSync takes bucket_mb, comm, broadcast, on_nonfinite, timeline, " \
           "metrics" in message
    assert "strategy 'gtopk' takes density, k, error_feedback" in message
    assert message.endswith("(did you mean 'density'?)")
    assert "\n" not in message
    with pytest.raises(TypeError, match=r"unknown option 'bucket_md'.*strategy 'dense' "
                                        r"takes algorithm.*did you mean 'bucket_mb'"):
        GradientSync(model, bucket_md=4)
    with pytest.raises(TypeError, match=r"unknown options 'bogus', 'windw'.*strategy "
                                        r"'auto' takes .*window.*'window' for 'windw'"):
        GradientSync(model, strategy="auto", windw=3, bogus=1)
    with pytest.raises(TypeError, match="unknown option 'algorithm'.*only with a strategy "
                                        "name, not with a Strategy instance"):
        GradientSync(model, strategy=GTopK(density=0.1), algorithm="ring")
    with pytest.raises(TypeError, match="^DistributedOptimizer got unknown option 'densty'"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1), model, "topk",
                             densty=0.1)
    with pytest.raises(TypeError, match="^ddp_comm_hook got unknown option 'densty'.*"
                                        "ddp_comm_hook takes comm, overlap"):
        ddp_comm_hook("gtopk", densty=0.1)
    # the checks that were there stay as they were
    with pytest.raises(TypeError, match="strategy must be"):
        GradientSync(model, strategy=object())
    with pytest.raises(ValueError, match="unknown strategy"):
        GradientSync(model, strategy="no-such-strategy", density=0.1)
    with pytest.raises(ValueError, match="density"):  # a bad value: the strategy's own check
        GradientSync(model, strategy="gtopk", density=3.0)


def test_strategy_options_are_checked_before_the_communicator_is_touched():
    class Untouchable:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the communicator was used ({name}) before the check")

    model = mlp(0)
    with pytest.raises(TypeError, match="unknown option 'densty'"):
        GradientSync(model, strategy="gtopk", comm=Untouchable(), densty=0.1)
    with pytest.raises(ValueError, match="density"):
        GradientSync(model, strategy="gtopk", comm=Untouchable(), density=-1.0)


def test_every_strategy_name_lists_its_options():
    for name in available():
        options = strategy_option_names(name)
        if options is None:  # not exported by class: the error path lists them instead
            continue
        assert "fusion_bytes" in options and "comm" not in options, name
    assert build_strategy(None, {}, owner="x", owner_options=()).name == "dense"
    dense = Dense()
    assert build_strategy(dense, {}, owner="x", owner_options=()) is dense


def test_torch_job_takes_strategy_options():
    def loss_fn(out, target):
        return torch.nn.functional.mse_loss(out, target)

    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 6, generator=gen, dtype=torch.float64),
             torch.randn(4, 3, generator=gen, dtype=torch.float64)) for _ in range(3)]
    jobs = []
    for name, strategy, options in (("named", "topk", {"density": 0.5}),
                                    ("instance", make("topk", density=0.5), {})):
        model = mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        jobs.append(TorchJob(name, model, opt, data, loss_fn, strategy=strategy, **options))
    assert jobs[0].describe()[-1] == ("strategy", "topk", (("density", 0.5),))
    from mpicomm.sched import CrossoverScheduler

    with CrossoverScheduler(jobs) as sched:
        sched.run()
    assert jobs[0].sync_object.strategy.density == 0.5
    assert len(jobs[0].losses) == 3 and jobs[0].losses == jobs[1].losses
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="^TorchJob 'j' got unknown option 'densty'"):
        TorchJob("j", model, opt, data, loss_fn, strategy="topk", densty=0.5)
    with pytest.raises(TypeError, match="go with strategy"):
        TorchJob("j", model, opt, data, loss_fn, local_sgd=2, density=0.5)


def test_dir_of_lazy_packages_lists_public_names():
    assert dir(mpicomm.torch) == sorted(mpicomm.torch.__all__)
    for name in dir(mpicomm.torch):
        assert getattr(mpicomm.torch, name) is not None
    top = dir(mpicomm)
    assert {"init", "Communicator", "allreduce", "torch", "strategies", "sparse",
            "compress"} <= set(top)
    control = dir(mpicomm.control)
    assert {"predict", "lgreco_solve", "OnlineCalibration", "AdaComm"} <= set(control)
    checkpoint = dir(mpicomm.checkpoint)
    assert {"Checkpointer", "CheckpointError"} <= set(checkpoint)
    for package, listing in ((mpicomm, top), (mpicomm.control, control),
                             (mpicomm.torch, dir(mpicomm.torch)),
                             (mpicomm.checkpoint, checkpoint)):
        assert not {"Any", "annotations", "importlib"} & set(listing), package.__name__
        assert all(hasattr(package, n) for n in listing), package.__name__


def _docstrings(path: Path) -> list[tuple[str, str]]:
    tree = ast.parse(path.read_text())
    found = [(path.name, ast.get_docstring(tree, clean=False) or "")]
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((f"{path.name}:{node.name}", ast.get_docstring(node, clean=False)
                          or ""))
    return found


def test_help_text_shows_no_raw_markup():
    for path in sorted(TORCH_DIR.glob("*.py")):
        for where, doc in _docstrings(path):
            assert not ROLE.search(doc), f"{where}: {ROLE.search(doc).group(0)}"
    for name in ("mpicomm.torch", *mpicomm.torch.__all__):
        obj = mpicomm.torch if name == "mpicomm.torch" else getattr(mpicomm.torch, name)
        text = pydoc.render_doc(obj, renderer=pydoc.plaintext)  # what help() prints
        assert not ROLE.search(text), name


def test_docstrings_that_take_a_strategy_list_its_names():
    from mpicomm.torch.ddp import MpicommHookState

    for obj in (GradientSync, DistributedOptimizer, MpicommHookState, TorchJob,
                ddp_comm_hook, mpicomm.torch):
        doc = inspect.getdoc(obj) or ""
        section = doc[doc.index("strategy"):]
        missing = [n for n in available() if not re.search(rf"\b{n}\b", section)]
        assert not missing, f"{obj.__name__}'s docstring omits {missing}"
