"""`decentral demo`, the README's first command, end to end: real worker processes on loopback, each a
`decentral train` as a user runs it, then the demo's report."""

from __future__ import annotations

import subprocess
from pathlib import Path

from decentral.metrics import read_metrics
from decentral.config import default_recipe_path, load_recipe
from decentral.models import build_model


def demo(prefork, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, list[dict]]]:
    """Run `decentral demo --workers 2 ARGS` into tmp_path/demo (a later --workers wins); (the finished
    process, each worker's records in the folder). Its workers are processes of their own, as a user's are."""
    out = tmp_path / "demo"
    done = prefork.run(["demo", "--workers", "2", "--out", str(out), *args], tmp_path, timeout=300)
    records: dict[str, list[dict]] = {}
    for r in read_metrics(sorted(out.glob("w*/metrics.jsonl"))):
        records.setdefault(r["worker"], []).append(r)
    return done, records


def test_the_default_demo_trains_a_swarm_whose_workers_average_and_learn_and_replaces_an_earlier_demo(tmp_path, prefork):
    """An earlier demo of `local` (one worker training alone) in the same OUT, then the default demo:
    its two workers average and learn, and its records are its own (the earlier w0's steps and checkpoint
    are gone)."""
    done, records = demo(prefork, tmp_path, "--protocol", "local", "--workers", "1", "--steps", "10")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(records) == ["w0"] and "no communication (local)" in done.stdout
    for worker, recs in records.items():
        assert recs[-1]["final"] and recs[-1]["step"] == 10 and recs[-1]["bytes_sent"] == 0, (worker, recs[-1])
        assert recs[-1]["val_loss"] < recs[0]["val_loss"], worker

    done, records = demo(prefork, tmp_path, "--steps", "60")  # NoLoCo, H = 50: one outer round
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(records) == ["w0", "w1"] and "held an earlier demo's records; they are replaced" in done.stdout
    recipe = load_recipe(default_recipe_path("noloco"))
    params = build_model(recipe.model_source, recipe.model, recipe.train.context).num_parameters()
    for worker, recs in records.items():
        assert [r["step"] for r in recs if "loss" in r] == list(range(1, 61)), worker  # this run's steps alone
        last = recs[-1]
        assert last["final"] and last["step"] == 60 and last["round"] == 1, (worker, last)
        assert last["val_loss"] < recs[0]["val_loss"] - 1.0, (worker, recs[0]["val_loss"], last["val_loss"])
        assert last["bytes_sent"] >= params, (worker, last["bytes_sent"])  # it sent its model-sized part
    assert (tmp_path / "demo" / "report.png").stat().st_size > 0
    assert "for a DDP all-reduce" in done.stdout


def test_a_demo_whose_workers_all_fail_before_a_step_says_so_in_one_line(prefork, tmp_path):
    """Every worker refused its --device (no 100th GPU anywhere): the demo then divided by zero workers' records and
    ended in a traceback."""
    done, records = demo(prefork, tmp_path, "--protocol", "local", "--device", "cuda:99")
    assert done.returncode == 1 and not records, done.stdout + done.stderr
    assert "demo: no worker wrote a record; workers [0, 1] exited with errors" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
