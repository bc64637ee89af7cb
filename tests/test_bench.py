"""`decentral bench`: the numbers it reports follow from the workers' records, and a small real run
on emulated hosts writes the results schema and the plot."""

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import NETNS, TINY_MODEL, TINY_TRAIN, wait_until
from decentral.cli import main as cli_main
from decentral.config import default_recipe_path
from decentral.netlab import _stale_names
import decentral.bench as bench
from decentral.bench import (Launch, compare, format_cpu, report, method_steps, peak_rate, recipe_file, round_bytes,
                             run_launches, split_method, summarize_method, time_to_loss)
from decentral.netlab import NetLab


def records(worker, wall_per_step, steps, vals, group_size=2):
    """A worker's records: a validation every 10 steps, each after a round of `group_size` members."""
    out = [{"worker": worker, "step": 0, "val_loss": vals[0], "wall_s": 0.0, "bytes_sent": 0, "wait_s": 3.0}]
    for s in range(1, steps + 1):
        r = {"worker": worker, "step": s, "loss": 3.0, "wall_s": s * wall_per_step, "bytes_sent": 100 * s,
             "wait_s": 3.0 + s * wall_per_step / 4}
        if s % 10 == 0:
            r.update(val_loss=vals[s // 10], group_size=group_size)
        out.append(r)
    return out


def test_summary_numbers_follow_from_the_records():
    raw = {"codes": [0, 0], "tx_bytes": [1000, 3000],
           "records": records("w0", 0.5, 20, [5.0, 4.0, 3.0]) + records("w1", 1.0, 20, [5.0, 4.5, 3.5])}
    res = summarize_method(raw, tokens_per_step=64, steps=20)
    assert res["ok"]
    assert res["wall_s"] == 20.0  # the slower worker
    assert res["steps_per_s"] == (20 / 10 + 20 / 20) / 2
    assert res["tokens_per_s"] == 64 * 20 * 2 / 20.0
    assert res["final_val_loss"] == (3.0 + 3.5) / 2 and res["best_val_loss"] == 3.0
    assert res["blocked_fraction"] == 0.25  # each waited a quarter of its wall time (after the 3 s it took to join)
    assert res["bytes_sent_per_worker"] == 2000 and res["bytes_sent_per_worker_per_step"] == 100
    assert res["stream_bytes_sent_per_worker"] == 2000  # each worker's own count: 100 bytes per step
    assert res["peak_stream_bytes_per_s"] == (200 + 100) / 2  # the median of w0 (100 B every 0.5 s) and w1
    assert time_to_loss(res["curves"], 4.0) == 15.0  # w0 at t=5; w1 between 4.5 (t=10) and 3.5 (t=20)
    assert time_to_loss(res["curves"], 3.2) is None  # w1 never reaches it


def test_cpu_per_worker_splits_into_training_thread_other_threads_and_child_processes():
    """Each worker's records carry its process's and its training thread's CPU so far (2 s and 1.5 s of
    start-up before the first), and those of evaluation steps its child processes' (its DHT node's); and
    the process's peak memory so far."""
    def with_cpu(worker, thread_per_step, others_per_step, children_per_step):
        return [{**r, "cpu_s": 2.0 + r["step"] * (thread_per_step + others_per_step),
                 "thread_cpu_s": 1.5 + r["step"] * thread_per_step,
                 "peak_rss_mib": 300.0 + r["step"] * thread_per_step,
                 **({"children_cpu_s": 0.7 + r["step"] * children_per_step} if "val_loss" in r else {})}
                for r in records(worker, 0.5, 20, [5.0, 4.0, 3.0])]
    raw = {"codes": [0, 0], "tx_bytes": [None, None],
           "records": with_cpu("w0", 0.5, 0.1, 0.05) + with_cpu("w1", 0.6, 0.2, 0.15)}
    res = summarize_method(raw, tokens_per_step=64, steps=20)
    assert res["training_thread_cpu_s"] == pytest.approx((10 + 12) / 2)
    assert res["other_threads_cpu_s"] == pytest.approx((2 + 4) / 2)
    assert res["child_processes_cpu_s"] == pytest.approx((1 + 3) / 2)
    assert res["peak_rss_mib"] == pytest.approx(300 + 20 * 0.6)  # the larger worker's last record
    assert summarize_method({**raw, "records": records("w0", 0.5, 20, [5.0, 4.0, 3.0])}, tokens_per_step=64,
                            steps=20)["training_thread_cpu_s"] is None  # records of a worker without CPU figures
    table = format_cpu({"methods": {"diloco": res}})
    assert "not training" in table and f"{(3 + 2) / (11 + 3 + 2):.1%}" in table and "312 MiB" in table


def test_a_worker_that_joined_mid_run_is_credited_only_the_steps_it_trained():
    joiner = [{**r, "step": r["step"] + 10} for r in records("w1", 0.5, 10, [5.0, 4.0])]  # steps 10..20 in 5 s
    raw = {"codes": [0, 0], "tx_bytes": [None, None], "records": records("w0", 0.5, 20, [5.0, 4.0, 3.0]) + joiner}
    assert summarize_method(raw, tokens_per_step=64, steps=20)["steps_per_s"] == 2.0  # both: 2 steps a second


def test_bytes_per_round_is_one_outer_steps_traffic_not_a_state_upload_in_some_round():
    sent, recs = 0, []
    for step in range(1, 61):
        if step % 10 == 0:
            sent += 1000 + (50_000 if step == 30 else 0)  # a newcomer downloads our state in round 3
        recs.append({"worker": "w0", "step": step, "round": step // 10, "loss": 3.0, "bytes_sent": sent})
    assert round_bytes(recs) == 1000
    assert round_bytes(recs[:15]) is None  # one boundary: no whole round between two


def test_peak_rate_is_the_most_sent_in_any_second_not_the_runs_average():
    steady = records("w0", 0.25, 40, [5.0] * 5)  # 100 bytes every 0.25 s: 400 B/s throughout
    assert peak_rate(steady) == 400
    burst = [dict(r, bytes_sent=r["bytes_sent"] + (8000 if r["step"] >= 21 else 0)) for r in steady]
    # 8000 more bytes within step 21 (5.0 s to 5.25 s): the second around it carries them and 4 steps' 100
    assert peak_rate(burst) == 8400
    assert peak_rate(burst, window_s=2.0) == (8000 + 800) / 2.0
    assert peak_rate(steady[:3]) is None  # no span of a second: no rate (it was 0, which the table showed as 0 B)


def test_comparison_measures_each_method_against_the_reference_and_ddp():
    def method(wall_per_step, vals):
        raw = {"codes": [0], "tx_bytes": [1000], "records": records("w0", wall_per_step, 20, vals)}
        return summarize_method(raw, tokens_per_step=64, steps=20)

    results = {"config": {}, "methods": {"local": method(0.5, [5.0, 4.2, 3.8]), "ddp": method(2.0, [5.0, 3.5, 3.0]),
                                         "diloco": method(0.6, [5.0, 4.0, 3.5])}}
    compare(results)
    local, ddp, diloco = (results["methods"][m] for m in ("local", "ddp", "diloco"))
    assert results["config"]["target_loss"] == 3.0  # ddp's final loss
    assert diloco["compute_utilisation"] == (20 / 12) / (20 / 10)
    assert diloco["time_to_target_s"] is None and ddp["time_to_target_s"] == 40.0
    assert diloco["ddp_time_to_final_s"] == 20.0  # ddp's curve reaches 3.5 at its second evaluation, t=20
    assert diloco["speedup_vs_ddp"] == 20.0 / 12.0
    assert local["ddp_time_to_final_s"] == 20 * (5.0 - 3.8) / (5.0 - 3.5)  # interpolated between evaluations
    compare(results, target_loss=3.5)  # a target given (`--target-loss`, a run's or `--report`'s) wins over DDP's
    assert results["config"]["target_loss"] == 3.5 and diloco["time_to_target_s"] == 12.0
    assert ddp["time_to_target_s"] == 20.0 and diloco["speedup_vs_ddp"] == 20.0 / 12.0  # (still DDP's, at equal loss)


def test_the_worker_that_held_the_averages_up_longest_is_named_per_method(capsys, tmp_path):
    """Each of w0's and w1's rounds was held up by w1 (a straggler), 2 s by w1's own count, 1.5 s by w0's."""
    def method(held_by):
        recs = records("w0", 0.5, 20, [5.0, 4.0, 3.0]) + records("w1", 0.5, 20, [5.0, 4.0, 3.0])
        for r in recs:
            if held_by and "group_size" in r:
                r.update(held_by=held_by, held_s=2.0 if r["worker"] == held_by else 1.5)
        return summarize_method({"codes": [0, 0], "tx_bytes": [1000, 1000], "records": recs}, tokens_per_step=64,
                                steps=20)

    results = {"config": {"hosts": 2, "bandwidth": "20mbit,2mbit", "mode": "netns", "steps": 20,
                          "methods": ["diloco"]},
               "methods": {"local": method(None), "diloco": method("w1")}}
    assert results["methods"]["diloco"]["held_up_most"] == ["w1", (2 * 2.0 + 2 * 1.5) / 2]
    assert results["methods"]["local"]["held_up_most"] is None  # no average timed
    assert report(results, tmp_path) == 0
    assert "held the averages up longest (held_up_s, as `decentral report` shows each): diloco w1 3.5s" in (
        capsys.readouterr().out)


def test_a_method_that_never_averaged_is_said_to_have_run_as_local_and_gets_no_speed_up(capsys, tmp_path):
    """hivemind given as many steps as one of its rounds ended before its first average: its curve was local's,
    worker by worker, and the table gave it a 6x speed-up over DDP."""
    def method(vals, group_size):
        raw = {"codes": [0], "tx_bytes": [1000], "records": records("w0", 0.5, 20, vals, group_size)}
        return summarize_method(raw, tokens_per_step=64, steps=20)

    results = {"config": {"hosts": 1, "bandwidth": None, "mode": "loopback", "steps": 20, "methods": ["ddp", "hivemind"]},
               "methods": {"local": method([5.0, 4.2, 3.8], 1), "ddp": method([5.0, 3.5, 3.0], 2),
                           "hivemind": method([5.0, 4.2, 3.8], 1)}}
    assert report(results, tmp_path) == 0
    hivemind = results["methods"]["hivemind"]
    assert hivemind["averaged"] is False and hivemind["ddp_time_to_final_s"] and hivemind["speedup_vs_ddp"] is None
    out, err = capsys.readouterr()
    assert "hivemind (never averaged)" in out and "ddp (never" not in out and "local (never" not in out
    assert "bench: hivemind never averaged (no round had two members" in err
    assert "stepped faster than local" not in err  # (every method here steps as fast as the reference)


def test_report_keeps_the_runs_own_target_loss_and_takes_its_results_file(tmp_path, capsys):
    """A run given --target-loss (no DDP in it): `--report` tabled it with no target and wrote that into its
    results.json, erasing each method's time to the target. It keeps the run's, unless given another."""
    shipped = Path(__file__).parents[1] / "docs" / "benchmarks" / "long-20mbit-3000-results.json"
    (tmp_path / "run").mkdir()
    saved = tmp_path / "run" / "results.json"
    saved.write_text(shipped.read_text())
    measured = json.loads(saved.read_text())["methods"]["diloco"]["time_to_target_s"]
    for given in (tmp_path / "run", saved):  # the folder, or its results file
        assert cli_main(["bench", "--report", str(given)]) == 0
        kept = json.loads(saved.read_text())
        assert kept["config"]["target_loss"] == 1.336 and kept["methods"]["diloco"]["time_to_target_s"] == measured
        assert "bench: target loss 1.336;" in capsys.readouterr().out
    assert cli_main(["bench", "--report", str(tmp_path / "run"), "--target-loss", "1.5", "--steps", "5", "--out",
                     str(tmp_path / "elsewhere")]) == 0
    assert json.loads(saved.read_text())["config"]["target_loss"] == 1.5  # as asked
    assert ("bench: note: --report runs nothing and writes into its own folder: --steps, --out ignored"
            in capsys.readouterr().err)  # (it was silent, and said nothing of --out either)
    assert not (tmp_path / "elsewhere").exists()
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "results.json").write_text(json.dumps({"points": []}))  # a bench sweep's, say
    assert cli_main(["bench", "--report", str(tmp_path / "sweep")]) == 2
    assert f"`decentral report {tmp_path / 'sweep'}` tables any run's folder" in capsys.readouterr().err


@pytest.mark.parametrize("command", [
    ["bench"], ["bench", "soak"], ["syncbench"], ["bench", "pipeline"], ["bench", "pipeline", "convergence"],
    ["bench", "pipeline", "timing"], ["bench", "dht"], ["bench", "overhead"], ["bench", "islands"], ["bench", "merge"],
    ["bench", "btm"], ["bench", "sweep"]], ids=" ".join)
def test_every_bench_refuses_an_out_holding_an_earlier_run_before_any_work(command, tmp_path, capsys):
    """As the README says: `bench soak`, `syncbench` and the pipeline's benches wrote over an earlier run's files."""
    out = tmp_path / "earlier"
    out.mkdir()
    name = "syncbench.json" if command == ["syncbench"] else "results.json"
    (out / name).write_text('{"kept": true}')
    assert cli_main([*command, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out} holds a" in err and len(err.splitlines()) == 1, err
    assert [p.name for p in out.iterdir()] == [name] and (out / name).read_text() == '{"kept": true}'


HOLDING_THE_OUT = """
import sys, time
from pathlib import Path
from decentral.checkpoint import sole_writer
with sole_writer(Path(sys.argv[1])):
    print("holding", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("command", [
    ["bench", "--mode", "loopback", "--protocols", "diloco"], ["bench", "soak", "--mode", "loopback", "--hosts", "3"],
    ["bench", "sweep", "--steps", "50"], ["syncbench"], ["bench", "pipeline"], ["bench", "pipeline", "convergence"],
    ["bench", "pipeline", "timing"], ["bench", "dht"], ["bench", "overhead"], ["bench", "islands"], ["bench", "merge"],
    ["bench", "btm"]], ids=lambda c: " ".join(c[:3]))
def test_a_bench_into_the_out_of_a_bench_running_now_stops_before_it_writes(command, tmp_path, capsys):
    """Two benches given one --out at once both passed its checks (neither had written yet), then garbled each
    other's logs and results (loopback mode; in netns mode the lab's name kept them apart); a second soak removed
    the first's steady run and replaced its swarm key, a second sweep's workers failed on the first's; the other
    benches wrote over each other's results. Every bench holds its --out."""
    out = tmp_path / "out"
    out.mkdir()
    first = subprocess.Popen([sys.executable, "-c", HOLDING_THE_OUT, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline() == "holding\n"  # the bench that began first
        assert cli_main([*command, "--out", str(out)]) == 2
    finally:
        first.kill()
        first.wait()
    assert f"another process is writing to {out}" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == [".lock"]  # (the lock's file) nothing of the second


def test_a_method_faster_than_the_reference_gets_a_note_on_noise(capsys, tmp_path):
    """Utilisation of 140% was tabled without a word: the reference's run was slowed by the shared machine."""
    def method(wall_per_step):
        raw = {"codes": [0], "tx_bytes": [1000], "records": records("w0", wall_per_step, 20, [5.0, 4.2, 3.8])}
        return summarize_method(raw, tokens_per_step=64, steps=20)

    results = {"config": {"hosts": 1, "bandwidth": None, "mode": "loopback", "steps": 20, "methods": ["diloco"]},
               "methods": {"local": method(0.5), "diloco": method(0.35)}}
    assert report(results, tmp_path) == 0 and results["methods"]["diloco"]["compute_utilisation"] > 1.4
    assert "bench: note: diloco stepped faster than local, the reference" in capsys.readouterr().err


def test_a_method_name_says_its_protocol_codec_own_steps_and_recipe(tmp_path):
    assert split_method("diloco+int4@3000") == ("diloco", "int4") and method_steps("diloco+int4@3000", 300) == 3000
    assert split_method("ddp@1500") == ("ddp", None) and method_steps("ddp", 300) == 300
    with pytest.raises(ValueError, match="positive integer"):
        method_steps("ddp@1.5k", 300)
    assert recipe_file("hivemind", tmp_path) == tmp_path / "diloco.yaml"  # hivemind borrows DiLoCo's setup
    (tmp_path / "hivemind.yaml").write_text("")
    assert recipe_file("hivemind", tmp_path) == tmp_path / "hivemind.yaml"  # unless it has its own
    assert recipe_file("diloco", tmp_path) == tmp_path / "diloco.yaml"


def test_a_failed_worker_marks_the_method_failed():
    raw = {"codes": [0, 1], "tx_bytes": [None, None], "records": records("w0", 0.5, 20, [5.0, 4.0, 3.0])}
    res = summarize_method(raw, tokens_per_step=64, steps=20)
    assert not res["ok"]
    assert res["bytes_sent_per_worker"] == 2000  # loopback mode: the workers' own counters


def tiny_recipes(folder):
    """local, ddp, diloco and co2 (every 10 steps) recipes of the tiny model, evaluated every 10 steps."""
    folder.mkdir()
    train = {**TINY_TRAIN, "eval_every": 10}
    for name, protocol in {"local": {"name": "local"}, "ddp": {"name": "ddp"}, "diloco": {"name": "diloco", "every": 10},
                           "co2": {"name": "co2", "every": 10}}.items():  # hivemind's baseline borrows diloco.yaml
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(
            {"protocol": protocol, "train": train, "model": TINY_MODEL, "swarm": {"timeout": 10, "heartbeat_s": 0.5}}))
    return folder


@pytest.mark.solo
def test_small_bench_writes_results_and_plot(tmp_path, small_corpus, prefork):
    """Each kind of method the bench launches: the reference, DDP, hivemind's optimizer (whose two baseline
    processes must learn and average), and an outer protocol with a codec (co2+topk). DDP runs its own number
    of steps (ddp@20), and its final loss there is the target.
    DiLoCo, NoLoCo and Streaming DiLoCo go through the same launcher as CO2 (their training: test_swarm_training).
    25 steps, not a multiple of H = 10: hivemind's rounds come every 2 x 10 steps of the swarm's, and a run whose
    peers end on such a boundary has the later one wait a whole swarm timeout for the one that ended."""
    recipes = tiny_recipes(tmp_path / "recipes")
    out = tmp_path / "out"
    methods = ["ddp@20", "hivemind", "co2+topk"]
    done = prefork.run(["bench", "--hosts", "2", "--bandwidth", "50mbit", "--steps", "25",
                        "--protocols", ",".join(methods), "--recipes", str(recipes), "--out", str(out),
                        "--data", str(small_corpus)], tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == {"local", *methods}
    for method, res in results["methods"].items():
        assert res["ok"], method
        for key in ("wall_s", "tokens_per_s", "final_val_loss", "best_val_loss", "bytes_sent_per_worker",
                    "compute_utilisation", "time_to_target_s", "ddp_time_to_final_s", "speedup_vs_ddp"):
            assert key in res, (method, key)
        assert 0 < res["compute_utilisation"] <= 1.5
        assert res["training_thread_cpu_s"] > 0 and res["other_threads_cpu_s"] >= 0
        assert res["peak_rss_mib"] > 100  # a process with torch loaded holds more than that
        if method != "local":
            assert res["bytes_sent_per_worker"] > 0
        if method not in ("local", "ddp@20"):  # those two run no swarm (ddp: a torch.distributed group, in-process)
            assert res["child_processes_cpu_s"] > 0  # its DHT node and libp2p daemon (hivemind's averager too)
    for i in range(2):  # hivemind.Optimizer's baseline: two real processes on loopback learn and average
        logs = (out / "hivemind" / f"w{i}.log").read_text()
        baseline = [json.loads(line) for line in (out / "hivemind" / f"w{i}" / "metrics.jsonl").read_text().splitlines()]
        vals = [r["val_loss"] for r in baseline if "val_loss" in r]
        assert vals[-1] < vals[0] - 0.5, (i, vals)
        assert 2 in [r.get("group_size") for r in baseline], logs  # a round averaged with the other peer
        assert [r["step"] for r in baseline if "loss" in r] == list(range(1, 26))
        assert baseline[-1]["final"] and baseline[-1]["step"] == 25
        assert (out / "hivemind" / f"w{i}" / "checkpoint" / "meta.json").is_file()
    ddp, topk = results["methods"]["ddp@20"], results["methods"]["co2+topk"]
    ddp_records = map(json.loads, (out / "ddp@20" / "w0" / "metrics.jsonl").read_text().splitlines())
    ddp_steps = [r["step"] for r in ddp_records if "loss" in r]
    assert ddp_steps[-1] == 20 and results["config"]["target_loss"] == ddp["final_val_loss"]
    # every 10 steps, 1% of the outer gradient (probes and votes stay) against every step's whole gradient; in
    # float32, H=10 alone sends about 1/7 of DDP's stream here
    assert topk["stream_bytes_sent_per_worker"] < ddp["stream_bytes_sent_per_worker"] / 100
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (out / "bench.png").unlink()
    again = prefork.run(["bench", "--report", str(out)], tmp_path, timeout=60)
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "results.json").read_text()) == results  # the comparison is a function of the records
    assert (out / "bench.png").is_file() and "speedup" in again.stdout
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "results.json").write_text(json.dumps({"points": []}))  # a bench sweep's, say
    again = prefork.run(["bench", "--report", str(tmp_path / "other")], tmp_path, timeout=60)
    assert again.returncode == 2 and "is not a `decentral bench` run's results" in again.stderr, again.stderr


def test_an_out_holding_a_folder_of_a_methods_name_is_refused_and_kept(tmp_path, capsys):
    """`train --out runs/diloco`, then `bench --out runs`: the bench removed runs/diloco to write its own there."""
    (tmp_path / "runs" / "diloco").mkdir(parents=True)
    (tmp_path / "runs" / "diloco" / "notes.txt").write_text("precious")
    code = cli_main(["bench", "--protocols", "diloco,noloco", "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and f"--out {tmp_path / 'runs'} holds diloco: the bench writes a folder" in err, err
    assert (tmp_path / "runs" / "diloco" / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["diloco"]


def test_a_method_with_a_codec_its_protocol_cannot_use_is_refused_before_anything_runs(tmp_path, capsys):
    for methods, why in (("ddp+int8", "unknown method"), ("diloco+int3", "unknown codec"),
                         ("noloco+topk", "error feedback"), ("ddp@0", "positive integer"),
                         ("diloco+", "unknown method"), (",", "names no method"),
                         ("local", "names no method besides local"), ("local,diloco+int3", "unknown codec"),
                         ("diloco,noloco,diloco", "names diloco more than once"),
                         ("diloco --hosts 254", "--hosts 254: a lab has at most 253"),
                         ("diloco --bandwidth 20mbit,5mbit", "'20mbit,5mbit' gives 2 rates for 4 hosts")):
        methods, *more = methods.split()
        code = cli_main(["bench", "--protocols", methods, "--out", str(tmp_path / "out"), *more])
        err = capsys.readouterr().err
        assert code == 2 and why in err, (methods, err)
        assert not (tmp_path / "out").exists()  # no lab, no worker, no results


def test_bad_data_timeout_steps_and_out_are_refused_before_any_worker_starts(tmp_path, capsys):
    code = cli_main(["bench", "--protocols", "diloco", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "corpus path does not exist" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()  # no lab, no worker, no results
    with pytest.raises(SystemExit) as exit:
        cli_main(["bench", "--protocols", "diloco", "--method-timeout", "0", "--out", str(tmp_path / "out")])
    assert exit.value.code == 2 and "--method-timeout: must be above 0" in capsys.readouterr().err
    # fewer steps than one round: the method would train as `local` does and be compared as if it averaged
    code = cli_main(["bench", "--protocols", "ddp,diloco+int8", "--steps", "10", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "diloco+int8: 10 steps are less than one of its rounds (every 50 steps)" in err, err
    assert "diloco+int8@50" in err and not (tmp_path / "out").exists()
    # an --out that would lose an earlier bench's results, or is a file
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "results.json").write_text("{}")
    (tmp_path / "afile").write_text("x")
    for out, says in (("earlier", "holds a previous bench (results.json)"), ("afile", "is a file, not a folder")):
        assert cli_main(["bench", "--protocols", "diloco", "--out", str(tmp_path / out)]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "earlier" / "results.json").read_text() == "{}"
    for suite in ("soak", "dht", "overhead", "islands", "btm", "merge", "pipeline", "sweep"):  # was a raw errno
        assert cli_main(["bench", suite, "--out", str(tmp_path / "afile")]) == 2, suite
        assert capsys.readouterr().err == f"decentral: --out {tmp_path / 'afile'} is a file, not a folder\n", suite
    for suite in ("dht", "overhead", "islands", "merge"):  # (they wrote over it; the others refused it already)
        assert cli_main(["bench", suite, "--out", str(tmp_path / "earlier")]) == 2, suite
        assert capsys.readouterr().err == (f"decentral: bench {suite}: --out {tmp_path / 'earlier'} holds an earlier "
                                           "run's results.json, which this run would write over: give another --out\n")
    assert (tmp_path / "earlier" / "results.json").read_text() == "{}"


def test_an_interrupted_bench_keeps_what_finished_and_says_what_did_not_run(tmp_path, small_corpus, prefork):
    """Ctrl-C while the second method trains: the lab is gone, the reference's results stay, the bench says
    which methods did not run and how to table the rest; `--report` of that run says so too and exits 1."""
    out, log = tmp_path / "out", tmp_path / "bench.log"
    bench = prefork.spawn(["bench", "--hosts", "2", "--steps", "10", "--protocols", "diloco@100000", "--recipes",
                           str(tiny_recipes(tmp_path / "recipes")), "--out", str(out), "--data", str(small_corpus)], log)
    wait_until(lambda: log.exists() and "bench: diloco@100000 on" in log.read_text(), 300, "the second method starting")
    bench.send_signal(signal.SIGINT)
    assert bench.wait(60) == 130, log.read_text()
    said = log.read_text()
    assert "interrupted; not run: diloco@100000" in said and f"decentral bench --report {out}" in said, said
    assert set(json.loads((out / "results.json").read_text())["methods"]) == {"local"}
    if NETNS:
        assert _stale_names("bench") == ([], [])  # namespaces, veths and bridge removed: their processes died too
    again = prefork.run(["bench", "--report", str(out)], tmp_path, timeout=60)
    assert again.returncode == 1 and "not run (the bench was interrupted): diloco@100000" in again.stderr, again.stderr


TRAINING_FOR_A_SECOND = """
import json, sys, time
from pathlib import Path
folder = Path(sys.argv[1])
folder.mkdir()
with open(folder / "metrics.jsonl", "w") as f:
    for step, val in ((0, 5.5), (2, 4.0), (3, None)):
        f.write(json.dumps({"worker": folder.name, "step": step, **({"val_loss": val} if val else {})}) + "\\n")
time.sleep(1.0)  # a worker still training
"""


def test_a_running_method_says_how_far_its_slowest_worker_is(tmp_path, monkeypatch, capsys):
    """A bench method runs for minutes to hours: every PROGRESS_S the bench says how far its workers are."""
    monkeypatch.setattr(bench, "PROGRESS_S", 0.2)
    with NetLab(2, None, mode="loopback", name="tpg") as lab:
        launches = [Launch(host, f"w{host.index}", [sys.executable, "-c", TRAINING_FOR_A_SECOND,
                                                     str(tmp_path / f"w{host.index}")]) for host in lab.hosts]
        raw = run_launches(lab, tmp_path, "diloco", launches, lambda _: [], timeout=60, steps=5)
    assert raw["codes"] == [0, 0]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("bench: diloco: ")]
    assert lines and lines[-1].endswith("s, slowest worker at step 3 of 5, last val 4.000"), lines


def test_a_method_past_its_timeout_is_killed_and_said_to_have_hit_it(tmp_path, capsys):
    """It printed the TimeoutExpired of the host's whole `ip netns exec ...` command line, not the option hit."""
    with NetLab(1, None, mode="loopback", name="tpt") as lab:
        launch = Launch(lab.hosts[0], "w0", [sys.executable, "-c", TRAINING_FOR_A_SECOND, str(tmp_path / "w0")])
        raw = run_launches(lab, tmp_path, "diloco", [launch], lambda _: [], timeout=0.3)
        assert raw["codes"] != [0]
        assert "bench: diloco failed: still running after 0.3 s (--method-timeout), killed" in capsys.readouterr().err
        again = Launch(lab.hosts[0], "w1", [sys.executable, "-c", TRAINING_FOR_A_SECOND, str(tmp_path / "w1")])
        run_launches(lab, tmp_path, "flat", [again], lambda _: [], timeout=0.3, timeout_option="--timeout")
    assert "still running after 0.3 s (--timeout), killed" in capsys.readouterr().err  # (`bench islands`' option)


def test_a_recipes_folder_needs_only_the_reference_and_the_methods_run(tmp_path, capsys):
    """`--recipes R --protocols noloco` with R holding local.yaml and noloco.yaml, as its help asks, was refused
    for lacking diloco.yaml (read for the model's size)."""
    shipped = Path(default_recipe_path("diloco")).parent
    recipes = tmp_path / "R"
    recipes.mkdir()
    for name in ("local", "noloco"):
        shutil.copy(shipped / f"{name}.yaml", recipes)
    code = cli_main(["bench", "--recipes", str(recipes), "--protocols", "noloco", "--data", str(tmp_path / "missing"),
                     "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "corpus path does not exist" in err and "diloco.yaml" not in err, err  # (past the recipes)


def test_ctrl_c_as_the_lab_closes_after_every_method_still_reports(tmp_path, small_corpus, monkeypatch, capsys):
    """A Ctrl-C that lands while the lab closes (it holds the signal till then) came after every method had run:
    the bench said `not run: ;`, told to run nothing again, and wrote no table or plot. Now it reports."""
    def interrupted_close(lab):
        close(lab)
        raise KeyboardInterrupt

    close = NetLab.close
    monkeypatch.setattr(NetLab, "close", interrupted_close)
    out = tmp_path / "out"
    code = cli_main(["bench", "--mode", "loopback", "--hosts", "1", "--steps", "10", "--protocols", "ddp", "--recipes",
                     str(tiny_recipes(tmp_path / "recipes")), "--data", str(small_corpus), "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 130 and "after every method had run" in captured.err and "not run" not in captured.err, captured.err
    assert (out / "bench.png").is_file() and "ddp" in captured.out
    assert set(json.loads((out / "results.json").read_text())["methods"]) == {"local", "ddp"}


def test_in_loopback_mode_ddp_and_hivemind_are_said_uncapped_and_nothing_is_compared_with_ddp(tmp_path, capsys):
    """Loopback mode paces only the swarm's own streams: DDP's gloo traffic ran at loopback speed (86 Mbit/s on a
    20mbit bench) and was the yardstick of every speed-up; hivemind's baseline, which counts no bytes, was tabled
    as sending 0 B."""
    def method(wall_per_step, vals, bytes_counted=True):
        recs = records("w0", wall_per_step, 20, vals)
        if not bytes_counted:
            recs = [{k: v for k, v in r.items() if k != "bytes_sent"} for r in recs]
        return summarize_method({"codes": [0], "tx_bytes": [None], "records": recs}, tokens_per_step=64, steps=20)

    assert bench._paced("ddp@100", "loopback", "20mbit") is False and bench._paced("hivemind", "loopback", "20mbit") is False
    assert bench._paced("diloco+int8", "loopback", "20mbit") and bench._paced("ddp", "netns", "20mbit")
    assert bench._paced("ddp", "loopback", None)  # (uncapped links asked for)
    results = {"config": {"hosts": 1, "bandwidth": "20mbit", "mode": "loopback", "steps": 20,
                          "methods": ["ddp", "diloco", "hivemind"]},
               "methods": {"local": method(0.5, [5.0, 4.2, 3.8]), "ddp": method(0.5, [5.0, 3.5, 3.0]),
                           "diloco": method(0.6, [5.0, 4.0, 3.5]), "hivemind": method(0.6, [5.0, 4.0, 3.6], False)}}
    for name, res in results["methods"].items():
        res["paced"] = bench._paced(name, "loopback", "20mbit")
    assert results["methods"]["hivemind"]["bytes_sent_per_worker"] is None  # (not 0: nothing was counted)
    assert report(results, tmp_path) == 0
    diloco = results["methods"]["diloco"]
    assert results["config"]["target_loss"] == 3.0 and diloco["time_to_target_s"] is None  # (DDP's loss: a loss)
    assert diloco["speedup_vs_ddp"] is None and diloco["ddp_time_to_final_s"] is None
    out, err = capsys.readouterr()
    assert "ddp (uncapped)" in out and "hivemind (uncapped)" in out and "diloco (uncapped)" not in out
    assert "bench: 1 host, 20 Mbit/s links, loopback mode: only the swarm's own streams paced" in out  # (the table's)
    assert "bench: note: ddp, hivemind ran uncapped: in loopback mode only the swarm's own streams" in err


def test_ddp_in_loopback_mode_meets_on_a_free_port(tmp_path, small_corpus, capsys):
    """Two loopback benches at once (labs of other names, or another user's) both put DDP's rendezvous on port 29512
    of 127.0.0.1: the second's rank 0 failed with EADDRINUSE, its rank 1 joined the first's. Here the port is held
    as the other bench would hold it."""
    import socket

    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", bench.ISLAND_PORT))
        held.listen()
        code = cli_main(["bench", "--mode", "loopback", "--hosts", "2", "--steps", "10", "--protocols", "ddp",
                         "--recipes", str(tiny_recipes(tmp_path / "recipes")), "--data", str(small_corpus),
                         "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "results.json").read_text())["methods"]["ddp"]["ok"]
