"""``python -m mpicomm.bench report`` and ``--list``: BENCHMARKS.md and plots from suite
JSON, including suites the report does not know."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mpicomm.bench import __main__ as bench_main
from mpicomm.bench import report

EMU = {"kind": "emulated cluster", "hosts": 8, "ranks_per_host": 1, "rate": "1gbit",
       "delay_s": 1e-4}


def machine(network: dict[str, Any] | None, ranks: int) -> dict[str, Any]:
    m = {"host": "box", "cpus": 2, "mpi": "MPICH Version: 5.0.2", "ranks": ranks,
         "loadavg": [1.5, 1.0, 0.5]}
    if network is not None:
        m["network"] = network
    return m


def sparse(ranks: int, network: dict[str, Any] | None, scale: float) -> dict[str, Any]:
    times = {"dense/ring": 1.0, "dense/rabenseifner": 0.8, "dense/mpi": 0.9,
             "allgather_topk": 0.3, "gtopk": 0.1, "artopk_star": 0.2, "compress": 0.05}
    rows = [{"d": 1000000, "density": 0.01, "k": 10000, "ranks": ranks, "method": m,
             "seconds": t * scale, "time_ms": t * scale * 1e3, "pred_s": t / 2,
             "pred_ms": t * 500, "sent_B": 1, "pred_B": 1, "x_dense": 1.0, "x_ag": 1.0}
            for m, t in times.items()]
    predicted = [{"ranks": 32, "d": 1000000, "density": 0.01, "k": 10000, "dense_ms": 900.0,
                  "ag_ms": 400.0, "gtopk_ms": 60.0, "artopk_ms": 90.0,
                  "gtopk/ag_t": 0.15, "gtopk/dense_t": 60 / 900, "artopk/ag_t": 90 / 400}]
    return {"suite": "sparse", "machine": machine(network, ranks), "ranks": ranks,
            "rows": rows, "predicted": predicted}


def write(folder: Path, name: str, payload: Any) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(payload))


def test_report_tables_plots_and_unknown_suites(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    res = tmp_path / "results"
    write(res, "sparse-4.json", sparse(4, None, 1.0))  # an old result: no network field
    write(res / "cluster", "sparse-1gbit-8.json", sparse(8, EMU, 2.0))
    write(res / "cluster", "sparse-1gbit-4.json", sparse(4, EMU, 1.5))
    write(res, "collectives-2.json", {
        "suite": "collectives", "machine": machine(None, 2), "ranks": 2,
        "rows": [{"collective": "allreduce", "algorithm": a, "elems": n, "bytes": 4 * n,
                  "seconds": 1e-6 * n, "pred_s": 2e-6 * n} for a in ("ring", "mpi")
                 for n in (10, 1000)],
        "summary": [{"collective": "allreduce", "elems": 10, "best": "ring",
                     "time_us": 10.0, "x_mpi": 0.9, "x_gloo": None}]})
    write(res, "localsgd-4.json", {
        "suite": "localsgd", "machine": machine(None, 4), "summary": [{"method": "adacomm"}],
        "curves": [{"method": m, "schedule": "fixed", "seed": 0,
                    "curve": [[0.0, 2.3], [1.0, 0.5 + i]]} for i, m in enumerate("ab")]})
    write(res, "ps-4.json", {"suite": "ps", "machine": machine(EMU, 4),
                             "rows": [{"mode": "ssp", "steps_per_s": 12.5}]})
    write(res / "cluster", "pingpong-1gbit.json", {
        "suite": "pingpong", "machine": machine(EMU, 2), "latency_s": 1.1e-4,
        "bandwidth_bits": 9.5e8, "bytes": 20000000, "configured_delay_s": 1e-4,
        "configured_rate_bits": 1e9, "ranks": 2})
    write(res, "fancy-2.json", {"suite": "fancy", "machine": machine(None, 2),
                                "summary": {"speedup": 1.25, "nested": {"a": 1}},
                                "rows": ["first run", 2.5]})
    write(res / "cluster", "crossover-100mbit-2.json", {
        "suite": "crossover", "machine": machine(EMU, 2), "args": {"jobs": 2, "steps": 60},
        "delay_s": 0.0, "wait_poll_s": 2e-4,
        "rows": [{"repeat": i, "sequential_it_s": 10.0 + i, "colocated_it_s": 12.0,
                  "crossover_it_s": 14.0 + i, "C_ms": 30.0, "S_ms": 28.0} for i in range(3)],
        "summary": {"speedup_vs_sequential": 1.36, "speedup_vs_colocated": 1.17,
                    "colocated_vs_sequential": 1.16, "bound": 1.93, "C_ms": 30.0,
                    "S_ms": 28.0, "hidden_fraction": 0.8, "target_met": True,
                    "identical_to_sequential": True}})
    write(res, "other-2.json", {"suite": "other", "machine": machine(None, 2),
                                "summary": "all good"})
    write(res, "notes.json", {"something": "else"})
    (res / "broken.json").write_text("{")
    out = tmp_path / "BENCHMARKS.md"
    assert report.main(["--results", str(res), "--out", str(out)]) == 0
    text = out.read_text()
    # conditions of every result, network by kind
    assert text.count("| sparse |") == 3 and "| ps |" in text
    assert "emulated cluster" in text and "shared memory" in text and "1gbit" in text
    assert "0.1 ms" in text and "1.5, 1, 0.5" in text
    # the seed-claim table: measured ratios and the model's at 32 ranks
    claim = next(line for line in text.splitlines()
                 if line.startswith("| 1gbit, 0.1 ms | 8 |"))
    cells = [c.strip() for c in claim.strip("|").split("|")]
    assert cells[4:8] == ["8", "3", "1.5", "32"]  # dense/gTop-k = 0.8/0.1, AG/g, AG/AR
    assert float(cells[8]) == pytest.approx(15.0)
    assert float(cells[10]) == pytest.approx(400 / 90, rel=1e-2)
    assert "| 1gbit, 0.1 ms | 20000000 | 1e+03 | 950 | 0.1 | 0.11 |" in text
    # unknown suite: generic table; unreadable and foreign files named, not fatal
    assert "| mode | steps_per_s |" in text and "| ssp | 12.5 |" in text
    assert "| speedup |\n|---|\n| 1.25 |" in text and "* first run\n* 2.5" in text
    assert "all good" in text
    # crossover: the three modes' median throughput next to the bound
    assert ("| sequential it/s | co-located it/s | crossover it/s | co-located x seq | "
            "crossover x seq | crossover x co-located | crossover spinning x seq | "
            "bound (C+S)/max(C,S) |") in text
    assert "| 0.2 | 11 | 12 | 15 | 1.16 | 1.36 | 1.17 |  | 1.93 | 0.8 | True | True |" in text
    assert "notes.json" in text and "broken.json" in text
    plots = tmp_path / "benchmarks"
    for name in ("sparse-scaling.png", "collectives-2.png", "localsgd-4.png"):
        assert (plots / name).stat().st_size > 1000
        assert f"(benchmarks/{name})" in text


def test_report_without_results_fails_clearly(tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    assert report.main(["--results", str(tmp_path), "--out", str(tmp_path / "B.md")]) == 1
    assert "no suite results" in capsys.readouterr().err
    assert not (tmp_path / "B.md").exists()


def test_list_names_importable_suites(capsys: pytest.CaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(bench_main.SUITES, "not-yet", "mpicomm.bench.not_written_yet")
    assert bench_main.main(["--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert {"collectives", "sparse", "localsgd"} <= set(listed)
    assert "not-yet" not in listed


def test_report_renders_accuracy_tables(tmp_path: Path) -> None:
    """``examples/compression_accuracy.py --json`` files: per-label rows with two
    decimals (gaps of a few tenths of a pp decide the accuracy targets)."""
    res = tmp_path / "results"
    summary = [{"strategy": "dense", "accuracies": [97.555, 96.889, 97.111],
                "median": 97.111, "gap_pp": 0.0, "worst_pp": 0.0, "loss": 0.05,
                "kB_per_step": 637.515, "x_dense": 1.0, "steps": 60},
               {"strategy": "artopk+ef+dgc", "accuracies": [96.0, 96.444, 96.889],
                "median": 96.444, "gap_pp": -0.667, "worst_pp": -1.555, "loss": 0.1,
                "kB_per_step": 33.3, "x_dense": 19.14, "steps": 60}]
    write(res, "accuracy-16.json", {
        "suite": "accuracy", "machine": machine(None, 16), "ranks": 16, "seeds": [0, 1, 2],
        "config": {"lr": 0.1, "lr_decay": 9, "density": 0.01, "epochs": 12, "batch": 16},
        "summary": summary, "results": []})
    out = tmp_path / "BENCHMARKS.md"
    assert report.main(["--results", str(res), "--out", str(out),
                        "--plots", str(tmp_path / "p")]) == 0
    text = out.read_text()
    assert "### accuracy: 16 ranks" in text
    assert "density 0.01, 12 epochs, batch 16/rank, lr 0.1 (x0.1 from epoch 9)" in text
    assert ("| artopk+ef+dgc | 96.00 / 96.44 / 96.89 | 96.44 | -0.67 | -1.55 | 33.3 | 19.1x "
            "| 60 |") in text
    assert "| dense | 97.56 / 96.89 / 97.11 | 97.11 | +0.00 | +0.00 | 637.5 | 1x | 60 |" in text


def test_report_refuses_a_run_labelled_by_a_changed_default(tmp_path: Path) -> None:
    """A file whose run is labelled ``artopk`` but ran another recipe (here the class's
    round-robin source, no ramp) is refused, naming the file, the run and what changed;
    the file-wide density stands in for runs that record none."""
    from mpicomm import strategies
    from mpicomm.bench._util import UsageError

    res = tmp_path / "results"
    ran = {**strategies.ARTopK(density=0.01).describe(), "momentum_correction": 0.9}
    run = {"label": "artopk", "workload": "digits-mlp", "ranks": 8, "seed": 0, "steps": 120,
           "config": {"momentum": 0.9}, "extra": {"describe": ran}}
    write(res, "accuracy-8.json", {
        "suite": "accuracy", "machine": machine(None, 8), "ranks": 8, "seeds": [0],
        "config": {"density": 0.01}, "summary": [], "training_runs": [run]})
    with pytest.raises(UsageError, match=r"accuracy-8.json: runs labelled by a default .*"
                                         r"\n  artopk \(digits-mlp, 8 ranks, density 0.01, "
                                         r"seed 0, 120 steps\): momentum_correction ran 0.9"):
        report.load([str(res)])
    now = strategies.make("artopk", density=0.01).describe()
    write(res, "accuracy-8.json", {
        "suite": "accuracy", "machine": machine(None, 8), "ranks": 8, "seeds": [0],
        "config": {"density": 0.01}, "summary": [],
        "training_runs": [{**run, "extra": {"describe": now}}]})
    assert len(report.load([str(res)])[0]) == 1


def test_report_renders_the_adaptive_suite_with_its_targets(tmp_path: Path) -> None:
    res = tmp_path / "results"
    net = dict(EMU, schedule="/somewhere/benchmarks/schedule-adaptive.txt")
    rows = [{"method": m, "time_to_target_s": t, "final_acc": a, "step_ms": 100.0,
             "sent_kB_step": 10.0, "x_dense": 30.0 / t, "choices": c}
            for m, t, a, c in (("dense", 30.0, 0.98, ""), ("gtopk@0.01", 10.0, 0.97, ""),
                               ("auto", 12.0, 0.965, "artopk_ring@0.01:40"))]
    lgreco = [{"method": "topk uniform", "seed": 0, "time_to_target_s": 20.0,
               "sent_kB_step": 300.0, "final_acc": 0.96},
              {"method": "topk lgreco", "seed": 0, "time_to_target_s": 17.0,
               "sent_kB_step": 150.0, "final_acc": 0.96, "dp_size_vs_uniform": 0.5,
               "dp_error_vs_budget": 1.0}]
    summary = {"auto_vs_best_static": 1.2, "best_static": "gtopk@0.01",
               "auto_speedup_vs_dense": 2.5, "auto_acc_loss_points": 1.5,
               "lgreco_bytes_ratio": 2.0, "lgreco_bytes_ratio_qsgd": None}
    write(res, "adaptive-emulated-4.json", {
        "suite": "adaptive", "machine": machine(net, 4), "ranks": 4,
        "options": {"hidden": 1024, "epochs": 12, "batch": 32, "target": 0.96,
                    "link": "emulated", "seeds": 3, "eval_every": 1}, "rows": rows,
        "lgreco": lgreco, "summary": summary})
    out = tmp_path / "BENCHMARKS.md"
    assert report.main(["--results", str(res), "--out", str(out)]) == 0
    text = out.read_text()
    assert "### adaptive: 4 ranks, 1gbit, 0.1 ms" in text
    assert "schedule `schedule-adaptive.txt`; medians of 3 runs (batch orders), accuracy " \
        "checked every 1 step(s)" in text
    assert "| auto | 12 | 0.965 | 100 | 10 | 2.5 | artopk_ring@0.01:40 |" in text
    assert "| topk lgreco | 0 | 17 | 150 | 0.96 | 0.5 | 1 |" in text
    lines = text.splitlines()
    verdict = {c[0]: c[-1] for c in ([x.strip() for x in line.strip("|").split("|")]
                                     for line in lines if line.startswith("| auto_")
                                     or line.startswith("| lgreco_"))}
    assert verdict == {"auto_vs_best_static": "MISSED", "auto_speedup_vs_dense": "met",
                       "auto_acc_loss_points": "MISSED", "lgreco_bytes_ratio": "met",
                       "lgreco_bytes_ratio_qsgd": ""}


def test_report_renders_auto_on_a_changing_virtual_network(tmp_path: Path) -> None:
    """A virtual-clock ``adaptive`` result: the changing-network bound of the target,
    the overhead and ratio-move verdicts, the table of moves and the choices' plot."""
    pytest.importorskip("matplotlib")
    res = tmp_path / "results"
    line = [[s, "dense" if s < 3 else "gtopk", 1.0 if s < 3 else 0.02,
             10.0 if s < 3 else 0.1, 0.05 if s < 3 else 5.0] for s in range(6)]
    rows = [{"method": "gtopk@0.01", "time_to_target_s": 10.0, "final_acc": 0.97},
            {"method": "auto", "time_to_target_s": 9.0, "final_acc": 0.97,
             "timeline": line, "runs": [{"seed": 0, "timeline": line}]}]
    moves = [{"step": 3, "from_gbit": 10.0, "to_gbit": 0.1, "to_delay_ms": 5.0,
              "scheme_before": "dense", "ratio_before": 1.0, "scheme_after": "gtopk",
              "ratio_after": 0.02, "factor": 50.0}]
    summary = {"auto_vs_best_static": 0.9, "auto_overhead_pct": 0.5,
               "auto_vs_best_static_target": 0.85, "ratio_moves": moves,
               "ratio_move_factor_min": 50.0}
    write(res, "adaptive-flips-4.json", {
        "suite": "adaptive", "machine": machine(None, 4), "ranks": 4,
        "clock": {"mode": "virtual", "platform": {"rate_bits": 1e10, "delay_s": 5e-5,
                                                  "hosts": 4, "host_sizes": [1] * 4}},
        "options": {"workload": "mnist1d-cnn", "option": [], "epochs": 7, "batch": 32,
                    "target": 0.95, "link": "virtual", "rate": "10gbit", "delay": "50us",
                    "virtual_schedule": "/x/flips.txt", "seeds": 1},
        "rows": rows, "lgreco": [], "summary": summary})
    out = tmp_path / "BENCHMARKS.md"
    assert report.main(["--results", str(res), "--out", str(out)]) == 0
    text = out.read_text()
    assert "`mnist1d-cnn` , 7 epochs" in text and "schedule `flips.txt`" in text
    verdict = {c[0]: (c[-2], c[-1]) for c in (
        [x.strip() for x in ln.strip("|").split("|")] for ln in text.splitlines()
        if ln.startswith(("| auto_", "| ratio_"))) if len(c) == 4}
    assert verdict["auto_vs_best_static"] == (
        "auto's time-to-accuracy <= 0.85x the best static (strategy, ratio)", "MISSED")
    assert verdict["auto_overhead_pct"][1] == "met"
    assert verdict["ratio_move_factor_min"][1] == "met"
    assert "| 3 | 10 | 0.1 | 5 | dense | 1 | gtopk | 0.02 | 50 |" in text
    png = tmp_path / "benchmarks" / "virtual-adaptive-flips-4-choices.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and f"({png.name})" in text.replace(
        "benchmarks/", "")


def _training_run(label: str, ranks: int, step_ms: float, corpus: bool = False
                  ) -> dict[str, Any]:
    data = {"corpus": {"root": "/lib", "files": ["a.py", "b.py"], "bytes": 123,
                       "sha256": "ab" * 32}} if corpus else {}
    curve = [{"step": s, "epoch": 0, "time_s": 0.1 * s, "bytes": 1000 * s,
              "loss": 5.0 / s, "perplexity": 100.0 / s} for s in (1, 2, 4)]
    return {"label": label, "workload": "text-lm", "seed": 0, "ranks": ranks,
            "metric": "perplexity", "direction": "min", "info": {"data": data},
            "config": {}, "curve": curve, "step_s": [step_ms / 1e3] * 4,
            "step_bytes": [1000] * 4, "decisions": [], "history": [], "steps": 4,
            "epochs": 1, "seconds": 0.4, "sent_bytes": 4000, "sent_bytes_max_rank": 4000,
            "time_to_target_s": 0.2, "steps_to_target": 2, "extra": {}}


def test_report_draws_training_curves_and_step_times(tmp_path: Path) -> None:
    """Results with ``training_runs`` (the harness's records): a table, the corpus
    checksum, a plot of the metric against time and bytes; ``train`` results also give
    the time-per-step table by rank count."""
    pytest.importorskip("matplotlib")
    res = tmp_path / "results"
    virtual = {"mode": "virtual", "platform": {"rate_bits": 1e9, "delay_s": 1e-4, "hosts": 4,
                                                  "host_sizes": [1] * 4}}
    for name, ranks, ms, clock in (("1", 1, 10.0, {"mode": "wall"}), ("4", 4, 30.0, virtual),
                                   ("4-wall", 4, 99.0, {"mode": "wall"})):
        write(res, f"train-{name}.json", {
            "suite": "train", "machine": machine(None, ranks), "ranks": ranks,
            "clock": clock, "summary": [{"method": "dense"}],
            "training_runs": [_training_run("dense", ranks, ms, corpus=True),
                              _training_run("gtopk", ranks, 2 * ms)]})
    out = tmp_path / "B.md"
    assert report.main(["--results", str(res), "--out", str(out)]) == 0
    text = out.read_text()
    assert "## Time per step of the workloads" in text
    # the 4-rank wall-clock run on 2 cores measures the scheduler: left out of the table
    assert "| workload | method | 1 ranks ms (wall) | 4 ranks ms (virtual) |" in text
    assert "| text-lm | dense | 10 | 30 |" in text and "| text-lm | gtopk | 20 | 60 |" in text
    # ... and its own table says that its times are not the method's (once: that file)
    assert text.count("4 ranks on 2 cores, load average") == 1
    assert "measure the machine's scheduler, not the method" in text
    assert f"SHA-256 `{'ab' * 32}`" in text
    for ranks in (1, 4):
        assert (tmp_path / "benchmarks" / f"train-train-{ranks}.png").read_bytes()[:4] == \
            b"\x89PNG"
        assert f"(benchmarks/train-train-{ranks}.png)" in text


def test_localsgd_targets_against_every_fixed_period_and_adacomm_periods_plotted(tmp_path):
    """bench localsgd's targets: AdaComm >= 2x sooner than sync, and its final loss at most
    the best fixed period's or sooner than every fixed period; the report shows them and
    draws AdaComm's period over time."""
    from mpicomm.bench.localsgd import targets
    from mpicomm.bench.report_control import has_adacomm

    def row(method, speed, loss):
        return {"schedule": "fixed", "method": method, "median_speedup": speed,
                "median_final_loss": loss}

    summary = [row("sync", 1.0, 0.5), row("tau=4", 2.5, 0.1), row("tau=16", 4.0, 0.2),
               row("adacomm", 3.0, 0.09), row("adacomm-drift", 4.5, 0.3)]
    paper, drift = targets(summary, ["fixed"], ["adacomm", "adacomm-drift"])
    assert paper["speedup_target_met"] and paper["final_loss_target_met"]
    assert not paper["sooner_than_every_fixed"] and paper["fixed_target_met"]
    assert paper["best_fixed_final_loss"] == 0.1 and paper["best_fixed_speedup"] == 4.0
    assert drift["sooner_than_every_fixed"] and not drift["final_loss_target_met"]
    assert drift["fixed_target_met"]
    slow = targets([row("sync", 1.0, 0.5), row("tau=4", 2.5, 0.1), row("adacomm", 1.5, 0.2)],
                   ["fixed"], ["adacomm"])[0]
    assert not slow["speedup_target_met"] and not slow["fixed_target_met"]
    alone = targets([row("sync", 1.0, 0.5), row("adacomm", 2.5, 0.2)], ["fixed"], ["adacomm"])[0]
    assert alone["speedup_target_met"]
    assert {alone[k] for k in ("best_fixed_final_loss", "best_fixed_speedup",
                               "final_loss_target_met", "sooner_than_every_fixed",
                               "fixed_target_met")} == {None}

    decisions = [{"round": 0, "elapsed": 0.0, "loss": 2.3, "lr": 0.05, "raw": 32.0,
                  "tau": 32, "noise": None},
                 {"round": 9, "elapsed": 1.0, "loss": 1.0, "lr": 0.05, "raw": 20.1,
                  "tau": 21, "noise": 3.5}]
    curves = [{"method": m, "schedule": "fixed", "seed": 0, "curve": [[0.0, 2.3], [2.0, 0.4]],
               "adacomm": decisions if m.startswith("adacomm") else []}
              for m in ("sync", "adacomm")]
    assert has_adacomm(curves) and not has_adacomm(curves[:1])
    res = tmp_path / "results"
    res.mkdir()
    (res / "localsgd-2.json").write_text(json.dumps({
        "suite": "localsgd", "machine": machine(None, 2), "curves": curves,
        "summary": summary, "targets": [paper, drift],
        "model_clock": "model clock: Y 1 ms, D 3.57 ms (0.1 Gbit/s, 1000 us)"}))
    out = tmp_path / "BENCHMARKS.md"
    assert report.main(["--results", str(res), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| fixed | adacomm-drift | 4.5 | True |" in text   # the targets table
    assert "model clock: Y 1 ms" in text
    if (tmp_path / "benchmarks").exists():   # matplotlib installed: two rows of panels
        assert (tmp_path / "benchmarks" / "localsgd-2.png").stat().st_size > 0


def test_report_seed_claims_from_virtual_runs_beside_model_and_wall(tmp_path: Path) -> None:
    from mpicomm.bench import report_virtual

    res = tmp_path / "results"
    virtual = sparse(8, None, 1.0)
    virtual["clock"] = {"mode": "virtual", "platform": {
        "rate_bits": 1e9, "delay_s": 1e-4, "hosts": 8, "host_sizes": [1] * 8}}
    virtual["rows"] = [dict(r, seconds=r["seconds"] * (2.0 if r["method"] == "gtopk" else 1))
                       for r in virtual["rows"]]
    write(res / "virtual", "sparse-1gbit-8.json", virtual)
    write(res / "cluster", "sparse-1gbit-8.json", sparse(8, EMU, 2.0))
    results, _ = report.load([str(res)])
    [entry] = report_virtual.seed_claims(results, report.net)
    assert (entry["rate"], entry["ranks"], entry["delay_s"]) == ("1gbit", 8, 1e-4)
    # dense = the best own dense (rabenseifner 0.8; MPI's own is not mpicomm's)
    assert entry["virtual"]["dense/gTop-k"] == pytest.approx(0.8 / 0.2)
    assert entry["virtual"]["AG/gTop-k"] == pytest.approx(0.3 / 0.2)
    assert entry["virtual"]["AG/AR-Top-k"] == pytest.approx(0.3 / 0.2)
    assert entry["model"]["dense/gTop-k"] == pytest.approx(0.8 / 0.1)  # pred_s = t / 2
    assert entry["wall"]["AG/gTop-k"] == pytest.approx(0.3 / 0.1)
    out = tmp_path / "B.md"
    assert report.main(["--results", str(res), "--out", str(out), "--plots",
                        str(tmp_path / "plots")]) == 0
    text = out.read_text()
    claims = text.split("## Seed claims")[1].split("### The same claims on the wall clock")
    assert ("| 1gbit, 0.1 ms | 8 | 1000000 | 0.01 | 4 | 8 | 8 | 1.5 | 3 | 3 | 1.5 | 1.5 | 1.5 |"
            in claims[0])
    assert "(virtual)" in text and "(virtual)" not in claims[1].split("\n## ")[0]


def test_bench_localsgd_reports_tau_1_from_the_sync_run():
    from mpicomm.bench.localsgd import Run, sync_as

    runs = [Run("sync", "fixed", 0, [(0.0, 2.0), (1.0, 0.5)], steps=10),
            Run("sync", "decay", 0, [(0.0, 2.0), (1.0, 0.4)], steps=10),
            Run("tau=4", "fixed", 0, [(0.0, 2.0), (0.5, 0.6)], steps=30)]
    tau1 = sync_as(runs, "tau=1", "decay", 0)
    assert tau1.method == "tau=1" and tau1.curve == runs[1].curve and tau1.steps == 10
    assert runs[1].method == "sync"                     # the sync run itself is kept
    with pytest.raises(ValueError, match="no sync run"):
        sync_as(runs, "tau=1", "fixed", 1)


def test_table_cuts_at_the_limit_and_the_ratios_section_lists_every_row(tmp_path: Path):
    rows = [{"a": i} for i in range(5)]
    assert "(2 more rows in the JSON)" in report.table(rows, limit=3)
    assert "more rows" not in report.table(rows, limit=None)
    assert report.table(rows, limit=None).count("\n| ") == 5  # the rows after the header

    from mpicomm.bench import report_ratios

    def run(label: str, seed: int, density: float | None, acc: float, sent: int):
        return {"workload": "w", "ranks": 8, "seed": seed, "steps": 10, "label": label,
                "metric": "accuracy", "direction": "max", "density": density,
                "curve": [{"accuracy": acc}], "sent_bytes_total": sent}

    def no_pyplot() -> Any:  # tables only, no plots
        raise ImportError("matplotlib")

    runs = [run("dense", 0, None, 0.9, 1000)]
    runs += [run(f"topk+ef+r{i}", 0, 0.01, 0.9, 10) for i in range(70)]
    text, _ = report_ratios.section([{"suite": "ratios", "training_runs": runs}],
                                    str(tmp_path), "img", report.table, no_pyplot)
    assert all(f"| topk+ef+r{i} |" in text for i in range(70)) and "more rows" not in text


def test_load_note_speaks_for_each_machine_and_the_conditions_list_every_file():
    quiet = {"suite": "s", "ranks": 2, "machine": dict(machine(None, 2), loadavg=[1.2, 1, 1]),
             "_path": "quiet.json"}
    lent = {"suite": "s", "ranks": 8, "_path": "lent.json",
            "machine": {"host": "big", "cpus": 16, "ranks": 8, "loadavg": [9.0, 5, 2]}}
    busy = dict(quiet, ranks=8, machine=dict(machine(None, 8), loadavg=[30.0, 20, 10]),
                _path="busy.json")
    note = report.load_note([quiet, lent, busy])
    assert "box, 2 CPU core(s): 2 result file(s), up to 8 ranks per run" in note
    assert "1-minute load average up to 30 (**oversubscribed**)" in note
    assert "big, 16 CPU core(s): 1 result file(s), up to 8 ranks per run, 1-minute load " \
           "average up to 9." in note  # 8 ranks and load 9 on 16 cores: not oversubscribed
    assert "they waited for CPU time" in note
    assert "oversubscribed" not in report.load_note([quiet, lent])
    many = [dict(quiet, _path=f"r{i}.json") for i in range(70)]
    listed = report.conditions(many)
    assert "more rows" not in listed
    assert all(f"| r{i}.json |" in listed for i in range(70))


def test_tradeoff_plot_numbers_every_point_in_its_legend(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Two strategies at the same place stay apart: each point gets a number and the
    legend names it with its ratio and gap; a gap far below the bound switches the y axis
    to linear-near-zero, logarithmic beyond."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mpicomm.bench import report_ratios

    def row(strategy: str, ratio: float, gap: float) -> dict[str, Any]:
        return {"workload": "text-lm", "ranks": 8, "strategy": strategy, "density": 0.001,
                "steps": 100, "bytes_vs_dense": ratio, "metric_gap": gap}

    legends: list[list[str]] = []
    scales: list[str] = []
    real_save = report_ratios._save

    def keep(fig: Any, plt_: Any, folder: str, name: str, fit: bool = False) -> str:
        ax = fig.axes[0]
        legends.append([t.get_text() for t in ax.get_legend().get_texts()])
        scales.append(ax.get_yscale())
        return real_save(fig, plt_, folder, name, fit)

    rows = [row("gtopk", 89.8, -3.0), row("artopk", 89.8, -3.0), row("dense", float("nan"), 0)]
    monkeypatch.setattr(report_ratios, "_save", keep)
    names = report_ratios.plot_tradeoff(rows, str(tmp_path), plt)
    names += report_ratios.plot_tradeoff([dict(r, ranks=16) for r in rows[:1]]
                                         + [row("x", 600.0, -40.0) | {"ranks": 16}],
                                         str(tmp_path), plt)
    assert names == ["ratios-tradeoff-text-lm-8.png", "ratios-tradeoff-text-lm-16.png"]
    assert all((tmp_path / n).stat().st_size > 0 for n in names)
    assert legends[0] == ["1: artopk@0.001 (89.8x, -3.00)", "2: gtopk@0.001 (89.8x, -3.00)"]
    assert scales == ["linear", "symlog"]
