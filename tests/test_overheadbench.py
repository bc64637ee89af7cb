"""`decentral bench overhead`: with tiny settings it writes its results and plot, and in each protocol's loop
the protocol's hooks really ran (its step counter, its outer rounds) and the worker's records were written."""

import json

from conftest import write_recipe
from decentral.cli import main
from decentral.metrics import read_metrics


def test_the_suite_hooks_each_protocol_and_writes_results_and_plot(tmp_path, small_corpus, prefork):
    recipes = [write_recipe(tmp_path / f"{name}.yaml", {"name": name, "every": 4}, steps=20)
               for name in ("diloco", "noloco")]
    out = tmp_path / "overhead"
    run = prefork.run(["bench", "overhead", "--protocols", ",".join(map(str, recipes)), "--steps", "12",
                       "--warmup", "2", "--turn", "3", "--data", str(small_corpus), "--out", str(out)],
                      tmp_path, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["block"] == 4 and results["config"]["transport"] == "SoloTransport"
    assert list(results["loops"]) == ["plain", "diloco", "noloco"]
    assert [len(t) for t in results["step_times_s"].values()] == [12, 12, 12]
    for name in ("diloco", "noloco"):
        loop = results["loops"][name]
        # 14 steps through the hooks: 3 outer rounds (steps 4, 8, 12), all 3 of them in the measured 12 steps
        assert (loop["protocol_step"], loop["protocol_round"], loop["outer_steps"]) == (14, 3, 3)
        assert len(loop["block_overhead_inner"]) == 3 and len(loop["block_overhead_all"]) == 3
        for key in ("overhead_inner", "overhead_all"):
            assert set(loop[key]) == {"median", "q1", "q3"}
        assert set(loop["library_inner_s"]) == {"hooks", "record", "card", "write"} and loop["library_inner_s"]["write"] > 0
        assert isinstance(loop["meets_target"], bool) and isinstance(loop["overhead_direct_inner"], float)
        records = read_metrics(out / name / "metrics.jsonl")  # the worker's own records, one per step
        assert [r["step"] for r in records] == list(range(1, 15))
        assert [r["round"] for r in records if "group_size" in r] == [1, 2, 3]
    assert "plain" not in [p.name for p in out.iterdir()]
    assert (out / "overhead.png").stat().st_size > 0
    assert "inner steps [IQR]" in run.stdout


def test_ddp_and_mismatched_recipes_are_refused(tmp_path, capsys):
    other = write_recipe(tmp_path / "noloco.yaml", {"name": "noloco"}, steps=20)
    for protocols, why in (("ddp", "averages every step"), (f"diloco,{other}", "differ from diloco's")):
        assert main(["bench", "overhead", "--protocols", protocols, "--out", str(tmp_path / "out")]) == 2
        assert why in capsys.readouterr().err


def test_a_count_out_of_range_is_refused_before_anything_runs(tmp_path, capsys):
    """--threads 0 was torch's traceback after the --out folder was made; --block 0 meant the default."""
    for args, says in ((["--threads", "0"], "--threads: must be at least 1"), (["--block", "0"], "--block: must be at least 1"),
                       (["--warmup", "-1"], "--warmup: must be at least 0"),
                       (["--steps", "20", "--block", "50"], "--steps (20) must be at least --block (50)")):
        try:
            code = main(["bench", "overhead", *args, "--out", str(tmp_path / "out")])
        except SystemExit as e:  # argparse's own errors
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and says in err and "Traceback" not in err, (args, err)
        assert not (tmp_path / "out").exists()
