"""Real swarms of `decentral train` processes on loopback: they learn, survive a SIGKILLed peer and
a frozen one, let a late joiner catch up, and resume from checkpoints."""

import dataclasses
import json
import os
import re
import signal
import threading
import time
import types
from pathlib import Path

import pytest
import torch
import yaml

from conftest import TINY_MODEL, TINY_TRAIN, running, wait_until
from decentral.checkpoint import checkpoint_present, load_checkpoint
from decentral.config import RecipeError, parse_recipe
from decentral.cpu import descendants
from decentral.loopback import LoopbackHub
from decentral.models.gpt import GPT, GPTConfig
from decentral.swarm import SwarmError, SwarmTransport
from decentral.swarm.peer import DHT_RPC_TIMEOUT_S
from decentral.sync import SyncReport
from decentral.worker import (
    HELD_SHOWN_S, WorkerOptions, _check_same_setup, _progress_line, _swarm_setup, member_name, run_worker,
)


PROTOCOLS = {
    "co2": {"name": "co2", "every": 10},
    "ddp": {"name": "ddp", "membership_every": 10},
    "diloco": {"name": "diloco", "every": 10},
    "noloco": {"name": "noloco", "every": 10},
    "streaming": {"name": "streaming", "every": 10, "fragments": 3, "delay": 1},
}


def val_losses(records):
    return [r["val_loss"] for r in records if "val_loss" in r]


def fresh_val_loss(workers, n):
    """What the untrained model scores: a peer that started at step 0 validated it (one that started a
    few steps late joined the round under way and skipped it)."""
    return next(r["val_loss"] for i in range(n) for r in workers.metrics(i) if r["step"] == 0 and "val_loss" in r)


def wait_for_round(workers, index, round, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = workers.root / f"w{index}" / "metrics.jsonl"
        if path.exists() and any(json.loads(line).get("round", 0) >= round for line in path.read_text().splitlines()[:-1]):
            return
        assert proc.poll() is None, workers.log(index)
        time.sleep(0.2)  # polling a file another process writes
    raise TimeoutError(f"w{index} did not reach round {round}")


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_four_peer_swarm_trains(workers, protocol):
    w = workers(PROTOCOLS[protocol], steps=60, num_workers=4)
    for i in range(4):
        w.start(i)
    codes = w.wait(timeout=240)
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}, [w.log(i) for i in range(4)]
    fresh = fresh_val_loss(w, 4)
    for i in range(4):
        records = w.metrics(i)
        vals = val_losses(records)
        assert vals[-1] < fresh - 0.5, (protocol, i, vals, fresh)
        groups = [r["group_size"] for r in records if "group_size" in r]
        assert max(groups) == (2 if protocol == "noloco" else 4), groups
        assert records[-1]["bytes_sent"] > 0
    held = [r["held_by"] for i in range(4) for r in w.metrics(i) if "held_by" in r]  # by name, from the cards
    assert held and set(held) <= {f"w{i}" for i in range(4)}, held
    if protocol != "noloco":  # CO2, DiLoCo and DDP replicas hold bit-identical state after every round but the
        # first averaged: peers starting together may average their first steps over different member lists
        # (their announcements cross); one that ends that round apart is repaired from the majority a round later
        lag = 1 if protocol == "co2" else 0  # CO2 applies round 0's average at round 2's boundary
        digests = [{r["round"]: r["digest"] for r in w.metrics(i) if "digest" in r} for i in range(4)]
        repairs = [[r["round"] for r in w.metrics(i) if r.get("repaired")] for i in range(4)]
        assert len(digests[0]) >= 5
        for round in digests[0]:
            if round > 1 + lag:
                assert len({d[round] for d in digests}) == 1, (round, [d[round] for d in digests])
        first = [d.get(1 + lag) for d in digests]  # None: it joined at that round's end (a DDP peer that started late)
        majority = max(set(first) - {None}, key=first.count)
        for i in range(4):  # (a replica the others left out of that round takes their state at once)
            later = [r for r in repairs[i] if r > 1 + lag]
            assert later == ([2 + lag] if first[i] not in (None, majority) else []), (i, repairs[i])


def test_a_progress_line_names_by_its_card_the_member_that_held_the_last_average_up(make_swarm):
    """Only a hold of `HELD_SHOWN_S` or more is named: by the name the member's heartbeat carries, ours by ours."""
    a, b = make_swarm(2)
    b.set_card(True, name="slow-host")
    wait_until(lambda: member_name(a, b.peer_id, "w0") == "slow-host", 30, "b's card did not reach a")
    at = types.SimpleNamespace(step=100, round=2)  # (what a line reads of the protocol)
    record = {"loss": 2.0, "val_loss": 2.1, "bytes_sent": 2**20, "wait_s": 3.0}

    def line(held_by):
        return _progress_line("w0", at, record, SyncReport(2, [a.peer_id, b.peer_id], True, 2, 1.0,
                                                           held_by=held_by), a)
    assert line((b.peer_id, 1.25)).endswith(" group 2 held up 1.2s by slow-host")
    assert line((a.peer_id, HELD_SHOWN_S)).endswith(f" held up {HELD_SHOWN_S:.1f}s by w0")
    assert "held up" not in line((b.peer_id, HELD_SHOWN_S / 2)) and "held up" not in line(None)


def test_sigkilled_peer_does_not_stall_the_others(workers):
    timeout = 3.0
    w = workers({"name": "noloco", "every": 10}, steps=150, num_workers=4, timeout=timeout)
    procs = [w.start(i) for i in range(4)]
    wait_for_round(w, 3, 2, procs[3])
    procs[3].send_signal(signal.SIGKILL)
    procs[3].wait()
    killed_at = time.monotonic()
    for i in range(3):
        assert procs[i].wait(timeout=180) == 0, w.log(i)
    for i in range(3):
        records = w.metrics(i)
        syncs = [r for r in records if "group_size" in r]
        waits = [b["wait_s"] - a["wait_s"] for a, b in zip(syncs, syncs[1:])]
        assert max(waits) < 1.5 * timeout + 2.0, waits  # a dead partner costs at most one timeout per round
        vals = val_losses(records)
        assert vals[-1] < min(vals[:3]), vals  # still improving after the kill
    assert time.monotonic() - killed_at < 120


def test_a_frozen_diloco_peer_is_waited_out_the_others_commit_without_it_and_all_end_identical(workers):
    """w2 is SIGSTOPped mid-run (alive, connected, silent): w0 and w1 commit averages of the two of them
    and go on; woken, w2 rejoins and all three end identical (which of them takes whose state by a repair
    depends on who commits the first round after the wake: w2, or w0 and w1 when w2 averages with one).
    Stopped with a DHT call under way, w2 hangs its DHT node too (decentral.swarm.membership): then a
    round's two member lookups may each wait out a DHT request to it, and its stop outlasts its heartbeat:
    it comes back as a newcomer, so the run leaves it 10+ rounds to rejoin in (a pair's round takes ~0.2 s
    here; once, with 5 rounds left, w0 and w1 had ended before w2 asked for their state)."""
    timeout = 3.0
    w = workers({"name": "diloco", "every": 10}, steps=240, num_workers=3, timeout=timeout)
    procs = [w.start(i) for i in range(3)]
    wait_for_round(w, 2, 3, procs[2])
    procs[2].send_signal(signal.SIGSTOP)
    stopped = len(w.metrics(0))
    deadline = time.monotonic() + 60
    while not any(r.get("group_size") == 2 and r["complete"] for r in w.metrics(0)[stopped:]):
        assert time.monotonic() < deadline and procs[0].poll() is None, w.log(0)
        time.sleep(0.1)  # polling w0's metrics for a round the two of them committed
    procs[2].send_signal(signal.SIGCONT)
    assert w.wait(timeout=180) == {0: 0, 1: 0, 2: 0}, w.log(2)
    digests = [{r["round"]: r["digest"] for r in w.metrics(i) if "digest" in r} for i in range(3)]
    last = max(digests[2])
    assert digests[0][last] == digests[1][last] == digests[2][last]  # w2 ends as one of them again
    for i in (0, 1):
        syncs = [r for r in w.metrics(i) if "group_size" in r]
        waits = [b["wait_s"] - a["wait_s"] for a, b in zip(syncs, syncs[1:])]
        assert max(waits) < timeout + 2 * DHT_RPC_TIMEOUT_S + 2.0, waits  # waited out once per round at most


def test_a_peer_left_without_partners_says_it_trains_on_alone(workers):
    """w0 ends after 40 steps, w1 trains on to 80: w1's first sync with nobody else is a line in its log (a
    step line's "group 1" was all a user saw before), and w0 never says it."""
    w = workers({"name": "diloco", "every": 10}, steps=80, num_workers=2, timeout=10.0)
    w.start(0, steps=40)
    w.start(1)
    assert w.wait(timeout=180) == {0: 0, 1: 0}, w.log(1)
    syncs = [r for r in w.metrics(1) if "group_size" in r]
    alone = next(r for r in syncs if r["group_size"] == 1)
    assert syncs[0]["group_size"] == 2 and alone["step"] > 40, syncs
    said = [line for line in w.log(1).splitlines() if "training on alone" in line]
    assert len(said) == 1, w.log(1)
    assert said[0].startswith(f"[w1] step {alone['step']} round {alone['round']}: no other member took part"), said
    assert "training on alone" not in w.log(0)


def test_late_joiner_continues_the_swarms_round_step_and_weights(workers):
    every = 20
    w = workers({"name": "diloco", "every": every}, steps=12 * every, num_workers=3)
    # The incumbents' frames wait 120 ms each, so a round takes 0.7 s or more however fast the machine
    # trains. The joiner starts when they reach round 3, forked like them from `prefork`: its imports
    # done (a fresh Python took 9 s on an H200 machine, longer than the incumbents' last 9 rounds).
    procs = [w.start(i, min_peers=2, env={"DECENTRAL_LINK_LATENCY_MS": "120"}) for i in (0, 1)]
    wait_for_round(w, 0, 3, procs[0])
    w.start(2, min_peers=1)
    assert w.wait(timeout=300) == {0: 0, 1: 0, 2: 0}, w.log(2)
    late = w.metrics(2)
    first = late[0]
    # the swarm's round and step: at its boundary, or into it (it trains the rest, a member of that round when
    # at most half of it was done, else an onlooker that averages from the next round on)
    assert first["round"] >= 3 and every * first["round"] <= first["step"] < every * (first["round"] + 1), first
    assert all(r["step"] % every == 0 for r in late if "group_size" in r)  # it syncs at the swarm's boundaries
    assert late[-1]["step"] == 12 * every  # --steps is the swarm's total: it stopped with the others
    fresh = fresh_val_loss(w, 2)
    assert val_losses(late)[0] < fresh - 0.5, (late[:3], fresh)
    joined = min(r["round"] for r in late if r.get("group_size") == 3)  # its first round with the others
    for i in (0, 1):  # which the incumbents did not have to wait out: it was complete for them
        assert [r["complete"] for r in w.metrics(i) if r.get("round") == joined and "complete" in r] == [True], i
    # The joiner either averaged with them, or (joined half a round in, its announcement too late for the
    # incumbents' member list) was left out and took their state of that round: from then on it holds theirs.
    digests = [{r["round"]: r["digest"] for r in w.metrics(i) if "digest" in r} for i in range(3)]
    assert all(digests[2][r] == digests[0][r] == digests[1][r] for r in digests[2] if r >= joined), digests


def test_a_newcomer_that_cannot_get_the_swarms_state_stops_with_an_error_and_trains_nothing(workers, prefork, tmp_path):
    """The swarm's one trainer is SIGKILLed and its heartbeat outlives it: a newcomer joining through an
    entry peer (DHT only) sees the swarm ahead of it and cannot download its state. It asks again until
    that heartbeat expires, then stops with exit code 2 and a line that says why, having trained nothing
    (before, it went on from step 0 and trained the whole run on its own: the last restart of a soak)."""
    timeout = 9.0  # the swarm's timeout: how long the newcomer asks, and about how long a heartbeat lives
    w = workers({"name": "diloco", "every": 5}, steps=100_000, num_workers=2, timeout=timeout)
    run = yaml.safe_load(w.recipe.read_text())["swarm"]["run"]
    entry_log = tmp_path / "entry.log"
    entry = prefork.spawn(["swarm", "start", "--run", run, "--host", "127.0.0.1"], entry_log)
    try:
        wait_until(lambda: entry_log.exists() and "--join" in entry_log.read_text(), 120, "the entry peer's multiaddr")
        join = [re.search(r"--join (\S+)", entry_log.read_text()).group(1)]
        trainer = w.start(0, min_peers=1, join=join)
        wait_for_round(w, 0, 2, trainer)
        trainer.kill()
        trainer.wait()
        newcomer = w.start(1, min_peers=1, join=join)
        assert newcomer.wait(timeout=3 * timeout + 60) == 2, w.log(1)
    finally:
        entry.kill()
    assert "handed over its state" in w.log(1), w.log(1)
    assert not [r for r in w.metrics(1) if "loss" in r]  # not one step trained alone


def test_a_newcomer_with_another_model_stops_in_one_line_and_trains_nothing(workers):
    """A newcomer whose recipe shapes another model than the swarm's (here a wider d_model) cannot take the
    state a member hands over: exit code 2 and one line saying the recipes differ (it was a traceback)."""
    w = workers({"name": "diloco", "every": 5}, steps=100_000, num_workers=2)
    member = w.start(0, min_peers=1)
    try:
        wait_for_round(w, 0, 1, member)
        newcomer = w.start(1, min_peers=1, extra=["--set", "model.d_model=48"])
        assert newcomer.wait(timeout=120) == 2, w.log(1)
    finally:
        w.kill_all()
    said = [line for line in w.log(1).splitlines() if "recipes differ" in line]
    assert len(said) == 1 and said[0].startswith("decentral: the swarm's model has"), w.log(1)
    assert "Traceback" not in w.log(1)
    assert not [r for r in w.metrics(1) if "loss" in r]


def test_resume_continues_from_the_checkpoint(workers):
    w = workers({"name": "diloco", "every": 10}, steps=20, num_workers=1)
    w.start(0)
    assert w.wait(timeout=120) == {0: 0}, w.log(0)
    tensors, meta = load_checkpoint(w.root / "w0" / "checkpoint")
    assert meta["sync"]["step"] == 20 and meta["sync"]["round"] == 2
    done = w.server.run(["train", "--protocol", str(w.recipe), "--out", str(w.root / "w0"), "--data", str(w.data),
                         "--steps", "40", "--resume"], w.root, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    _, meta = load_checkpoint(w.root / "w0" / "checkpoint")
    assert meta["sync"]["step"] == 40 and meta["sync"]["round"] == 4
    steps = [r["step"] for r in w.metrics(0) if "loss" in r]
    assert steps == list(range(1, 41))  # the second run went on at step 21
    first_id = re.search(r"peer (\S+) starts at", w.log(0)).group(1)
    assert f"peer {first_id} starts at" in done.stdout  # the same peer id: no ghost of the first run


@pytest.mark.parametrize("stop", ["a second signal while it stops", "SIGTERM to each of its processes"])
def test_a_stopped_worker_saves_its_checkpoint_once_and_exits_without_a_traceback(workers, stop):
    """A terminal's Ctrl-C reaches a launcher (`demo`, an island's ranks) and its workers alike, and the
    launcher then sends each worker SIGTERM (the worker takes SIGINT and SIGTERM alike): that second signal
    cut the worker's goodbye and exit short (a KeyboardInterrupt traceback). SIGTERM to the whole process
    group (`timeout`, a batch scheduler's cancel) reaches the worker's DHT process too, which died with a
    traceback of its own. Either way the worker stops once, exit code 130, its checkpoint at the step it says."""
    w = workers({"name": "diloco", "every": 5}, steps=100_000, num_workers=1)
    proc = w.start(0, min_peers=1)
    try:
        wait_until(lambda: [r for r in w.metrics(0) if r.get("step", 0) >= 3] or proc.poll() is not None, 120,
                   "three steps")
        if stop == "SIGTERM to each of its processes":
            for pid in [proc.pid, *descendants(proc.pid)]:
                os.kill(pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: "interrupted at step" in w.log(0) or proc.poll() is not None, 60, "the save")
            proc.send_signal(signal.SIGTERM)  # as the launcher's comes: while the worker leaves the swarm and exits
        assert proc.wait(timeout=60) == 130, w.log(0)
    finally:
        w.kill_all()
    said = w.log(0)
    assert said.count("interrupted at step") == 1, said
    assert "KeyboardInterrupt" not in said and "Process _DHTProcess" not in said and "Exception ignored" not in said, \
        said  # (a process killed mid-handshake may still cost multiprocessing's fd-sharing thread a traceback)
    step = int(re.search(r"interrupted at step (\d+); checkpoint saved", said).group(1))
    assert load_checkpoint(w.root / "w0" / "checkpoint")[1]["sync"]["step"] == step >= 3


def test_a_worker_stopped_while_it_waits_for_peers_saves_nothing_and_its_rerun_starts(workers):
    """Stopped before its first step (here while it waits for --min-peers), a worker saved a checkpoint of step 0,
    and the same command run again was refused: the --out held an earlier run. Nothing trained, nothing saved.
    Stopped by SIGHUP (its terminal closed), which ended it at once with 129 (SIGTERM: the test above)."""
    w = workers({"name": "diloco", "every": 5}, steps=100_000, num_workers=2)
    proc = w.start(0, min_peers=2)
    try:
        wait_until(lambda: "waiting for 2 peers" in w.log(0) or proc.poll() is not None, 120, "the wait for peers")
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=60) == 130, w.log(0)
    finally:
        w.kill_all()
    assert "interrupted before training a step; nothing saved" in w.log(0), w.log(0)
    assert not checkpoint_present(w.root / "w0" / "checkpoint")
    w.start(0, steps=5, min_peers=1, join=[])  # (not through the address it had)
    assert w.wait(timeout=120) == {0: 0}, w.log(0)


def test_corrupt_checkpoint_is_a_clear_error(workers):
    w = workers({"name": "diloco", "every": 10}, steps=10, num_workers=1)
    w.start(0)
    assert w.wait(timeout=120) == {0: 0}, w.log(0)
    blob = w.root / "w0" / "checkpoint" / "tensors.safetensors"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    done = w.server.run(["train", "--protocol", str(w.recipe), "--out", str(w.root / "w0"), "--data", str(w.data),
                         "--steps", "20", "--resume"], w.root, timeout=120)  # (at --steps 10 nothing would train)
    assert done.returncode != 0
    assert "checksum" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from Linux /proc")
def test_a_sigkilled_worker_leaves_no_process_behind(workers):
    """hivemind runs the DHT and its libp2p daemon in child processes; they must not outlive a worker
    killed with SIGKILL (or by the OOM killer)."""
    w = workers({"name": "noloco", "every": 10}, steps=100_000, num_workers=1)
    proc = w.start(0)  # returns once the worker has joined its swarm: its DHT process and daemon are up
    children = descendants(proc.pid)
    assert children, "the worker has no child processes to check"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while any(running(pid) for pid in children):
        assert time.monotonic() < deadline, [Path(f"/proc/{p}/cmdline").read_text() for p in children if running(p)]
        time.sleep(0.2)  # polling for other processes to exit


def test_a_newcomer_whose_last_step_the_swarm_has_passed_trains_nothing_and_says_so(tmp_path, small_corpus):
    """--steps is the swarm's total: a newcomer given 20 while the swarm is at step 30 would train nothing (it
    said 'done' and exited 0, a checkpoint written). Two workers of one loopback hub; the first waits at its
    step 30 until the newcomer has stopped."""
    recipe = parse_recipe({"protocol": {"name": "diloco", "every": 10}, "train": {**TINY_TRAIN, "steps": 40},
                           "model": TINY_MODEL})
    hub, at_30, newcomer_done = LoopbackHub(timeout_s=30.0), threading.Event(), threading.Event()

    def first_worker_line(line: str) -> None:
        if " step    30 " in line:
            at_30.set()
            assert newcomer_done.wait(timeout=120)

    transports = [hub.transport(), hub.transport()]
    first = threading.Thread(target=run_worker, args=(recipe, WorkerOptions(
        out=tmp_path / "w0", data=[str(small_corpus)], name="w0", print_fn=first_worker_line, transport=transports[0])))
    first.start()
    try:
        assert at_30.wait(timeout=120)
        short = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, steps=20))
        with pytest.raises(RecipeError, match="the swarm is at step 30, and this run ends at step 20"):
            run_worker(short, WorkerOptions(out=tmp_path / "w1", data=[str(small_corpus)], name="w1",
                                            transport=transports[1]))
    finally:
        newcomer_done.set()
        first.join(timeout=120)
    assert not (tmp_path / "w1" / "checkpoint").exists()


def test_a_peer_of_another_run_joining_a_swarm_says_it_trains_alone(make_swarm, tmp_path, small_corpus):
    """A peer given another --run than the swarm it joins through (a typo) trained alone without a word. Real
    swarm peers: a member of one run, and a worker of another joining through it, who says so at its first sync."""
    member = make_swarm(1)[0]
    recipe = parse_recipe({"protocol": {"name": "diloco", "every": 5}, "train": {**TINY_TRAIN, "steps": 5},
                           "model": TINY_MODEL, "swarm": {"run": "another"}})
    join = [str(m) for m in member.multiaddrs()]
    stranger = SwarmTransport("another", join, timeout=10.0, heartbeat_s=0.5)
    said = []
    run_worker(recipe, WorkerOptions(out=tmp_path, data=[str(small_corpus)], join=join, print_fn=said.append,
                                     transport=stranger))
    assert [line for line in said if "no member of run 'another' is in the swarm joined through --join" in line], said


def test_a_newcomer_of_another_setup_stops_before_it_downloads_the_swarms_state(make_swarm, tmp_path, small_corpus):
    """The setup was compared once the newcomer had joined: it downloaded the swarm's state first (for a large
    model, minutes on a slow link) and then stopped. A member's setup in view already stops it before. Real swarm
    peers: a member of codec int8 that offers a state of the model's size, and a worker in float16 joining it."""
    member = make_swarm(1)[0]

    def recipe(codec: str):
        return parse_recipe({"protocol": {"name": "diloco", "every": 5}, "train": {**TINY_TRAIN, "steps": 20},
                             "model": TINY_MODEL, "swarm": {"run": member.peer.run, "codec": codec}})

    options = WorkerOptions(out=tmp_path, data=[str(small_corpus)], join=[str(m) for m in member.multiaddrs()])
    member.set_card(True, setup=_swarm_setup(recipe("int8"), options))
    numel = sum(p.numel() for p in GPT(GPTConfig(**TINY_MODEL)).parameters())
    state = {"slow": torch.zeros(numel), "momentum": torch.zeros(numel)}
    member.offer_state({"protocol": "diloco", "round": 2, "step": 10}, state)
    member.set_progress(10, 2)
    newcomer = SwarmTransport(member.peer.run, options.join, timeout=10.0, heartbeat_s=0.5)
    wait_until(lambda: "setup" in newcomer.progress().get(member.peer_id, {}), 30, "the member's setup in its heartbeat")
    with pytest.raises(SwarmError, match=r"swarm.codec int8 there, float16 here"):
        run_worker(recipe("float16"), dataclasses.replace(options, transport=newcomer))
    assert newcomer.bytes_received < numel * 4  # not even the state's weights


def test_a_member_of_another_round_length_or_outer_step_is_refused_in_one_line(make_swarm, tmp_path):
    """A DiLoCo member joining with every=10 a swarm that averages every 20 averaged each round with the
    others' round of another length (both said group 2, their waits grew round by round); one of another outer
    lr applied the same averages otherwise, and the replicas parted (and repaired) every round. The newcomer now
    stops naming each setting that differs; where a member keeps its outer state is its own. Two real swarm
    peers: one publishes its setup as a member does."""
    member, newcomer = make_swarm(2)
    options = WorkerOptions(out=tmp_path)

    def recipe(**protocol):
        return parse_recipe({"protocol": {"name": "diloco", "every": 20, **protocol}, "train": TINY_TRAIN,
                             "model": TINY_MODEL})

    member.set_card(True, setup=_swarm_setup(recipe(), options))
    wait_until(lambda: "setup" in newcomer.progress().get(member.peer_id, {}), 30, "the member's setup in its heartbeat")
    _check_same_setup(newcomer, _swarm_setup(recipe(outer_on_device=True), options), "r")  # nothing said
    with pytest.raises(SwarmError, match=r"averages otherwise than this peer \(protocol.every 20 there, 10 here; "
                                         r"protocol.outer_lr 0.7 there, 1.0 here\): the members of a run use one "
                                         r"protocol with the same settings \(but outer_on_device\) and codec"):
        _check_same_setup(newcomer, _swarm_setup(recipe(every=10, outer_lr=1.0), options), "r")


def test_a_member_of_another_codec_is_refused_in_one_line_and_an_older_members_card_is_not(make_swarm, tmp_path):
    """Members in two codecs (int8 and float16, or top-k of two densities) refuse each other's parts, and each
    went on training alone, a warning a round; the newcomer now stops naming both. A member's setup that names
    no codec (an older version's) is compared on what it names."""
    member, newcomer = make_swarm(2)
    options = WorkerOptions(out=tmp_path)

    def recipe(codec: str):
        return parse_recipe({"protocol": {"name": "diloco", "every": 20}, "train": TINY_TRAIN, "model": TINY_MODEL,
                             "swarm": {"codec": codec}})

    member.set_card(True, setup=_swarm_setup(recipe("topk:0.02"), options))
    wait_until(lambda: "setup" in newcomer.progress().get(member.peer_id, {}), 30, "the member's setup in its heartbeat")
    _check_same_setup(newcomer, _swarm_setup(recipe("topk:0.020"), options), "r")  # the same codec, written otherwise
    for other, said in (("topk", "topk:0.01"), ("int8", "int8")):
        with pytest.raises(SwarmError, match=f"averages otherwise than this peer \\(swarm.codec topk:0.02 there, "
                                             f"{said} here\\)"):
            _check_same_setup(newcomer, _swarm_setup(recipe(other), options), "r")
    older = {k: v for k, v in _swarm_setup(recipe("topk:0.02"), options).items() if k != "swarm.codec"}
    member.set_card(True, setup=older)
    wait_until(lambda: "swarm.codec" not in newcomer.progress()[member.peer_id]["setup"], 30, "the older member's setup")
    _check_same_setup(newcomer, _swarm_setup(recipe("int8"), options), "r")
