"""The `decentral` command line as a user meets it: every --help ends with an example that parses, and
what a user can get wrong ends in one line on stderr and exit code 2, not a traceback."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from conftest import needs_netns, wait_until, write_recipe
import decentral.cli
from decentral.__main__ import run as entry_point
from decentral.checkpoint import checkpoint_present, load_checkpoint, read_checkpoint_meta
from decentral.cli import _negative_values_attached, build_parser, main, schedule_notes
from decentral.config import parse_recipe
from decentral.metrics import read_metrics
from decentral.netlab import NetLab
from decentral.swarm.admission import AdmissionError, SwarmKey, ensure_identity

PEER_ID = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"  # a well-formed id nobody runs


def all_parsers(parser: argparse.ArgumentParser):
    """`parser` and every parser below it, through argparse's subparsers actions."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from all_parsers(sub)


def test_every_help_ends_with_an_example_of_its_own_command_that_parses():
    parsers = list(all_parsers(build_parser()))
    assert {"decentral train", "decentral bench soak", "decentral pipeline node"} <= {p.prog for p in parsers}
    for parser in parsers:
        text = parser.format_help()
        assert "\nexample:\n" in text, f"`{parser.prog} --help` has no example"
        lines = [line.strip() for line in text.rsplit("\nexample:\n", 1)[1].strip().splitlines()]
        commands = [line for line in lines if not line.startswith("#")]
        assert commands and all(c.startswith("decentral ") for c in commands), (parser.prog, lines)
        assert any(f"{c} ".startswith(parser.prog + " ") for c in commands), (parser.prog, commands)
        for command in commands:
            build_parser().parse_args(shlex.split(command, comments=True)[1:])  # SystemExit if it does not parse


def test_the_entry_point_keeps_the_garbage_collector_off_what_lives_as_long_as_the_process(monkeypatch):
    """`decentral`'s entry point freezes (gc.freeze) what its imports made before the command runs, the collector
    on, and what the command made before the interpreter exits, whether it returns its exit code or raises:
    collections walked every object of torch and hivemind (0.7 of the 0.8 CPU seconds a `decentral train`
    process took to exit here, and 0.1 of each command's start)."""
    seen, made = [], []

    def command():
        seen.append((gc.get_freeze_count(), gc.isenabled()))
        made.append([[] for _ in range(1000)])  # the command's objects, alive at its end
        return 3

    monkeypatch.setattr(decentral.cli, "main", command)
    try:
        assert entry_point() == 3
        (frozen_before, enabled), = seen
        assert frozen_before > 0 and enabled
        assert gc.get_freeze_count() >= frozen_before + 1000
        gc.unfreeze()

        def fails():
            made.append([[] for _ in range(1000)])
            raise SystemExit(2)

        monkeypatch.setattr(decentral.cli, "main", fails)
        with pytest.raises(SystemExit):
            entry_point()
        assert gc.get_freeze_count() >= 1000
    finally:
        gc.unfreeze()


def test_a_step_count_the_schedule_does_not_fit_is_noted():
    """A warmup as long as the run, a run shorter than a round, steps after the last outer step: each said;
    a step count that fits, nothing."""
    def notes(protocol, steps, warmup=5):
        return schedule_notes(parse_recipe({"protocol": protocol, "train": {"steps": steps, "warmup_steps": warmup}}))

    assert notes({"name": "diloco", "every": 10}, 40) == [] and notes({"name": "local"}, 7) == []
    warm, = notes({"name": "local"}, 10, warmup=20)
    assert "warmup_steps is 20 and the run has 10 steps" in warm and "reaches 0.5 of train.lr" in warm
    assert "below 10" in warm
    assert notes({"name": "diloco", "every": 10}, 10, warmup=10)[0].startswith("train.warmup_steps is 10")
    short, = notes({"name": "diloco", "every": 10}, 8)
    assert short.startswith("8 steps are less than one round (every 10 steps)") and "--steps 10 or more" in short
    past, = notes({"name": "diloco", "every": 10}, 25)
    assert past.startswith("25 steps are not a multiple of every (10): the last 5") and "--steps 20 or 30" in past


def test_the_schedules_notes_come_once_the_run_trains_and_not_before_a_refusal(tmp_path, small_corpus, capsys):
    recipe = write_recipe(tmp_path / "local.yaml", {"name": "local"}, steps=3)  # warmup_steps 5
    train = ["train", "--protocol", str(recipe), "--out", str(tmp_path / "out"), "--data", str(small_corpus)]
    assert main(train) == 0
    assert capsys.readouterr().err == f"note: {schedule_notes(parse_recipe(yaml.safe_load(recipe.read_text())))[0]}\n"
    assert main(train) == 2  # its checkpoint holds an earlier run: the refusal alone
    err = capsys.readouterr().err
    assert err.startswith("decentral: ") and "holds an earlier run" in err and len(err.splitlines()) == 1, err


def test_top_level_help_documents_the_exit_codes():
    text = build_parser().format_help()
    for code in ("0", "1", "2", "3", "4", "130"):
        assert f"\n  {code} " in text.split("exit codes:")[1]


def scratch_folder(tmp: Path) -> dict[str, str]:
    """The files the user errors below name, in `tmp`; the environment of a keyed swarm (no open-swarm
    notice on stderr)."""
    SwarmKey.generate(tmp / "swarm.key")
    (tmp / "typo.yaml").write_text("protocol: {name: noloco}\ntrian: {steps: 10}\n")
    (tmp / "bad.yaml").write_text("protocol: {name: noloco\n")
    (tmp / "binary.yaml").write_bytes(b"\x00\xff\xfe protocol")
    (tmp / "afile").write_text("")
    (tmp / "empty.yaml").write_text("# nothing but a comment\n")
    (tmp / "noname.yaml").write_text("protocol: {every: 10}\n")
    (tmp / "folder.yaml").mkdir()
    (tmp / "empty.key").write_text("")
    (tmp / "net.json").write_text('{"nodes": [\n')
    (tmp / "registry" / "code").mkdir(parents=True)
    (tmp / "registry" / "code" / "model.safetensors").write_bytes(b"")
    (tmp / "registry" / "code" / "expert.json").write_text("{not json")
    return {"DECENTRAL_SWARM_KEY": str(tmp / "swarm.key")}


@pytest.fixture(scope="module")
def user_errors(tmp_path_factory):
    """Every case of USER_ERRORS run at once as `python -m decentral ...` in a scratch folder; its result by id."""
    tmp = tmp_path_factory.mktemp("cli")
    env = {**os.environ, **scratch_folder(tmp)}
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()

    def run(args):
        return subprocess.run([sys.executable, "-m", "decentral", *args], cwd=tmp, env=env, capture_output=True,
                              text=True, timeout=120)

    arguments = [[a.format(port=busy.getsockname()[1], peer=PEER_ID) for a in args] for _, args, _ in USER_ERRORS]
    with busy, ThreadPoolExecutor(len(arguments)) as pool:
        return dict(zip([name for name, _, _ in USER_ERRORS], pool.map(run, arguments)))


def train_into(out: str) -> list[str]:
    return ["train", "--out", out, "--protocol", "diloco", "--timeout", "1"]


TRAIN = train_into("run")
ONE_STEP = ["train", "--protocol", "local", "--steps", "1", "--set", "train.warmup_steps=0"]
USER_ERRORS = [  # (id, arguments, what the one line says): a process of its own, for those that start a swarm;
    # each its own --out (a run holds its --out while it runs)
    ("missing data", ["train", "--protocol", "local", "--data", "/nonexistent"], "/nonexistent"),
    ("unreachable --join", [*train_into("join"), "--join", "/ip4/127.0.0.1/tcp/1/p2p/{peer}"],
     "could not reach any peer at"),
    ("port in use", [*train_into("port"), "--port", "{port}"], "the port is in use"),
    ("island rendezvous", [*train_into("island"), "--island", "tcp://127.0.0.1:1", "--rank", "1", "--world-size", "2"],
     "rank 1 of 2 could not join the island at tcp://127.0.0.1:1"),
]


def test_swarm_start_with_an_identity_file_is_the_peer_that_file_names_so_its_join_address_outlives_a_restart(
        tmp_path, prefork):
    """Without one an entry peer had a new id at each start: every address it had printed stopped working. With
    one, the id it prints is the file's (libp2p's peer id of its key), whichever life prints it. It publishes its
    mark: a peer with a swarm key, joining this keyless swarm through it alone, is told so."""
    from hivemind.p2p import PeerID

    from decentral.swarm.monitor import SwarmMonitor

    log = tmp_path / "entry.log"
    entry = prefork.spawn(["swarm", "start", "--run", "x", "--identity", "entry.key"], log, cwd=tmp_path)
    try:
        wait_until(lambda: log.exists() and "Ctrl-C to stop." in log.read_text(), 60, "the entry serving")
        keyed = SwarmMonitor("x", [re.search(r"--join (\S+)", log.read_text()).group(1)],
                             swarm_key=SwarmKey.generate(tmp_path / "swarm.key"))
        try:
            with pytest.raises(AdmissionError, match="do not open with swarm key"):
                keyed.rows()
        finally:
            keyed.close()
    finally:
        entry.terminate()  # as Ctrl-C: it leaves the swarm and exits 0
        assert entry.wait(30) == 0
    printed = re.search(r"/p2p/(\S+)", log.read_text()).group(1)
    assert printed == PeerID.from_identity((tmp_path / "entry.key").read_bytes()).to_base58()


def test_a_command_stopped_by_ctrl_c_says_so_in_one_line(tmp_path, prefork):
    """`merge`, `experts fetch`, `bench merge`: a Ctrl-C ended them with exit code 130 and not a word (those
    that say where they stopped, as `train` and `bench` do, say it themselves)."""
    out, err = tmp_path / "merge.log", tmp_path / "merge.err"
    merging = prefork.spawn(["bench", "merge", "--params", "20000000", "--out", "bench"], out, cwd=tmp_path, err=err)
    try:
        wait_until(lambda: out.exists() and "writing 4 random models" in out.read_text(), 60, "the bench to begin")
        merging.send_signal(signal.SIGINT)
        assert merging.wait(60) == 130
    finally:
        merging.kill()
    assert err.read_text() == "decentral: interrupted\n"


def test_ctrl_c_while_the_command_line_is_read_is_one_line_and_exit_code_130(monkeypatch, capsys):
    """Building the parser imports the benches: a Ctrl-C then was a traceback."""
    import decentral.cli
    from decentral.__main__ import run

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(decentral.cli, "build_parser", interrupted)
    monkeypatch.setattr(sys, "argv", ["decentral", "merge", "linear", "--out", "merged"])
    try:
        assert run() == 130
    finally:
        gc.unfreeze()  # (run froze this process's objects, as the command's process can afford to)
    assert capsys.readouterr().err == "decentral: interrupted\n"


def test_output_into_a_pipe_whose_reader_left_ends_quietly_as_sigpipe_would(tmp_path):
    """`decentral bench --report DIR | head -1`: a BrokenPipeError traceback, exit code 1."""
    (tmp_path / "run").mkdir()
    shutil.copy(Path(__file__).parents[1] / "docs/benchmarks/long-20mbit-3000-results.json",
                tmp_path / "run" / "results.json")
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        done = subprocess.run([sys.executable, "-m", "decentral", "bench", "--report", str(tmp_path / "run")],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 128 + signal.SIGPIPE and done.stderr == "", done.stderr


def test_a_full_disk_is_one_line_and_exit_code_2(tmp_path, capsys):
    """The bench's plot written to a full disk (here /dev/full) ended in matplotlib's traceback, exit code 1."""
    (tmp_path / "run").mkdir()
    shutil.copy(Path(__file__).parents[1] / "docs/benchmarks/long-20mbit-3000-results.json",
                tmp_path / "run" / "results.json")
    (tmp_path / "run" / "bench.png").symlink_to("/dev/full")
    assert main(["bench", "--report", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == "decentral: No space left on device, as the command wrote its files\n"


def test_a_temporary_folder_too_long_for_torchs_shared_memory_socket_is_named_in_one_line(tmp_path):
    """hivemind's DHT shares memory through torch's manager, whose Unix socket under TMPDIR fails on a long
    path (a long pytest tmp_path did it): one line naming the folder, where the manager's C++ stack was."""
    long = tmp_path / ("t" * max(1, 100 - len(str(tmp_path))))
    long.mkdir()
    done = subprocess.run([sys.executable, "-m", "decentral", "status", "--join", f"/ip4/127.0.0.1/tcp/1/p2p/{PEER_ID}",
                           "--run", "x"], env={**os.environ, "TMPDIR": str(long)}, capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "torch's shared-memory manager" in lines[0] and f"{long} (" in lines[0]
    assert "set TMPDIR to a shorter" in lines[0]
    assert "frame #" not in lines[0]


@pytest.mark.parametrize("name, expected", [(name, expected) for name, _, expected in USER_ERRORS],
                         ids=[name for name, _, _ in USER_ERRORS])
def test_a_user_error_is_one_line_and_exit_code_2(user_errors, name, expected):
    done = user_errors[name]
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("decentral: "), done.stderr
    assert expected in lines[0]


@pytest.mark.parametrize("args, expected", [  # those refused before anything starts: `main` in this process
    (["train", "--join", "/ip4/127.0.0.1/tcp/1"], "names no peer"),
    ([*TRAIN, "--join", "127.0.0.1:31337"], "'127.0.0.1:31337' is not a multiaddr"),
    (["train", "--protocol", "local", "--island", "tcp://127.0.0.1:1"], "give another protocol"),
    ([*TRAIN, "--announce-host", "example.com", "--port", "31999"], "'example.com' is not an IP address"),
    ([*TRAIN, "--announce-host", "203.0.113.5"], "--announce-host 203.0.113.5 needs a fixed --port"),
    ([*TRAIN, "--join", f"/ip4/203.0.113.5/tcp/31337/p2p/{PEER_ID}"], "--host 127.0.0.1 listens on this machine only"),
    (["swarm", "start", "--join", f"/ip4/203.0.113.5/tcp/31337/p2p/{PEER_ID}"], "give --host 0.0.0.0"),
    (["train", "--protocol", "typo.yaml"], "unknown section(s) ['trian']"),
    (["train", "--protocol", "bad.yaml"], "bad.yaml: not valid YAML (line 2, column 1)"),
    (["train", "--protocol", "missing.yaml"], "recipe missing.yaml does not exist"),
    (["merge", "binary.yaml", "--out", "merged"], "binary.yaml: not a text file in UTF-8"),
    (["demo", "--out", "afile", "--workers", "1", "--steps", "1"], "--out afile is a file, not a folder"),
    ([*train_into("afile")], "--out afile is a file, not a folder"),
    (["pipeline", "train", "--out", "afile"], "--out afile is a file, not a folder"),  # errno's text
    (["experts", "seed", "--domain", "code", "--domain", "legal", "--out", "afile"],
     "--out afile is a file, not a folder"),
    ([*TRAIN, "--tensorboard", "afile"], "--tensorboard afile is a file, not a folder"),
    ([*ONE_STEP, "--out", "/proc/run"], "--out /proc/run: No such file or directory"),  # these two were tracebacks
    ([*ONE_STEP, "--tensorboard", "/proc/board"], "--tensorboard /proc/board: No such file or directory"),
    (["train", "--protocol", "empty.yaml"], "empty.yaml: empty: a recipe names its protocol"),  # NoLoCo's defaults ran
    (["train", "--protocol", "noname.yaml"], "noname.yaml: no protocol.name"),
    (["train", "--protocol", "folder.yaml"], "recipe folder.yaml is a folder, not a file"),
    (["status", "--join", f"/ip4/127.0.0.1/tcp/1/p2p/{PEER_ID}", "--swarm-key", "empty.key"],
     "empty.key is not a swarm key (64 hex digits, as `decentral swarm keygen` writes; it holds 0 characters)"),
    (["status", "--join", f"/ip4/127.0.0.1/tcp/1/p2p/{PEER_ID}", "--swarm-key", "ab" * 32],
     "the swarm key's file is given (--swarm-key FILE, $DECENTRAL_SWARM_KEY), not the key itself"),  # it echoed it
    ([*TRAIN, "--worker-index", "3", "--num-workers", "2"], "--worker-index 3: the data has --num-workers 2 shards"),
    (["train", "--protocol", "nonexistent"], "no protocol 'nonexistent': give one of co2"),
    ([*TRAIN, "--model", "hf:x.json", "--set", "model.n_layer=5"], "--set model.n_layer: shapes the reference GPT"),
    ([*TRAIN, "--island", "tcp://127.0.0.1:1", "--rank", "2", "--world-size", "2"], "--rank 2: must be in [0, 2)"),
    ([*TRAIN, "--rank", "1", "--world-size", "2"], "--rank and --world-size go with --island"),
    ([*TRAIN, "--island", "tcp://127.0.0.1:1", "--island-size", "2"], "give one or the other"),
    ([*train_into("nowhere"), "--resume"], "--resume: no run to resume in nowhere (the folder does not exist)"),
    ([*TRAIN, "--island-mode", "sharded"],  # it was taken, and did nothing
     "--island-mode sharded says how an island averages with the swarm, and this run is no island"),
    (["merge", "missing.yaml", "--out", "merged"], "merge recipe missing.yaml does not"),
    (["experts", "list", "--registry", "registry"], "code/expert.json: not valid JSON"),
    (["pipeline", "plan", "net.json"], "net.json: not valid JSON (line 2, column 1"),
    (["netlab", "--hosts", "0"], "hosts must be in 1..253, got 0"),
    (["swarm", "keygen", "/nonexistent/folder/swarm.key"], "cannot write swarm key /nonexistent/folder/swarm.key"),
    (["netlab", "--hosts", "1", "--measure"], "--measure needs at least 2 hosts"),
    (["netlab", "--hosts", "3", "--bandwidth", "20mbit,5mbit"], "'20mbit,5mbit' gives 2 rates for 3 hosts"),
    (["bench", "--protocols", "diloco", "--out", ""], "--out is empty: give a folder"),  # it wrote into the cwd
    (["merge", "linear", "--out", " "], "--out is empty: give a folder"),
])
def test_more_user_errors_in_process(args, expected, tmp_path, monkeypatch, capsys):
    for name, value in scratch_folder(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert out == "" and len(lines) == 1 and lines[0].startswith("decentral: ") and expected in lines[0], err


@pytest.mark.parametrize("args, expected", [
    (["train", "--num-workers", "0"], "--num-workers: must be at least 1, got 0"),
    (["train", "--worker-index", "-1"], "--worker-index: must be at least 0, got -1"),  # was numpy's traceback
    (["train", "--timeout", "-1"], "--timeout: must be above 0, got -1"),  # was refused by a joiner's state download
    (["demo", "--timeout", "nan"], "--timeout: must be above 0, got nan"),
])
def test_a_count_or_a_time_out_of_range_is_a_usage_error(args, expected, capsys):
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 2 and expected in capsys.readouterr().err


@pytest.mark.parametrize("interval", ["nan", "inf", "0"])
def test_a_status_interval_that_is_no_positive_finite_number_is_a_usage_error(interval, capsys):
    """nan and inf reached time.sleep: a traceback after the monitor had joined."""
    with pytest.raises(SystemExit) as done:
        main(["status", "--join", "/ip4/127.0.0.1/tcp/1/p2p/" + PEER_ID, "--interval", interval])
    assert done.value.code == 2 and "--interval: must be above 0" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["netlab"], ["bench"], ["syncbench"], ["bench", "soak"], ["bench", "islands"]])
@pytest.mark.parametrize("rate, expected", [("0", "not a link rate"), ("fast", "not a link rate: 'fast'"),
                                            ("1bit", "at least 8 bit/s"),
                                            ("-5mbit", "not a link rate: '-5mbit'")])
def test_a_bandwidth_that_is_no_rate_tc_can_shape_is_a_usage_error(command, rate, expected, capsys):
    """'0' once meant uncapped to netlab alone (and '0mbit' was refused); '1bit' reached tc's own usage text;
    '-5mbit' was argparse's "expected one argument" (it read the value as an option)."""
    with pytest.raises(SystemExit) as done:
        main([*command, "--bandwidth", rate])
    err = capsys.readouterr().err
    assert done.value.code == 2 and expected in err and "or 'none' for uncapped links" in err, err
    assert build_parser().parse_args([*command, "--bandwidth", "None"]).bandwidth is None


@pytest.mark.parametrize("command, per_host", [(["netlab"], True), (["bench"], True), (["bench", "fetch"], True),
                                               (["bench", "soak"], True), (["syncbench"], False),
                                               (["bench", "islands"], False)])
def test_a_rate_per_host_goes_to_the_commands_whose_hosts_are_fixed_and_each_rate_is_checked(command, per_host,
                                                                                             capsys):
    """syncbench and bench islands change their host count from point to point."""
    if per_host:
        assert build_parser().parse_args([*command, "--bandwidth", "20mbit, none,5mbit"]).bandwidth == \
            "20mbit,none,5mbit"
        with pytest.raises(SystemExit) as done:
            main([*command, "--bandwidth", "20mbit,fast"])
        assert done.value.code == 2 and "not a link rate: 'fast'" in capsys.readouterr().err
        return
    with pytest.raises(SystemExit) as done:
        main([*command, "--bandwidth", "20mbit,5mbit"])
    assert done.value.code == 2 and "one rate for every host here, got '20mbit,5mbit'" in capsys.readouterr().err


def test_a_run_that_diverges_exits_3_and_keeps_its_last_good_checkpoint(tmp_path, small_corpus, prefork):
    """Training alone (no sync boundary checks the weights): a non-finite loss stops the run with exit code 3
    before anything of the diverged state is saved; the checkpoint stays the last good one."""
    recipe = write_recipe(tmp_path / "local.yaml", {"name": "local"}, steps=40)
    run = ["train", "--protocol", str(recipe), "--data", str(small_corpus), "--out", "run", "--set", "train.eval_every=5"]
    done = prefork.run([*run, "--stop-at", "10"], tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    good, meta = load_checkpoint(tmp_path / "run" / "checkpoint")
    assert meta["sync"]["step"] == 10
    done = prefork.run([*run, "--resume", "--set", "train.lr=1e6"], tmp_path, timeout=120)
    assert done.returncode == 3 and "training diverged" in done.stdout, done.stdout + done.stderr
    assert "the last good checkpoint is in" in done.stdout
    after, meta = load_checkpoint(tmp_path / "run" / "checkpoint")
    assert meta["sync"]["step"] == 10 and all(torch.equal(after[k], v) for k, v in good.items())
    assert all(bool(torch.isfinite(v).all()) for v in after.values() if v.is_floating_point())


def test_a_run_into_an_out_with_a_checkpoint_it_does_not_resume_is_refused_and_the_checkpoint_kept(
        tmp_path, small_corpus, prefork):
    """Found after Ctrl-C: the same command again (no --resume) trained from step 0 over the saved checkpoint."""
    recipe = write_recipe(tmp_path / "local.yaml", {"name": "local"}, steps=40)
    run = ["train", "--protocol", str(recipe), "--data", str(small_corpus), "--out", "run"]
    done = prefork.run([*run, "--stop-at", "5"], tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    saved = (tmp_path / "run" / "checkpoint" / "meta.json").read_bytes()
    done = prefork.run([*run, "--stop-at", "10"], tmp_path, timeout=120)
    assert done.returncode == 2 and "holds an earlier run: --resume goes on from it" in done.stderr, done.stderr
    assert (tmp_path / "run" / "checkpoint" / "meta.json").read_bytes() == saved


def test_a_run_into_an_out_whose_earlier_run_saved_no_checkpoint_replaces_its_records(tmp_path, small_corpus, capsys):
    """A run that diverged before its first checkpoint, then a fresh run into the same --out: the new records
    were appended to the diverged run's (steps 1, 2, ..., 1, 2, ...), and `report` drew both as one run."""
    recipe = write_recipe(tmp_path / "local.yaml", {"name": "local"}, steps=8)
    run = ["train", "--protocol", str(recipe), "--data", str(small_corpus), "--out", str(tmp_path / "run")]
    assert main([*run, "--set", "train.lr=1e6"]) == 3
    path = tmp_path / "run" / "metrics.jsonl"
    assert read_metrics(path) and not checkpoint_present(tmp_path / "run" / "checkpoint")
    capsys.readouterr()
    assert main(run) == 0
    assert f"note: {path} held the records of an earlier run that saved no checkpoint; they are replaced" in \
        capsys.readouterr().err
    assert [r["step"] for r in read_metrics(path) if "loss" in r] == list(range(1, 9))


def test_a_second_process_given_the_same_out_stops_at_once_and_the_first_trains_on(tmp_path, small_corpus, prefork):
    """Two island ranks (or a run started twice) with one --out wrote over each other's checkpoint and crashed.
    A --resume into it is refused the same way, not by what the live run's checkpoint says (it read it first)."""
    recipe = write_recipe(tmp_path / "local.yaml", {"name": "local"}, steps=100_000)
    run = ["train", "--protocol", str(recipe), "--data", str(small_corpus), "--out", "run"]
    first = prefork.spawn(run, tmp_path / "first.log", cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "checkpoint" / "meta.json").exists():  # it trains, and saved once
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.1)
        for again in (run, [*run, "--resume", "--stop-at", "1"]):
            done = prefork.run(again, tmp_path, timeout=120)
            assert done.returncode == 2 and "another process is writing to run" in done.stderr, done.stderr
        assert first.poll() is None
    finally:
        first.kill()


def test_resuming_a_run_at_or_past_its_stop_at_or_steps_is_refused_and_leaves_the_run_as_it_was(tmp_path, small_corpus,
                                                                                               capsys):
    """--resume with a --stop-at or --steps the checkpoint already reached trained nothing, validated again,
    appended records, saved the checkpoint with the smaller schedule and said `done` with exit 0."""
    recipe = write_recipe(tmp_path / "local.yaml", {"name": "local"}, steps=8)
    run = ["train", "--protocol", str(recipe), "--data", str(small_corpus), "--out", str(tmp_path / "run")]
    assert main([*run, "--stop-at", "4"]) == 0
    files = {name: (tmp_path / "run" / name).read_bytes() for name in ("metrics.jsonl", "checkpoint/meta.json")}
    checkpoint = tmp_path / "run" / "checkpoint"
    capsys.readouterr()
    for extra, said in [
        (["--stop-at", "3"], f"the run stops at step 3 (--stop-at), and {checkpoint} is at step 4: nothing would "
                             "train; stop past step 4"),
        (["--steps", "4"], f"{checkpoint} is at step 4, the end of a 4-step schedule (train.steps): nothing would "
                           "train; to train on, give --steps past 4 (the whole schedule's length)"),
        (["--steps", "3"], f"{checkpoint} is at step 4, past the end of a 3-step schedule"),
    ]:
        assert main([*run, "--resume", *extra]) == 2, extra
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith(f"decentral: {said}"), captured
        assert len(captured.err.splitlines()) == 1
        assert files == {name: (tmp_path / "run" / name).read_bytes() for name in files}
    assert main([*run, "--resume", "--stop-at", "5"]) == 0  # a later --stop-at goes on
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5]
    assert "other settings" not in capsys.readouterr().err
    lr = read_checkpoint_meta(checkpoint)["recipe"]["train"]["lr"]
    assert main([*run, "--resume", "--stop-at", "6", "--set", f"train.lr={lr / 2}"]) == 0  # was silent
    assert (f"note: {checkpoint} was trained with other settings (train.lr {lr} there, {lr / 2} here): the run "
            "goes on with this run's") in capsys.readouterr().err
    assert read_checkpoint_meta(checkpoint)["recipe"]["train"]["lr"] == lr / 2
    other = shutil.copytree(small_corpus, tmp_path / "other")  # another corpus (the same text)
    at_6 = [*run[:run.index("--data")], "--data", str(other), *run[run.index("--data") + 2:]]
    assert main([*at_6, "--resume", "--stop-at", "7", "--set", f"train.lr={lr / 2}"]) == 0
    assert (f"(trained on --data {Path(small_corpus).resolve()} there, --data {other} here)"
            in capsys.readouterr().err)


def test_a_resumed_run_redoes_the_records_past_its_checkpoint_and_counts_wall_time_on(tmp_path, small_corpus,
                                                                                        capsys):
    """The records a run wrote after its last checkpoint (here steps 5 and 6, as a run killed at step 6 leaves
    them) are trained again on --resume: they were kept twice, and wall_s started again from 0, so the report's
    curves folded back and its summary's wall time was the last leg's alone."""
    recipe = write_recipe(tmp_path / "local.yaml", {"name": "local"}, steps=8)
    run = ["train", "--protocol", str(recipe), "--data", str(small_corpus), "--out", str(tmp_path / "run")]
    assert main([*run, "--stop-at", "4"]) == 0
    path = tmp_path / "run" / "metrics.jsonl"
    first = read_metrics(path)
    reached = max(r["wall_s"] for r in first)
    with path.open("a") as f:
        for step in (5, 6):
            f.write(json.dumps({"worker": "w", "step": step, "loss": 9.0, "wall_s": reached + step}) + "\n")
    assert main([*run, "--resume", "--stop-at", "6"]) == 0
    records = read_metrics(path)
    assert records[:len(first)] == first
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert all(r.get("loss") != 9.0 for r in records)
    resumed = [r["wall_s"] for r in records[len(first):]]
    assert resumed[0] == reached and resumed == sorted(resumed) and resumed[-1] > reached
    done = capsys.readouterr().out.splitlines()[-1]  # the time it says is the run's: the legs' sum
    assert re.search(r" in \d+s \(the whole run, its earlier legs too\), peak memory", done), done


def test_a_train_whose_stdout_is_closed_trains_to_its_end_and_saves_its_checkpoint(tmp_path, small_corpus, prefork):
    """`decentral train ... | head -1`: the next progress line raised BrokenPipeError out of the training loop,
    which stopped (exit 1) without saving a checkpoint. Now the run says so once on stderr and trains on."""
    recipe = write_recipe(tmp_path / "local.yaml", {"name": "local"}, steps=200)  # a line every 10 steps
    out, stdout, stderr = tmp_path / "run", tmp_path / "stdout", tmp_path / "stderr"
    os.mkfifo(stdout)
    reader = os.open(stdout, os.O_RDONLY | os.O_NONBLOCK)  # the worker's open for writing then does not block
    worker = prefork.spawn(["train", "--protocol", str(recipe), "--data", str(small_corpus), "--out", str(out)],
                           stdout, err=stderr)
    try:
        got = b""
        while b"\n" not in got:  # `head -1`
            assert worker.poll() is None, stderr.read_text()
            select.select([reader], [], [], 1.0)
            with contextlib.suppress(BlockingIOError):
                got += os.read(reader, 1 << 16)
    finally:
        os.close(reader)
    assert worker.wait(120) == 0, stderr.read_text()
    assert "decentral: stdout was closed; training goes on without its lines" in stderr.read_text()
    assert "Traceback" not in stderr.read_text()
    assert checkpoint_present(out / "checkpoint")
    assert read_metrics(out / "metrics.jsonl")[-1]["step"] == 200


def test_resuming_a_run_whose_metrics_file_is_malformed_is_one_line_and_leaves_it_as_it_was(tmp_path, small_corpus,
                                                                                            capsys):
    """--resume rewrites the metrics file up to the checkpoint: a malformed line in it ended in a traceback."""
    recipe = write_recipe(tmp_path / "local.yaml", {"name": "local"}, steps=8)
    run = ["train", "--protocol", str(recipe), "--data", str(small_corpus), "--out", str(tmp_path / "run")]
    assert main([*run, "--stop-at", "4"]) == 0
    path = tmp_path / "run" / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join([lines[0], '{"step": 2, "lo\n', *lines[1:]]))
    kept = path.read_bytes()
    capsys.readouterr()
    assert main([*run, "--resume", "--stop-at", "6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"decentral: {path}:2: malformed metrics line") and "mend that file" in err, err
    assert len(err.splitlines()) == 1 and path.read_bytes() == kept


def test_resuming_with_another_protocol_or_from_metadata_that_does_not_fit_is_one_line(tmp_path, small_corpus, prefork):
    local = write_recipe(tmp_path / "local.yaml", {"name": "local"}, steps=20)
    args = ["train", "--data", str(small_corpus), "--out", "run", "--resume"]
    done = prefork.run(["train", "--protocol", str(local), "--data", str(small_corpus), "--out", "run", "--stop-at", "5"],
                       tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    other = write_recipe(tmp_path / "diloco.yaml", {"name": "diloco", "every": 5}, steps=20)
    done = prefork.run([*args, "--protocol", str(other)], tmp_path, timeout=120)
    assert done.returncode == 2 and "is a local run's checkpoint, this run is diloco" in done.stderr, done.stderr
    meta_path = tmp_path / "run" / "checkpoint" / "meta.json"
    saved = {k: v for k, v in json.loads(meta_path.read_text()).items() if k != "meta_sha256"}  # (an older save's)
    meta_path.write_text(json.dumps({**saved, "sync": "x"}))
    done = prefork.run([*args, "--protocol", str(local)], tmp_path, timeout=120)
    assert done.returncode == 2 and "its metadata does not fit this run" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@needs_netns
def test_the_join_command_swarm_start_prints_works_as_written_on_another_host(lab_name, tmp_path, small_corpus):
    """`swarm start --host 0.0.0.0` on one host, its printed `decentral train ...` run as written on another: the
    newcomer listens where the others reach it (the hint lacked --host 0.0.0.0, so it listened on 127.0.0.1)."""
    key = tmp_path / "swarm.key"
    SwarmKey.generate(key)
    with NetLab(2, None, name=lab_name, mode="netns") as lab:
        entry = lab.hosts[0].popen([sys.executable, "-m", "decentral", "swarm", "start", "--swarm-key", str(key),
                                    "--host", "0.0.0.0", "--announce-host", lab.hosts[0].address, "--port", "31337"],
                                   stdout=subprocess.PIPE, text=True)
        printed = []
        while not printed or printed[-1] not in ("", "Ctrl-C to stop.\n"):  # "": it ended
            printed.append(entry.stdout.readline())
        hint = [line for line in printed if "decentral train" in line]
        assert hint, printed
        command = [sys.executable, "-m", *shlex.split(hint[0])]
        done = lab.hosts[1].run([*command, "--steps", "2", "--data", str(small_corpus), "--out", str(tmp_path / "run")],
                                timeout=120)
        entry.terminate()
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"others join with --join /ip4/{lab.hosts[1].address}/" in done.stdout, done.stdout
        assert "--announce-host" not in done.stderr, done.stderr  # the entry reached it back where it announces


def test_a_port_held_by_another_program_is_waited_for_with_one_warning_then_refused(tmp_path, monkeypatch, caplog):
    """A peer whose --out holds an identity (an earlier run) waits for the port that run's daemon may still hold; a
    port another program holds cost that whole wait without a word (the retries were logged at --verbose only)."""
    from decentral.swarm import SwarmError, SwarmPeer, peer

    monkeypatch.setattr(peer, "IDENTITY_RELEASE_S", 2.0)
    ensure_identity(tmp_path / "identity.key")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SwarmError, match="the port is in use"):
            SwarmPeer("x", port=port, identity_path=tmp_path / "identity.key")
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said == [f"port {port} is still in use (an earlier run of this --out shutting down?): "
                    "waiting up to 2 s for it"]


def test_a_join_address_whose_peer_id_is_wrong_says_a_process_answers_there(make_swarm):
    """A typo in the id, or the id of a peer that no longer listens there: it said "nothing answered there"."""
    from decentral.swarm import SwarmError, SwarmPeer

    member, = make_swarm(1)
    address = member.multiaddrs()[0].split("/p2p/")[0]
    with pytest.raises(SwarmError, match="a process answers there, but not as that peer"):
        SwarmPeer(member.peer.run, [f"{address}/p2p/{PEER_ID}"])


def test_an_argument_after_a_bare_double_dash_is_left_as_the_command_gave_it():
    """netlab runs what follows `--` in each host: a `-5` there is the command's, not joined to an option."""
    args = build_parser().parse_args(_negative_values_attached(["netlab", "--hosts", "2", "--", "--delay", "-5"]))
    assert args.hosts == 2 and args.command[-2:] == ["--delay", "-5"]


@pytest.mark.parametrize("command", [["bench", "--hosts", "8", "soak"], ["bench", "--out", "x", "sweep"],
                                     ["bench", "--report", "runs/b", "soak"],
                                     ["bench", "pipeline", "--seeds", "0", "--stages", "4", "timing"]])
def test_a_commands_own_options_before_its_suites_name_are_refused(command, capsys):
    """`bench --hosts 8 soak` ran a soak of 6 hosts (the suite's default replaced the 8) and `bench --report DIR
    soak` started a soak, without a word."""
    assert main(command) == 2
    err = capsys.readouterr().err
    assert f"given before `{command[-1]}`" in err and "does not read" in err, err
    assert main(["bench", "soak", "--hosts", "1"]) == 2  # (after the name: read, here refused as too few)
    assert "--hosts must be at least 2" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["netlab"], ["bench"], ["bench", "soak"], ["syncbench"], ["bench", "islands"]])
def test_netns_mode_without_root_is_refused_as_the_command_is_read(command, monkeypatch, capsys, tmp_path):
    """It was refused once the lab opened, in the Python API's words (mode='loopback'), after a bench had made its
    --out and written files there (a soak's swarm key)."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as done:
        main([*command, "--mode", "netns", "--out", str(tmp_path / "out")] if command != ["netlab"]
             else [*command, "--mode", "netns"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "netns mode needs root" in err and "give --mode loopback" in err, err
    assert not (tmp_path / "out").exists()


def test_a_plain_negative_number_is_left_to_argparse_also_in_a_list():
    """(Attached as --skips=-0.5, a list option would have taken it alone and refused the values after it.)"""
    assert _negative_values_attached(["bench", "--skips", "-0.5", "0.3", "--bandwidth", "-5mbit"]) == [
        "bench", "--skips", "-0.5", "0.3", "--bandwidth=-5mbit"]


@pytest.mark.parametrize("offset", [-60.0, 45.0], ids=["behind", "ahead"])
def test_a_peer_whose_clock_is_off_says_so_and_how_far(make_swarm, monkeypatch, offset):
    """hivemind's DHT refuses to join peers whose clocks differ by over 3 s; its message gave both times as
    raw timestamps, after "could not start a swarm peer". It says how far off our clock is, which way, and what
    to do. (The DHT process, forked here, compares its clock, `offset` s off, with the member's.)"""
    import hivemind.dht.protocol

    from decentral.swarm import SwarmError, SwarmPeer

    member, = make_swarm(1)
    monkeypatch.setattr(hivemind.dht.protocol, "get_dht_time", lambda: time.time() + offset)
    way = "behind" if offset < 0 else "ahead of"
    with pytest.raises(SwarmError, match=rf"this machine's clock is {abs(offset):.0f} s {way} the clock of a peer it "
                                         r"joins through .*: set the clock right \(NTP"):
        SwarmPeer(member.peer.run, member.multiaddrs()[:1])
