"""A worker's metrics as TensorBoard scalars, `decentral report` on run folders, `pipeline train`'s progress."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import write_recipe

from decentral.cli import main
from decentral.metrics import TENSORBOARD_MISSING, MetricsError, MetricsLog, TensorBoardSink, read_metrics

STEPS = 12  # records at steps 0..12; val_loss at 0, 10 (eval_every) and 12 (the final record)


@pytest.fixture(scope="module")
def train_run(tmp_path_factory, small_corpus):
    """A real `decentral train --protocol local` run with --tensorboard: (its OUT, its TensorBoard folder)."""
    root = tmp_path_factory.mktemp("run")
    recipe = write_recipe(root / "local.yaml", {"name": "local"}, steps=STEPS)
    out, board = root / "out", root / "board"
    assert main(["train", "--protocol", str(recipe), "--out", str(out), "--data", str(small_corpus),
                 "--name", "solo", "--tensorboard", str(board)]) == 0
    return out, board


def test_tensorboard_scalars_are_the_jsonl_records(train_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, board = train_run
    records = read_metrics(out / "metrics.jsonl")
    events = EventAccumulator(str(board))
    events.Reload()
    numeric = {key for r in records for key, value in r.items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)} - {"step"}
    assert {"loss", "val_loss", "wall_s", "bytes_sent", "wait_s", "round"} <= numeric
    assert set(events.Tags()["scalars"]) == numeric  # strings (worker) and bools (final) are left out
    for tag in numeric:
        written = [(r["step"], r[tag]) for r in records if r.get(tag) is not None]
        read = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in read] == [s for s, _ in written], tag
        assert [v for _, v in read] == pytest.approx([v for _, v in written], rel=1e-6), tag  # stored as float32
    assert [e.step for e in events.Scalars("val_loss")] == [0, 10, STEPS]
    assert [e.step for e in events.Scalars("loss")] == list(range(1, STEPS + 1))


def test_a_metrics_log_hands_its_sink_each_record_as_written_and_closes_it(tmp_path):
    class Sink:
        def __init__(self):
            self.records, self.closed = [], False

        def write(self, record):
            self.records.append(record)

        def close(self):
            self.closed = True

    sink = Sink()
    with MetricsLog(tmp_path / "metrics.jsonl", sink=sink) as log:
        log.write(worker="w0", step=1, loss=torch.tensor(2.5), final=True)
    assert sink.records == read_metrics(tmp_path / "metrics.jsonl") == [{"worker": "w0", "step": 1, "loss": 2.5,
                                                                          "final": True}]
    assert sink.closed


def test_without_tensorboard_installed_train_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import now fails as when missing
    with pytest.raises(MetricsError, match="pip install 'decentral\\[tensorboard\\]'"):
        TensorBoardSink(tmp_path / "board")
    recipe = write_recipe(tmp_path / "local.yaml", {"name": "local"}, steps=2)
    assert main(["train", "--protocol", str(recipe), "--out", str(tmp_path / "out"),
                 "--tensorboard", str(tmp_path / "board")]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"decentral: {TENSORBOARD_MISSING}\n"
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # it stopped before training


def test_importing_decentral_does_not_import_tensorboard():
    code = ("import sys, decentral.cli, decentral.worker, decentral.demo, decentral.report;"
            "decentral.cli.build_parser();"
            "print([m for m in sys.modules if 'tensorboard' in m])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


def test_report_redraws_the_plot_and_prints_the_table_of_a_train_run(train_run, tmp_path, capsys):
    out, _ = train_run
    png = tmp_path / "redrawn.png"
    assert main(["report", str(out), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["worker", "step", "loss", "val_loss", "sent", "received", "wait_s", "held_up_s",
                                "wall_s"]
    final = next(r for r in read_metrics(out / "metrics.jsonl") if r.get("final"))
    assert lines[1].split()[:2] == ["solo", str(STEPS)]
    assert lines[1].split()[3] == f"{final['val_loss']:.4f}"
    assert lines[-1] == f"report: plot {png}; workers: 1"
    assert main(["report", str(out), "--out", str(tmp_path / "plot.bogus")]) == 2  # matplotlib writes no such picture
    assert "name a picture file ending in one of" in capsys.readouterr().err


def test_report_tells_apart_workers_of_the_same_name_in_a_bench_folder(tmp_path, capsys):
    for method, worker, folder in (("diloco", "w0", "w0"), ("noloco", "w0", "w0"), ("diloco", "w0.rank1", "w0/rank1"),
                                   ("other", None, "w7")):
        with MetricsLog(tmp_path / method / folder / "metrics.jsonl") as log:
            for step in range(1, 4):
                log.write(step=step, loss=3.0 - step / 10, wall_s=step * 0.5, **({"worker": worker} if worker else {}))
    assert main(["report", str(tmp_path)]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:-1]]
    # files in sorted order; records without a worker field are named after their folder
    assert rows == ["diloco/w0", "diloco/w0.rank1", "noloco/w0", "other/w7"]
    assert (tmp_path / "report.png").stat().st_size > 0


def test_report_of_a_pipeline_run_whose_lead_was_taken_over_draws_every_iteration(tmp_path, capsys):
    """The head that takes over from a dead lead writes the last iteration the nodes took without a wall time
    (`recovered`, decentral.pipeline.serve); the report of such a run was a KeyError traceback."""
    with MetricsLog(tmp_path / "h0" / "metrics.jsonl") as log:
        for step in range(1, 4):
            log.write(worker="h0", step=step, wall_s=step * 0.5, loss=5.0 - step / 10, microbatches=4)
    with MetricsLog(tmp_path / "h1" / "metrics.jsonl") as log:
        log.write(worker="h1", step=3, loss=4.7, microbatches=4, recovered=True)  # as serve writes it on takeover
        for step in range(4, 6):
            log.write(worker="h1", step=step, wall_s=(step - 3) * 0.5, loss=5.0 - step / 10, microbatches=4)
    assert main(["report", str(tmp_path)]) == 0
    rows = [line.split()[:2] for line in capsys.readouterr().out.splitlines()[1:-1]]
    assert rows == [["h0", "3"], ["h1", "5"]]
    assert (tmp_path / "report.png").stat().st_size > 0


@pytest.mark.parametrize("make", ["empty", "missing"])
def test_report_without_metrics_exits_2_with_one_line(tmp_path, capsys, make):
    run = tmp_path / "run"
    if make == "empty":
        (run / "w0").mkdir(parents=True)
    assert main(["report", str(run)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1 and captured.err.startswith("decentral: ")
    assert not (run / "report.png").exists()


def test_pipeline_train_moves_its_bar_by_the_leads_metrics_while_it_waits(tmp_path, monkeypatch):
    from decentral.pipeline import launch
    from decentral.pipeline.network import PipelineError, parse_network

    network = parse_network({"stages": 2, "skip": 0, "microbatches": 1, "activation_bytes": 0,
                             "nodes": [{"name": "h", "compute_ms": 1, "stage": 0},
                                       {"name": "a", "compute_ms": 1, "stage": 1}],
                             "default_link": {"latency_ms": 1, "bandwidth_mbps": 1000}})
    run = launch.LocalPipeline(tmp_path / "recipe.yaml", network, tmp_path)
    assert run.iterations_done() == 0  # the lead has written nothing yet
    monkeypatch.setattr(launch, "TICK_S", 0.01)
    lead = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    run.procs = {"h": lead}  # a lead that runs until we close its stdin
    seen = []
    with MetricsLog(tmp_path / "h" / "metrics.jsonl") as log:
        log.write(worker="h", step=1)

        def tick():
            seen.append(run.iterations_done())
            if len(seen) == 1:
                log.write(worker="h", step=2)  # the lead finishes another iteration
            else:
                lead.stdin.close()  # and then the run

        assert run.wait(60, tick) == 0
    assert seen[:2] == [1, 2]
    stuck = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    run.procs = {"h": stuck}
    try:
        with pytest.raises(PipelineError, match=r"did not end in the time given \(--timeout\); no node had checkpointed"):
            run.wait(0.05, lambda: None)
    finally:
        stuck.kill()
        stuck.wait()
