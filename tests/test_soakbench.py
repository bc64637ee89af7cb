"""The churn soak's arithmetic on hand-made worker records (the soak itself runs for many minutes:
`decentral bench soak`, numbers in BENCHMARKS.md)."""

import time
from pathlib import Path

import pytest

from conftest import refused_by_name
from decentral.soakbench import (
    Restart, Run, digest_agreement, failures, life_files, round_seconds, summarize, sync_waits,
)


def life(start_wait, syncs, step_s=1.0, every=2, digests=None, final=2.0):
    """Records of one process: a start record, `len(syncs) * every` steps (a sync every `every` steps
    waiting syncs[i] seconds), then a final record."""
    records = [{"step": 0, "round": 0, "val_loss": 5.0, "wall_s": 0.0, "wait_s": start_wait}]
    wall, wait, step = 0.0, start_wait, 0
    for i, waited in enumerate(syncs):
        for k in range(every):
            step += 1
            wall += step_s
            record = {"step": step, "round": i, "loss": 3.0, "wall_s": wall, "wait_s": wait}
            if k == every - 1:
                wait += waited
                wall += waited
                record.update(round=i + 1, group_size=3, wall_s=wall, wait_s=wait)
                if digests:
                    record["digest"] = digests[i]
            records.append(record)
    records.append({"step": step, "round": len(syncs), "val_loss": final, "final": True, "wall_s": wall, "wait_s": wait})
    return records


def test_sync_waits_and_round_seconds():
    records = life(7.0, [0.5, 4.0, 0.5, 0.5])
    assert sync_waits(records) == pytest.approx([0.5, 4.0, 0.5, 0.5])  # the start's 7 s of joining is not a sync
    assert round_seconds(records) == pytest.approx(2.5)  # gaps between syncs: 2 steps + 4.0, then 2 steps + 0.5 twice


def test_digests_agree_only_where_every_recorder_holds_the_same():
    run = Run("churn", 10.0, {0: 0, 1: 0}, {0: life(0, [1, 1, 1], digests=["a", "b", "c"]),
                                           1: life(0, [1, 1], digests=["a", "x"]) + [{"step": 9, "round": 3, "digest": "c",
                                                                                     "repaired": True}]})
    assert digest_agreement(run) == (2, 3, 1)  # rounds 1 and 3 agree, round 2 does not; one repair


def test_summary_counts_stalls_rejoins_and_the_loss_ratio():
    steady = Run("steady", 100.0, {0: 0, 1: 0, 2: 0}, {i: life(0, [0.5] * 4, final=2.0) for i in range(3)})
    churn = Run("churn", 120.0, {0: 0, 1: 0, 2: 0},
                {0: life(0, [0.5, 3.0, 0.5, 0.5], final=2.1), 1: life(0, [0.5] * 4, final=2.1),
                 2: life(0, [0.5] * 4, final=2.4)},
                [Restart(2, 10.0, 10.5, 4, trained_at=12.0), Restart(2, 20.0, 20.2, 6, killed_again=True),
                 Restart(2, 40.0, 40.1, 8, trained_at=45.0)])
    summary = summarize(steady, churn, keep=2)
    assert summary["round_s"] == pytest.approx(2.5)
    assert summary["kept"]["w0"]["stalls"] == 1 and summary["kept"]["w1"]["stalls"] == 0  # 3.0 s > one round
    assert summary["kept"]["w0"]["wait_fraction"] == pytest.approx(4.5 / 12.5)
    assert summary["rejoined_within_a_round"] == 1  # 1.5 s yes, 4.9 s no, the one killed again not counted
    assert summary["loss_ratio"] == pytest.approx(2.2 / 2.0)
    assert summary["final_models"] == {"steady": {"agree": 3, "workers": 3}, "churn": {"agree": 2, "workers": 3}}


def test_settings_that_would_kill_nobody_are_refused_before_anything_runs(tmp_path, capsys):
    """--kill-every 0 or --minutes 0 made a "churn" run without a kill, compared with the steady one as if churned."""
    from decentral.cli import main as cli_main

    out = tmp_path / "out"
    refused_by_name(capsys, ["bench", "soak"], (
        (["--kill-every", "0"], "--kill-every: must be above 0"), (["--minutes", "-1"], "--minutes: must be above 0"),
        (["--timeout", "0"], "--timeout: must be above 0"), (["--steps", "0"], "--steps: must be at least 1")), out)
    assert cli_main(["bench", "soak", "--hosts", "1", "--out", str(out)]) == 2
    assert "--hosts must be at least 2" in capsys.readouterr().err
    assert cli_main(["bench", "soak", "--bandwidth", "20mbit,2mbit", "--out", str(out)]) == 2
    assert "'20mbit,2mbit' gives 2 rates for 6 hosts: give one rate, or one for each" in capsys.readouterr().err
    assert not out.exists()


def test_each_worker_that_did_not_exit_0_is_named_with_its_logs_last_line(tmp_path):
    """The soak exited 1 with only `exit codes {0: 0, 1: 0, 2: 2}` in its output."""
    (tmp_path / "churn").mkdir()
    (tmp_path / "churn" / "w2.log").write_text("[w2] starts\ndecentral: could not reach any peer at X\n\n")
    runs = [Run("steady", 10.0, {0: 0, 1: 0}, {}), Run("churn", 12.0, {0: 0, 1: -9, 2: 2}, {})]
    assert failures(runs, tmp_path) == [
        f"soak: the churn run's w1 exited with -9 (see {tmp_path / 'churn' / 'w1.log'})",
        f"soak: the churn run's w2 exited with 2: decentral: could not reach any peer at X "
        f"(see {tmp_path / 'churn' / 'w2.log'})"]
    assert failures(runs[:1], tmp_path) == []


def test_a_workers_records_are_read_over_its_lives_in_order(tmp_path):
    """A restart without a checkpoint replaces its metrics.jsonl: the harness moves each killed life's file
    aside, and counted a restarted worker that trained to step 200 as never training again."""
    for name, step in (("life2.metrics.jsonl", 2), ("life10.metrics.jsonl", 10), ("life1.metrics.jsonl", 1),
                       ("metrics.jsonl", 11)):
        (tmp_path / name).write_text(f'{{"step": {step}}}\n')
    assert [p.name for p in life_files(tmp_path)] == ["life1.metrics.jsonl", "life2.metrics.jsonl",
                                                      "life10.metrics.jsonl", "metrics.jsonl"]


def test_a_local_protocol_is_refused_before_anything_runs(tmp_path, capsys):
    """`local` forms no swarm: its w0 wrote no address for the others, trained its whole run alone, and the soak
    then ended in a traceback."""
    from decentral.cli import main as cli_main

    assert cli_main(["bench", "soak", "--protocol", "local", "--out", str(tmp_path / "out")]) == 2
    assert "trains without a swarm" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_run_that_outlasts_its_timeout_ends_in_one_line_and_its_workers_end(tmp_path, capsys):
    """The soak's own failures (a run past --timeout, a first worker that never came up) were a traceback and
    exit 1, with what had finished untold; its workers are killed, and the bench stops with one line."""
    from decentral.cli import main as cli_main

    out = tmp_path / "out"
    code = cli_main(["bench", "soak", "--mode", "loopback", "--hosts", "2", "--keep", "1", "--steps", "2000",
                     "--timeout", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and "bench soak: the steady run failed: still running after 2 s (--timeout), killed" in err, err
    assert "Traceback" not in err and not (out / "results.json").exists()
    deadline = time.monotonic() + 15  # (a worker's DHT process ends itself once it sees its worker gone)
    while (left := _processes_naming(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left


def _processes_naming(out) -> list[str]:
    """Command lines of this machine's processes that name `out` (the soak's workers, and their DHT processes,
    forked from them)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            zombie = (cmdline.parent / "stat").read_text().rpartition(") ")[2].startswith("Z")
        except OSError:  # (ended meanwhile)
            continue
        if str(out) in text and not zombie:
            found.append(text)
    return found


def test_a_soak_whose_churn_run_killed_nobody_says_so_and_exits_1(tmp_path, capsys):
    """A churn run that ended before its first kill compared two steady runs, exit 0, "restarts: 0"."""
    from conftest import write_recipe

    from decentral.cli import main as cli_main

    recipe = write_recipe(tmp_path / "diloco.yaml", {"name": "diloco", "every": 10}, steps=30)
    out = tmp_path / "out"
    code = cli_main(["bench", "soak", "--mode", "loopback", "--hosts", "2", "--keep", "1", "--protocol", str(recipe),
                     "--steps", "30", "--kill-every", "600", "--minutes", "1", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 1 and "bench soak: nobody was killed: the churn run ended before its first kill" in captured.err
    assert "loopback mode" in captured.out and (out / "results.json").is_file()  # (the runs' tables are kept)
