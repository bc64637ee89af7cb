"""`decentral pipeline plan` and the planner benchmark, run in-process through their argparse hooks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from decentral.pipeline.bench import plan_bench
from decentral.pipeline.cli import add_pipeline_parser
from decentral.pipeline.network import NetworkError, load_network
from decentral.pipeline.simulator import simulate

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "networks"


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Parse and run like decentral.cli.main: NetworkError becomes one line on stderr and exit code 2."""
    parser = argparse.ArgumentParser(prog="decentral")
    add_pipeline_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except NetworkError as e:
        print(f"decentral: {e}", file=sys.stderr)
        code = 2
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_writes_the_plan_and_the_chart_and_prints_three_times(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    code, stdout, _ = run_cli(["pipeline", "plan", str(EXAMPLES / "two_sites.json"), "--microbatches", "6",
                               "--out", str(out), "--plot", str(png)], capsys)
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads(out.read_text())
    assert record["inputs"]["microbatches"] == 6 and record["inputs"]["stages"] == 4  # the flag, then the file
    assert record["inputs"]["path_length"] == 3  # 4 stages, skip 0.25: 4 - round(1.0)
    network = load_network(EXAMPLES / "two_sites.json").replace(microbatches=6)
    paths = [[network.index(name) for name in path] for path in record["paths"]]
    assert len(paths) == 6 and all(len(path) == 3 for path in paths)
    assert sum(len(names) for names in record["allocation"]) == len(network)
    assert record["iteration_ms"]["planned"] == pytest.approx(simulate(network, paths).makespan_ms, abs=1e-3)
    for label, key in (("full pipeline", "full_pipeline"), ("network-blind skipping", "network_blind"),
                       ("planned", "planned")):
        line = next(line for line in stdout.splitlines() if line.startswith(label + " "))
        assert f"{record['iteration_ms'][key] / 1e3:.1f} s" in line
    assert f"planned in {record['planning_s']:.1f} s" in stdout


def test_flags_override_the_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code, _, _ = run_cli(["pipeline", "plan", str(EXAMPLES / "two_sites.json"), "--stages", "3", "--skip", "0",
                          "--out", str(out)], capsys)
    record = json.loads(out.read_text())
    assert code == 0 and len(record["allocation"]) == 3
    assert all(len(path) == 3 for path in record["paths"])
    code, _, _ = run_cli(["pipeline", "plan", str(EXAMPLES / "two_sites.json"), "--activation-bytes", "1000",
                          "--out", str(out)], capsys)
    assert code == 0 and json.loads(out.read_text())["inputs"]["activation_bytes"] == 1000
    code, _, stderr = run_cli(["pipeline", "plan", str(EXAMPLES / "regions20.json"), "--stages", "40",
                               "--out", str(out)], capsys)  # the nodes are counted before the paths
    assert code == 2 and "40 stages need at least 40 nodes, the network has 20" in stderr


def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"stages": 2, "skip": 0, "microbatches": 2, "activation_bytes": 10,
                               "nodes": [{"name": "a", "compute_ms": "fast"}, {"name": "b", "compute_ms": 1}],
                               "default_link": {"latency_ms": 1, "bandwidth_mbps": 1}}))
    code, stdout, stderr = run_cli(["pipeline", "plan", str(bad), "--out", str(tmp_path / "plan.json")], capsys)
    assert code == 2 and stdout == ""
    assert stderr == f"decentral: {bad}: nodes[0].compute_ms must be a positive number, got 'fast'\n"  # as given
    code, _, stderr = run_cli(["pipeline", "plan", str(EXAMPLES / "two_sites.json"), "--stages", "9",
                               "--out", str(tmp_path / "plan.json")], capsys)
    assert code == 2 and stderr.count("\n") == 1 and "9 stages need at least 9 nodes" in stderr
    assert not (tmp_path / "plan.json").exists()


def test_fewer_stages_than_a_node_is_pinned_to_is_one_line_and_exit_code_2(tmp_path, capsys):
    """--stages below a pin in the file is refused as the file's own bad pin is, not an IndexError in the planner."""
    data = json.loads((EXAMPLES / "two_sites.json").read_text())
    data["nodes"][6]["stage"] = 3
    (tmp_path / "pinned.json").write_text(json.dumps(data))
    code, stdout, stderr = run_cli(["pipeline", "plan", str(tmp_path / "pinned.json"), "--stages", "3", "--skip", "0",
                                    "--out", str(tmp_path / "plan.json")], capsys)
    assert code == 2 and stdout == ""
    assert stderr == (f"decentral: {tmp_path / 'pinned.json'}: nodes[6] ('cloud-3') is pinned to stage 3, but the "
                      "pipeline has 3 stages (0 to 2): pin it to one of them, or ask for more stages\n")
    assert not (tmp_path / "plan.json").exists()


def test_an_out_that_cannot_be_written_is_one_line_and_exit_code_2(tmp_path, capsys):
    (tmp_path / "plan.json").symlink_to(tmp_path / "gone" / "plan.json")  # into a folder that is not there
    code, _, stderr = run_cli(["pipeline", "plan", str(EXAMPLES / "two_sites.json"), "--microbatches", "2",
                               "--out", str(tmp_path / "plan.json")], capsys)
    assert code == 2 and stderr.count("\n") == 1
    assert stderr.startswith(f"decentral: cannot write {tmp_path / 'plan.json'}: No such file or directory")


def test_help_ends_with_an_example(capsys):
    with pytest.raises(SystemExit):
        run_cli(["pipeline", "plan", "--help"], capsys)
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-2] == "example:" and lines[-1].strip().startswith("decentral pipeline plan ")


@pytest.mark.parametrize("suite, skips", [("timing", "0 0.25"), ("convergence", "0 0.9")])
def test_a_skip_the_pipeline_cannot_plan_is_refused_before_any_variant_runs(suite, skips, tmp_path, capsys):
    """`bench pipeline timing --stages 2` (its help's own example) trained the skip-0 variant, then failed on
    skip 0.25, which leaves one stage per path."""
    from decentral.cli import main

    out = tmp_path / "out"
    argv = ["bench", "pipeline", suite, "--skips", *skips.split(), "--out", str(out)]
    assert main([*argv, "--stages", "2"] if suite == "timing" else argv) == 2
    assert "stage(s) per path; a path needs stage 0 and at least one other" in capsys.readouterr().err
    assert not out.exists()


def test_bench_reports_every_seed_and_the_median(tmp_path, capsys):
    rows = plan_bench(seeds=(0, 1), nodes=8, stages=4, skip=0.25, regions=2, microbatches=8, effort=0.05,
                      out=tmp_path)
    assert [row["seed"] for row in rows] == [0, 1, "median"]
    for row in rows[:2]:
        assert row["planned_vs_full"] == pytest.approx(row["planned_s"] / row["full_s"])
    assert rows[2]["planned_s"] == pytest.approx((rows[0]["planned_s"] + rows[1]["planned_s"]) / 2)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [row["dead"] for row in saved["rows"]] == [rows[0]["dead"], rows[1]["dead"]]
    assert (tmp_path / "pipeline_bench.png").exists()
    assert "median" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [(["bench", "pipeline", "--seeds", "-1"], "--seeds: must be at least 0"),
                                        (["bench", "pipeline", "timing", "--iterations", "0"],
                                         "--iterations: must be at least 1")])
def test_pipeline_bench_arguments_that_cannot_run_are_refused_as_they_are_read(argv, says, capsys):
    """--seeds -1 reached numpy's default_rng (a ValueError traceback); --iterations 0 trained on netlab for
    minutes, then took the median of nothing (a StatisticsError traceback)."""
    from decentral.cli import main

    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2 and says in capsys.readouterr().err


def test_a_plan_whose_network_blind_baseline_deadlocks_is_tabled_written_and_drawn(tmp_path, capsys):
    """Network-blind skipping can order a node's work into a deadlock (one microbatch in memory, stage replicas):
    the table said inf and nan, plan.json held `Infinity` (not JSON), and --plot ended in a Deadlock traceback."""
    from decentral.cli import main
    from decentral.pipeline.network import regions_network

    regions_network(nodes=12, regions=2, seed=1, stages=6, skip=0, microbatches=24, memory=1).save(tmp_path / "n.json")
    assert main(["pipeline", "plan", str(tmp_path / "n.json"), "--seed", "1", "--effort", "0.05", "--out",
                 str(tmp_path / "plan.json"), "--plot", str(tmp_path / "plan.png")]) == 0
    out = capsys.readouterr().out
    assert "network-blind skipping  deadlocks" in out and "inf" not in out and "nan" not in out, out
    timed = json.loads((tmp_path / "plan.json").read_text())["iteration_ms"]
    assert timed["network_blind"] is None and timed["planned"] > 0 and (tmp_path / "plan.png").stat().st_size > 0
