"""`decentral status` on a live keyed swarm of real `decentral train` processes: it lists every peer from
their heartbeats (step, round, loss, rates, addresses) without becoming a member, and a reader without
the swarm's key gets a one-line error."""

import io
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import free_port

from decentral.swarm import AdmissionError, SwarmKey, SwarmPeer
from decentral.swarm.membership import EntryBeacon, Membership
from decentral.swarm.monitor import (
    BYTES_WINDOW_S, HELD_ROUNDS, WINDOW_S, StatusCard, SwarmMonitor, format_table, held_up, watch,
)


def status(*args: str, tmp: Path | None = None) -> subprocess.Popen:
    """`decentral status ARGS`, its temporary files (the monitor's identity) in `tmp` when given."""
    env = {k: v for k, v in os.environ.items() if k != "DECENTRAL_SWARM_KEY"} | ({"TMPDIR": str(tmp)} if tmp else {})
    return subprocess.Popen([sys.executable, "-m", "decentral", "status", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def status_until(condition, args, timeout: float = 30.0) -> list[dict]:
    """`status --json` run again (each a new process) until its peers meet `condition`; those peers."""
    deadline = time.monotonic() + timeout
    while True:
        proc = status(*args, "--json")
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        peers = json.loads(out)["peers"]
        if condition(peers):
            return peers
        assert time.monotonic() < deadline, peers


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout}s"
        time.sleep(0.2)  # polling files other processes write


def test_status_shows_a_live_keyed_swarm_without_joining_it(workers, tmp_path):
    key = tmp_path / "swarm.key"
    SwarmKey.generate(key)
    w = workers({"name": "diloco", "every": 10}, steps=100_000, num_workers=3)
    run = yaml.safe_load(w.recipe.read_text())["swarm"]["run"]
    procs = [w.start(i, extra=["--swarm-key", str(key)]) for i in range(3)]
    wait_for(lambda: all(len(w.metrics(i)) > 1 for i in range(3)) or any(p.poll() is not None for p in procs), 60,
             "every worker training")
    assert all(p.poll() is None for p in procs), [w.log(i) for i in range(3)]
    for p in procs:  # their training threads yield the CPU to the monitor's processes (their network threads do not)
        os.setpriority(os.PRIO_PROCESS, p.pid, 10)
    maddrs = {f"w{i}": (w.root / f"w{i}.maddrs").read_text().split() for i in range(3)}
    args = ["--join", w.bootstrap[0], "--run", run]

    keyless = status(*args, "--json")
    first = status_until(lambda peers: len(peers) == 3 and all(p["loss"] is not None for p in peers),
                         [*args, "--swarm-key", str(key)])
    assert [p["name"] for p in first] == ["w0", "w1", "w2"]
    for p in first:
        assert p["state"] == "alive" and math.isfinite(p["loss"]) and p["last_seen_s"] < 10, p
        assert p["addrs"] == maddrs[p["name"]] and p["addrs"][0].endswith("/p2p/" + p["id"]), (p, maddrs)
    out, err = keyless.communicate(timeout=60)
    assert keyless.returncode == 2 and out == "", out
    assert len(err.strip().splitlines()) == 1 and "--swarm-key" in err, err
    watch = Path(tempfile.mkdtemp(prefix="watch"))  # TMPDIR: torch's shared-memory socket fails under a long one
    watching = status(*args, "--swarm-key", str(key), "--interval", "1", tmp=watch)
    table = watching.stdout.readline() + watching.stdout.readline()
    assert "peers alive" in table, table + ("" if watching.poll() is None else watching.stderr.read())  # it is up
    watching.terminate()  # as `timeout` does: the watch ends as on Ctrl-C, its identity key removed
    assert watching.wait(60) == 0 and not list(watch.glob("decentral-monitor-*"))
    shutil.rmtree(watch, ignore_errors=True)  # torch's shared-memory manager may still be removing its socket

    before = {p["id"]: p["step"] for p in first}  # then the library's monitor, which the command prints
    monitor = SwarmMonitor(run, w.bootstrap, swarm_key=SwarmKey.load(key))
    try:
        deadline = time.monotonic() + 30
        second = monitor.rows()
        while not all(p["step"] > before[p["id"]] and p["tokens_per_s"] for p in second):
            assert time.monotonic() < deadline, second
            time.sleep(0.5)  # the peers' next heartbeats
            second = monitor.rows()
        wait_for(lambda: sum(p["held_s"] or 0 for p in monitor.rows()) > 0, 30, "cards saying who held the "
                 "averages up")
        assert all(p["held_s"] is not None for p in monitor.rows())  # (0 for a peer no card names)
    finally:
        monitor.close()
    assert {p["id"] for p in second} == set(before)
    for p in second:
        assert math.isfinite(p["loss"]) and p["tokens_per_s"] > 0 and p["sent_per_s"] is not None, p

    # the monitor is no member: every average after it looked is over the 3 peers, complete
    looked = max(p["round"] for p in second)
    wait_for(lambda: all(any(r.get("round", 0) > looked + 1 and "group_size" in r for r in w.metrics(i))
                         for i in range(3)), 60, "two more rounds on every worker")
    for i in range(3):
        syncs = [r for r in w.metrics(i) if "group_size" in r]
        assert all(r["group_size"] <= 3 for r in syncs), syncs
        late = [r for r in syncs if r["round"] > looked]
        assert late and all(r["group_size"] == 3 and r["complete"] for r in late), late


def test_monitor_shows_peers_without_a_card_and_peers_that_left(make_swarm):
    a, b = make_swarm(2)  # an open swarm of peers that publish no card (as older versions do)
    b.set_card(name=7, addrs="x", loss="high", tokens_per_s=float("nan"))  # nonsense is shown as unknown
    with pytest.raises(ValueError, match="at most"):
        b.set_card(name="x" * 4000)  # a heartbeat stays small
    monitor = SwarmMonitor(a.peer.run, a.multiaddrs())
    try:
        rows = {r["id"]: r for r in monitor.rows()}
        assert set(rows) == {a.peer_id, b.peer_id} and set(a.progress()) == {a.peer_id, b.peer_id}
        for r in rows.values():
            assert r["state"] == "alive" and r["name"] is None and r["addrs"] == [] and r["loss"] is None, r
            assert r["tokens_per_s"] is None and r["step"] == 0
        b.close()
        wait_for(lambda: {r["id"]: r["state"] for r in monitor.rows()} == {a.peer_id: "alive", b.peer_id: "left"},
                 10, "b listed as left")
        table = io.StringIO()
        watch(monitor, interval_s=1.0, as_json=False, once=True, out=table)
        lines = table.getvalue().splitlines()
        assert lines[0].startswith(f"run {a.peer.run!r}: 1 peer alive") and lines[1].split()[:3] == ["PEER", "NAME", "STATE"]
        assert sorted(line.split()[:3] for line in lines[2:]) == sorted([[a.peer_id[-8:], "-", "alive"],
                                                                          [b.peer_id[-8:], "-", "left"]]), lines
    finally:
        monitor.close()


def test_a_peer_that_left_stays_listed_as_left_and_a_swarm_gone_says_so_in_the_title():
    """A left peer vanished once its "left" record expired; once every node of the swarm was gone, the table
    said "0 peers alive" for ever, as if the swarm were merely idle."""
    run = f"test-{time.monotonic_ns()}"
    a = SwarmPeer(run)
    b = SwarmPeer(run, a.multiaddrs())
    beats = [Membership(a, heartbeat_s=0.5), Membership(b, heartbeat_s=0.5, expire_s=3.0)]  # b's "left": for 3 s
    monitor = SwarmMonitor(run, a.multiaddrs())
    try:
        wait_for(lambda: len(monitor.rows()) == 2, 10, "both peers listed")
        beats.pop().close()
        wait_for(lambda: {r["id"]: r["state"] for r in monitor.rows()}[b.peer_id] == "left", 3, "b listed as left")
        wait_for(lambda: b.peer_id not in a.lookup("peers"), 10, "b's record expiring")
        assert {r["id"]: r["state"] for r in monitor.rows()} == {a.peer_id: "alive", b.peer_id: "left"}
        assert monitor.reachable()
        b.shutdown()
        beats.pop().close()
        a.shutdown()

        def cut_off() -> bool:
            monitor.rows()  # a node that does not answer its request leaves the routing table
            return not monitor.reachable()

        wait_for(cut_off, 10, "the monitor's DHT knowing no node that answers")
        table = io.StringIO()
        watch(monitor, interval_s=1.0, as_json=False, once=True, out=table)
        title, _, *rows = table.getvalue().splitlines()
        assert title.endswith("no peer of the swarm answers (all gone, or unreachable from here)"), title
        assert [b.peer_id[-8:], "-", "left"] in [row.split()[:3] for row in rows], rows
    finally:
        for membership in beats:
            membership.close()
        monitor.close()
        b.shutdown()
        a.shutdown()


def test_a_monitor_cut_off_finds_the_swarm_again_when_a_peer_comes_back_at_its_join_address(tmp_path):
    """Once every peer was gone, the monitor's DHT knew nobody and never joined again: a swarm restarted at
    the --join address (same identity and port) stayed "no peer of the swarm answers" for ever."""
    run, port = f"test-{time.monotonic_ns()}", free_port()

    def start() -> tuple[SwarmPeer, Membership]:
        peer = SwarmPeer(run, port=port, identity_path=tmp_path / "w0.key")
        return peer, Membership(peer, heartbeat_s=0.5)

    peer, beat = start()
    monitor = SwarmMonitor(run, peer.multiaddrs(), rejoin_s=1.0)
    try:
        wait_for(lambda: [r["state"] for r in monitor.rows()] == ["alive"], 10, "the peer listed as alive")
        beat.close()
        peer.shutdown()

        def cut_off() -> bool:
            monitor.rows()  # a node that does not answer its request leaves the routing table
            return not monitor.reachable()

        wait_for(cut_off, 10, "the monitor's DHT knowing no node that answers")
        peer, beat = start()
        wait_for(lambda: [r["state"] for r in monitor.rows()] == ["alive"] and monitor.reachable(), 15,
                 "the restarted peer listed as alive")
        table = io.StringIO()
        watch(monitor, interval_s=1.0, as_json=False, once=True, out=table)
        assert table.getvalue().startswith(f"run {run!r}: 1 peer alive") and "answers" not in table.getvalue()
    finally:
        beat.close()
        monitor.close()
        peer.shutdown()


def test_a_monitor_cut_off_reads_on_while_it_joins_again_through_an_address_that_never_answers(tmp_path):
    """A join through an address that accepts and stays silent (as one that drops packets) lasts until a
    timeout: `rows` returned only after it. Now the join runs in the background and the rows are read meanwhile."""
    run, port = f"test-{time.monotonic_ns()}", free_port()

    def start() -> tuple[SwarmPeer, Membership]:
        peer = SwarmPeer(run, port=port, identity_path=tmp_path / "w0.key")
        return peer, Membership(peer, heartbeat_s=0.5)

    peer, beat = start()
    monitor = SwarmMonitor(run, peer.multiaddrs(), rejoin_s=0.5, startup_timeout=60.0)
    silent, held = socket.socket(), []
    try:
        wait_for(lambda: [r["state"] for r in monitor.rows()] == ["alive"], 10, "the peer listed as alive")
        beat.close()
        peer.shutdown()
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        silent.bind(("127.0.0.1", port))  # the peer's address now accepts connections and says nothing
        silent.listen(16)

        def accept_until_closed() -> None:
            try:
                while True:
                    held.append(silent.accept())
            except OSError:  # closed
                pass

        threading.Thread(target=accept_until_closed, daemon=True).start()

        def joining_while_rows_are_read() -> bool:
            states = [r["state"] for r in monitor.rows()]
            return monitor.rejoining and states == ["gone"]  # rows read while the join is still under way

        wait_for(joining_while_rows_are_read, 20, "rows read while a join through the silent address is under way")
        assert held  # the join really dialled the silent address
        silent.close()
        for connection, _ in held:
            connection.close()
        peer, beat = start()
        wait_for(lambda: [r["state"] for r in monitor.rows()] == ["alive"] and monitor.reachable(), 60,
                 "the restarted peer found by a later join")
    finally:
        silent.close()
        beat.close()
        monitor.close()
        peer.shutdown()


def test_a_monitor_with_another_swarms_key_says_so_in_one_clean_line(make_swarm, tmp_path):
    (a,) = make_swarm(1, swarm_key=SwarmKey.generate(tmp_path / "ours.key"))
    theirs = SwarmKey.generate(tmp_path / "theirs.key")
    monitor = SwarmMonitor(a.peer.run, a.multiaddrs(), swarm_key=theirs)
    try:
        with pytest.raises(AdmissionError) as e:
            monitor.rows()
    finally:
        monitor.close()
    assert str(e.value) == (f"the records of run {a.peer.run!r} do not open with swarm key {theirs.fingerprint}: "
                            "the swarm has another key, or none")  # was "run 'test-1''s records"


@pytest.mark.parametrize("entry_keyed", [True, False])
def test_an_entrys_mark_alone_tells_a_reader_whether_its_key_opens_the_swarm(tmp_path, entry_keyed):
    """Through a `swarm start` entry before anyone trains, a peer without the swarm's key (or with one where the
    swarm has none) saw no record at all, so it trained alone: the entry's mark now says so, and lists nobody."""
    ours = SwarmKey.generate(tmp_path / "ours.key")
    opens, wrong = (ours, None) if entry_keyed else (None, ours)
    run = f"test-{time.monotonic_ns()}"
    entry = SwarmPeer(run, swarm_key=opens)
    beacon = EntryBeacon(entry)
    readers = [SwarmMonitor(run, entry.multiaddrs(), swarm_key=key) for key in (opens, wrong)]
    try:
        assert readers[0].rows() == []  # the entry is no member
        with pytest.raises(AdmissionError, match="is keyed" if entry_keyed else "do not open with swarm key"):
            readers[1].rows()
    finally:
        for reader in readers:
            reader.close()
        beacon.close()
        entry.shutdown()


class CardRecorder:
    """A transport's counters and card, as StatusCard uses them."""

    def __init__(self):
        self.bytes_sent = self.bytes_received = 0
        self.card, self.published = {}, 0

    def multiaddrs(self):
        return ["/ip4/127.0.0.1/tcp/1/p2p/Qm" + "x" * 300, *["/ip4/10.0.0.1/tcp/2"] * 9]

    def set_card(self, now=True, **fields):
        self.card.update(fields)
        self.published += now


def test_a_status_card_reports_window_means_and_rates_and_never_publishes_by_itself():
    t = CardRecorder()
    card = StatusCard(t, "n" * 500, tokens_per_step=256)
    assert len(t.card["name"]) == 64 and len(t.card["addrs"]) == 4 and len(t.card["addrs"][0]) == 256
    card.update(5.0, 100.0)  # the first step: its loss, no rates yet
    assert t.card["loss"] == 5.0 and "tokens_per_s" not in t.card
    for i in range(1, 7):  # six more steps over 3 s, 1000 bytes out and 500 in each
        t.bytes_sent, t.bytes_received = 1000 * i, 500 * i
        card.update(float(i), 100.0 + WINDOW_S * i / 6)
    assert t.card["loss"] == 3.5 and t.card["tokens_per_s"] == 6 * 256 / WINDOW_S
    assert t.card["sent_per_s"] == 6000 / WINDOW_S and t.card["received_per_s"] == 3000 / WINDOW_S
    assert t.published == 0  # the next regular heartbeat carries the card


def test_a_status_card_sums_who_held_its_latest_averages_up():
    t = CardRecorder()
    card = StatusCard(t, "peer", tokens_per_step=256)
    card.synced(None)  # an average nobody timed (alone, or rolled back): not counted
    assert "held" not in t.card
    for seconds in (1.0, 2.0):
        card.synced(("Qmslow", seconds))
    card.synced(("Qmother", 0.25))
    assert t.card["held"] == {"rounds": 3, "by": {"Qmslow": 3.0, "Qmother": 0.25}}
    for _ in range(HELD_ROUNDS):
        card.synced(("Qmslow", 0.5))
    assert t.card["held"] == {"rounds": HELD_ROUNDS, "by": {"Qmslow": 0.5 * HELD_ROUNDS}}  # the latest only
    assert t.published == 0  # the next regular heartbeat carries it


def test_the_monitor_divides_the_seconds_each_peer_held_up_by_the_averages_the_cards_cover():
    cards = {"a": {"held": {"rounds": 4, "by": {"c": 4.0, "a": 0.2}}}, "b": {"held": {"rounds": 2, "by": {"c": 2.0}}},
             "c": {"step": 3},  # (an older card: says nothing)
             "d": {"held": {"rounds": "8", "by": {"c": 100.0}}}, "e": {"held": {"rounds": 2, "by": {"c": -5.0}}}}
    assert held_up(cards) == {"c": pytest.approx(6.0 / 8), "a": pytest.approx(0.2 / 8)}  # d's is not a count
    assert held_up({"c": {"step": 3}}) is None
    row = {"id": "Qm" + "c" * 44, "name": "w3", "state": "alive", "addrs": [], "step": 3, "round": 1, "loss": 2.0,
           "tokens_per_s": 100.0, "sent_per_s": 10.0, "received_per_s": 10.0, "last_seen_s": 1.0, "clock_s": 0.0}
    header, line = format_table("run", [{**row, "held_s": 0.75}]).splitlines()[1:]
    assert line[header.index("HELD"):].split()[0] == "0.75s"
    header, line = format_table("run", [{**row, "held_s": None}]).splitlines()[1:]
    assert line[header.index("HELD"):].split()[0] == "-"


def test_a_status_cards_byte_rates_show_a_sync_burst_for_a_minute_then_nothing():
    """A peer sends in one burst per sync: a window of a few seconds before a heartbeat would mostly read 0 B/s."""
    t = CardRecorder()
    card = StatusCard(t, "peer", tokens_per_step=256)
    card.update(1.0, 0.0)
    t.bytes_sent = 600_000  # one sync, in the first window
    rates = []
    for now in range(3, 100, 3):  # a step every 3 s (each ends a window), nothing more sent
        card.update(1.0, float(now))
        rates.append((now, t.card["sent_per_s"]))
    assert all(rate == pytest.approx(600_000 / now, rel=1e-3) for now, rate in rates if now <= BYTES_WINDOW_S)
    assert all(rate == 0 for now, rate in rates if now > BYTES_WINDOW_S)  # the burst ended over a minute ago


def test_a_swarm_with_no_peer_publishing_yet_is_a_table_of_headers():
    """`decentral status` joined through `decentral swarm start` before any trainer: no row, no crash."""
    from decentral.swarm.monitor import format_table

    lines = format_table("decentral", []).splitlines()
    assert lines[0].startswith("run 'decentral': 0 peers alive") and lines[1].split()[0] == "PEER"
    assert lines[0].endswith("no peer of this run has a record yet (is --run its name?)")  # a typo in --run too
    assert len(lines) == 2


MONITOR_OF_A_DEAD_DHT = """
import os, signal
from decentral.swarm import SwarmError, SwarmPeer
from decentral.swarm.monitor import SwarmMonitor
peer = SwarmPeer("t-monitor-dead-dht")
monitor = SwarmMonitor(peer.run, peer.multiaddrs())
os.kill(monitor.dht.pid, signal.SIGKILL)
monitor.dht.join(10)
try:
    monitor.rows()
except SwarmError as e:
    print("said:", e, flush=True)
monitor.close()
peer.shutdown()
"""


def test_a_monitor_whose_dht_process_died_says_so_instead_of_waiting_for_good():
    """Its reads called the DHT process without the live check a peer's calls make: with the process killed
    (the OOM killer), `decentral status --once` or `--json` in a script waited forever. (In a process of its own:
    the DHT processes the test worker started before this one would stall on a cross-process lock it died holding.)"""
    done = subprocess.run([sys.executable, "-c", MONITOR_OF_A_DEAD_DHT], capture_output=True, text=True, timeout=120)
    assert "said: " in done.stdout and "is gone" in done.stdout, done.stdout + done.stderr
