"""`decentral bench sweep`: the grid it trains is the one asked for, each point really gets its settings,
and the workers of a point really average (loopback hub) while `local`'s do not."""

import json
import re
import signal

import pytest

from conftest import wait_until, write_recipe
from decentral.cli import main
from decentral.config import RecipeError, with_settings
from decentral.metrics import read_metrics
from decentral.sweepbench import parse_grid


def test_the_grid_is_the_product_of_the_settings_and_a_malformed_one_is_refused():
    grid = parse_grid(["outer_lr=0.7,1.0", "train.lr=1e-3", "nesterov=true,false"])
    assert grid == {"outer_lr": [0.7, 1.0], "train.lr": [1e-3], "nesterov": [True, False]}
    recipe = with_settings({"protocol": {"name": "diloco", "outer_lr": 0.5}, "train": {"steps": 9}},
                           {"outer_lr": 1.0, "train.lr": 1e-3})
    assert recipe == {"protocol": {"name": "diloco", "outer_lr": 1.0}, "train": {"steps": 9, "lr": 1e-3}}
    for bad in ("outer_lr", "outer_lr=", "model.n_layer=2", "a.b.c=1", "outer_lr=,", "outer_lr=0.5,", "train.steps=5,10"):
        with pytest.raises(RecipeError, match="--set"):
            parse_grid([bad])
    with pytest.raises(RecipeError, match="outer_lr is given twice; give all its values in one --set"):
        parse_grid(["outer_lr=0.7", "train.lr=1e-3", "outer_lr=1.0"])  # not a grid of outer_lr=1.0 alone


def test_bad_data_or_local_recipe_is_one_line_and_exit_2_before_any_point_trains(tmp_path, small_corpus, capsys):
    """A missing --data failed every point deep inside (DataError, exit 1, the table cutting its message)."""
    recipe = write_recipe(tmp_path / "diloco.yaml", {"name": "diloco", "every": 5}, steps=10)
    recipe.write_text(recipe.read_text().replace("swarm:", "swarm:\n  codec: topk"))  # which `local` cannot use
    sweep = ["bench", "sweep", "--protocol", str(recipe), "--steps", "10", "--workers", "1"]
    for extra, message in [
        (["--data", str(tmp_path / "nonexistent")], f"corpus path does not exist or is not a file or folder: "
                                                    f"{tmp_path / 'nonexistent'}"),
        (["--data", str(small_corpus), "--with-local"], "(local (no communication)): swarm.codec: topk sends"),
        (["--data", str(small_corpus), "--set", "every=5,20"],  # (the main bench refused this; the sweep ran it)
         "every=20: --steps 10 is less than one of its rounds (every 20 steps): it would average nothing"),
    ]:
        assert main([*sweep, *extra, "--out", str(tmp_path / "sweep")]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("bench sweep: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "sweep").exists()


def test_an_out_holding_an_earlier_sweep_is_refused_before_its_results_are_overwritten(tmp_path, small_corpus,
                                                                                       capsys):
    """A second sweep into the same --out overwrote the first's results.json, then each of its points failed on
    the checkpoints the first left in pointK/wI (exit 1): the first sweep's results were lost."""
    recipe = write_recipe(tmp_path / "local.yaml", {"name": "local"}, steps=2)
    out = tmp_path / "sweep"
    sweep = ["bench", "sweep", "--protocol", str(recipe), "--steps", "2", "--workers", "1", "--data", str(small_corpus),
             "--out", str(out)]
    assert main(sweep) == 0
    first = (out / "results.json").read_bytes()
    capsys.readouterr()
    assert main(sweep) == 2
    err = capsys.readouterr().err
    assert err == f"bench sweep: --out {out} holds an earlier sweep (results.json, point1): give another --out, " \
                  "or remove it to sweep again\n", err
    assert (out / "results.json").read_bytes() == first
    (out / "results.json").unlink()  # a sweep interrupted in its first point leaves only the point's folder
    assert main(sweep) == 2 and "holds an earlier sweep (point1)" in capsys.readouterr().err


def test_a_sweep_applies_each_points_settings_and_joins_its_workers(tmp_path, small_corpus, prefork):
    recipe = write_recipe(tmp_path / "diloco.yaml", {"name": "diloco", "every": 5, "outer_momentum": 0.0}, steps=10)
    out = tmp_path / "sweep"
    run = prefork.run(["bench", "sweep", "--protocol", str(recipe), "--steps", "10", "--workers", "2",
                       "--set", "outer_lr=1e-9,1.0", "--with-local", "--data", str(small_corpus), "--out", str(out)],
                      tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    points = {p["label"]: p for p in json.loads((out / "results.json").read_text())["points"]}
    assert set(points) == {"outer_lr=1e-09", "outer_lr=1.0", "local (no communication)"}
    frozen, moved, local = points["outer_lr=1e-09"], points["outer_lr=1.0"], points["local (no communication)"]
    # outer lr 1e-9: φ barely moves, and after the last outer step the model is φ, the initial weights
    assert frozen["final_val_loss"] == pytest.approx(frozen["curve"][0][1], abs=1e-4)
    assert moved["final_val_loss"] < moved["curve"][0][1] - 0.1
    # DiLoCo's replicas end identical (they averaged); each local worker trained alone on its own shard
    assert moved["worker_final_val_loss"][0] == pytest.approx(moved["worker_final_val_loss"][1], abs=1e-6)
    assert abs(local["worker_final_val_loss"][0] - local["worker_final_val_loss"][1]) > 1e-4
    assert local["curve"][-1] == [10, pytest.approx(local["final_val_loss"])]  # the workers' mean, as ranked
    # workers in threads of one process start from the same seeded weights (torch's RNG is the process's)
    first_val = [read_metrics(out / "point3" / f"w{i}" / "metrics.jsonl")[0]["val_loss"] for i in range(2)]
    assert first_val[0] == first_val[1]
    assert (out / "sweep.png").stat().st_size > 0
    table = run.stdout[run.stdout.index("final val"):]
    assert re.search(r"^local \(no communication\) +\d\.\d{3} ", table, re.M), table  # a row of dashes before


def test_ctrl_c_stops_the_point_in_training_and_says_what_was_not_run(tmp_path, small_corpus, prefork):
    """The workers train in threads, which no signal reaches: Ctrl-C left the point training to its end (minutes at
    BENCHMARKS.md's length), discarded it, and once ended in a C++ abort (exit code 134)."""
    recipe = write_recipe(tmp_path / "diloco.yaml", {"name": "diloco", "every": 5}, steps=2000)
    out, log = tmp_path / "sweep", tmp_path / "sweep.log"
    sweep = prefork.spawn(["bench", "sweep", "--protocol", str(recipe), "--steps", "2000", "--workers", "2",
                           "--set", "outer_lr=0.7,1.0", "--data", str(small_corpus), "--out", str(out)], log)
    try:
        metrics = out / "point1" / "w0" / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and len(read_metrics(metrics)) > 10, 120, "the first point training")
        sweep.send_signal(signal.SIGINT)
        assert sweep.wait(120) == 130, log.read_text()
    finally:
        sweep.kill()
    said = log.read_text()
    assert "sweep: interrupted in point 1 (outer_lr=0.7); not run: 2 of 2 points" in said, said
    assert "--resume" not in said  # (the worker's hint: a sweep has none)
    assert max(r["step"] for r in read_metrics(metrics) if "loss" in r) < 2000  # stopped, not trained to the end
    assert not (out / "point2").exists()


def test_a_point_that_diverges_is_reported_failed_not_ranked(tmp_path, small_corpus, prefork):
    recipe = write_recipe(tmp_path / "local.yaml", {"name": "local"}, steps=10)
    out = tmp_path / "sweep"
    run = prefork.run(["bench", "sweep", "--protocol", str(recipe), "--steps", "10", "--workers", "1",
                       "--set", "train.lr=1e6", "--data", str(small_corpus), "--out", str(out)], tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    (point,) = json.loads((out / "results.json").read_text())["points"]
    assert point["final_val_loss"] is None and "diverged" in point["error"]


def test_data_given_twice_keeps_both():
    """`--data a --data b` swept on b alone (nargs="*" keeps the last), where every other command takes both."""
    from decentral.cli import build_parser

    assert build_parser().parse_args(["bench", "sweep", "--data", "a.txt", "--data", "b"]).data == ["a.txt", "b"]
