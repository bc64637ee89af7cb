"""Clocks that drift apart after peers joined: read with every heartbeat, and said (decentral.swarm.clocks)."""

import contextlib
import io
import logging
import multiprocessing
import re
import time

import hivemind.dht.protocol
from conftest import wait_until

from decentral.swarm import SwarmPeer
from decentral.swarm import clocks as clocks_module
from decentral.swarm import peer as peer_module
from decentral.swarm.clocks import ClockCheck
from decentral.swarm.membership import EntryBeacon, Membership
from decentral.swarm.monitor import SwarmMonitor, watch

A, B, C = "QmPeerAaaaaaaaa", "QmPeerBbbbbbbbb", "QmPeerCccccccccc"


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "decentral.swarm.clocks" and r.levelno == logging.WARNING]


def test_a_bound_beyond_the_tolerance_proves_a_clock_apart_and_one_within_it_proves_nothing(caplog):
    check = ClockCheck(tolerance_s=3.0)
    with caplog.at_level(logging.INFO, logger="decentral.swarm.clocks"):
        apart = check.check({A: (3.5, 3.6), B: (-4.2, -4.0), C: (-3.5, 2.0)})  # C: an answer too slow to tell
        assert apart == {A: 3.5, B: -4.0}
        assert check.check({A: (2.9, 3.1), B: (-3.1, -2.9)}) == {}, "within the tolerance at one end"
    said = warnings(caplog)
    assert len(said) == 1
    assert "aaaaaaaa's clock is at least 4 s ahead of ours" in said[0]  # 3.5 s, rounded
    assert "bbbbbbbb's clock is at least 4 s behind ours" in said[0]
    assert "(2 of the 3 peers whose clocks we read" in said[0]
    assert "likely the wrong one" not in said[0], "one ahead, one behind: nothing says which clock is wrong"
    assert any("agree with ours again" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def test_a_difference_that_lasts_is_said_again_only_for_a_new_peer_or_after_a_while(caplog, monkeypatch):
    check, now = ClockCheck(), [1000.0]
    monkeypatch.setattr(clocks_module.time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="decentral.swarm.clocks"):
        check.check({A: (50.0, 50.1), B: (0.0, 0.1)})
        check.check({A: (50.0, 50.1), B: (0.0, 0.1)})
        assert len(warnings(caplog)) == 1
        check.check({A: (50.0, 50.1), B: (9.0, 9.1)})
        assert len(warnings(caplog)) == 2 and "bbbbbbbb's clock is at least 9 s ahead of ours" in warnings(caplog)[1]
        now[0] += clocks_module.REPEAT_S
        check.check({A: (50.0, 50.1)})
        assert len(warnings(caplog)) == 3
    assert "likely the wrong one" not in warnings(caplog)[0], "one of two"
    assert "most clocks are apart from ours, so this machine's is likely the wrong one" in warnings(caplog)[1]


@contextlib.contextmanager
def b_jumping(monkeypatch, watcher=None):
    """(a, b, jump, watching): two peers of a new run with heartbeats every 0.5 s, b's clock (its DHT process's,
    where pings are answered and read) ahead of a's by `jump.value` seconds, 0 until the test sets it;
    `watching`: what `watcher(a)` makes, if given, before b exists (so its DHT process keeps a's clock)."""
    run = f"test-{time.monotonic_ns()}"
    a = SwarmPeer(run)
    watching = watcher(a) if watcher else None
    jump = multiprocessing.Value("d", 0.0)  # shared with b's DHT process, forked below with the patched clock

    def b_clock() -> float:
        return time.time() + jump.value

    monkeypatch.setattr(hivemind.dht.protocol, "get_dht_time", b_clock)  # b's answers to pings
    monkeypatch.setattr(peer_module, "get_dht_time", b_clock)  # b's readings (here: both peers' stores, harmless)
    b = SwarmPeer(run, a.multiaddrs())
    beats = [Membership(a, heartbeat_s=0.5), Membership(b, heartbeat_s=0.5)]
    try:
        wait_until(lambda: b.peer_id in beats[0].alive() and a.peer_id in beats[1].alive(), 30,
                   "each peer seeing the other's heartbeat")
        yield a, b, jump, watching
    finally:
        for membership in beats:
            membership.close()
        if watching is not None:
            watching.close()
        b.shutdown()
        a.shutdown()


def test_a_peer_whose_clock_jumps_after_it_joined_is_told_and_so_is_the_peer_beside_it(caplog, monkeypatch):
    """hivemind compares clocks only as a peer joins: b's clock jumping 100 s ahead later went unnoticed, while
    each side's records expired early or late at the other. Both now say so, each naming the other and which
    way its clock is off."""
    with caplog.at_level(logging.WARNING, logger="decentral.swarm.clocks"), b_jumping(monkeypatch) as (a, b, jump, _):
        jump.value = 100.0

        def told(whom: str, way: str) -> float | None:
            for message in warnings(caplog):
                found = re.search(rf"{whom[-8:]}'s clock is at least (\d+) s {way} ours", message)
                if found:
                    return float(found.group(1))
            return None

        wait_until(lambda: told(b.peer_id, "ahead of") and told(a.peer_id, "behind"), 30,
                   "both peers told that their clocks are apart")
    assert 95 <= told(b.peer_id, "ahead of") <= 100 and 95 <= told(a.peer_id, "behind") <= 100


def test_the_status_table_shows_each_peers_clock_against_the_monitors(monkeypatch):
    with b_jumping(monkeypatch, lambda a: SwarmMonitor(a.run, a.multiaddrs())) as (a, b, jump, monitor):
        jump.value = 100.0

        def clocks() -> dict:
            return {row["id"]: row["clock_s"] for row in monitor.rows()}

        wait_until(lambda: clocks().get(a.peer_id) == 0.0 and (clocks().get(b.peer_id) or 0) > 95, 30,
                   "b's clock read 100 s ahead, a's within the tolerance")
        assert clocks()[b.peer_id] <= 100
        table = io.StringIO()
        watch(monitor, interval_s=1.0, as_json=False, once=True, out=table)
        header, *rows = table.getvalue().splitlines()[1:]
        assert header.split()[-2:] == ["CLOCK", "ADDRESS"]
        shown = {row.split()[0]: row.split()[-2] for row in rows}  # (other cells hold spaces: "0s ago", "0 B")
        assert shown[a.peer_id[-8:]] == "ok" and re.fullmatch(r"\+(9[5-9]|100)s", shown[b.peer_id[-8:]]), shown


def test_an_entry_reads_the_members_clocks_too(monkeypatch):
    """A `swarm start` entry, which every newcomer joins through, read nobody's clock: its operator never heard
    that the members' clocks had gone apart from its own."""
    found: list[dict] = []

    def entry_of(a):
        entry = EntryBeacon(a, every_s=0.5)
        check = entry.clocks.check
        monkeypatch.setattr(entry.clocks, "check", lambda readings: found.append(check(readings)) or found[-1])
        return entry

    with b_jumping(monkeypatch, entry_of) as (a, b, jump, entry):
        jump.value = 100.0
        wait_until(lambda: any(95 <= proven.get(b.peer_id, 0) <= 100 for proven in found), 30,
                   "the entry finding b's clock 100 s ahead of its own")
