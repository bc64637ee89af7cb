"""A peer killed and restarted under the same peer id (its key file) between real swarm peers: a round
its killed process had announced costs the others seconds, not the timeout, however far the new
process has got (not up yet, up without handlers, up and joining a later round)."""

import time

import torch

from conftest import run_in_threads, timed_average, wait_until
from decentral.swarm import SwarmPeer


def test_a_round_the_killed_process_announced_costs_the_others_seconds_and_they_agree(make_swarm):
    a, b, restarted = make_swarm(3, timeout=30.0)
    for p in (a, b):
        p.join_rounds(4)
    restarted.join_rounds(6)  # a new process joining at round 6; the others listed its peer id for round 5
    group = sorted(p.peer_id for p in (a, b, restarted))
    xs = [torch.randn(600), torch.randn(600)]
    start = time.monotonic()
    ra, rb = run_in_threads([lambda p=p, x=x: p.average(x, group, "r5", round=5) for p, x in zip((a, b), xs)])
    assert time.monotonic() - start < 5.0  # the timeout is 30 s
    for r in (ra, rb):  # redone by the two, not rolled back
        assert r.complete and r.absent == [restarted.peer_id]
        torch.testing.assert_close(r.tensor, (xs[0] + xs[1]) / 2, rtol=0, atol=1e-6)
    assert not restarted.averager.mailbox.senders("r5/r")  # it read and dropped their parts
    later = run_in_threads([lambda p=p: p.average(torch.ones(60), group, "r6", round=6) for p in (a, b, restarted)])
    assert all(r.complete and len(r.group) == 3 for r in later)  # and takes part from its own round on


def test_a_member_whose_new_life_has_no_handlers_yet_costs_seconds(make_swarm):
    """Between its libp2p daemon coming up and its averager registering, a restarted process answers a
    dial but serves no stream: that counts as taking no part in this average."""
    a, b = make_swarm(2, timeout=30.0)
    for p in (a, b):
        p.join_rounds(0)
    starting = SwarmPeer(a.peer.run, a.multiaddrs())  # up, in the DHT, no averaging handlers
    try:
        group = sorted([a.peer_id, b.peer_id, starting.peer_id])
        xs = [torch.randn(300), torch.randn(300)]
        start = time.monotonic()
        ra, rb = run_in_threads([lambda p=p, x=x: p.average(x, group, "starting", round=0) for p, x in zip((a, b), xs)])
        assert time.monotonic() - start < 5.0
        for r in (ra, rb):
            assert r.complete and r.absent == [starting.peer_id]
            torch.testing.assert_close(r.tensor, (xs[0] + xs[1]) / 2, rtol=0, atol=1e-6)
    finally:
        starting.shutdown()


def test_a_member_restarted_after_taking_our_part_is_found_by_the_probe(make_swarm):
    """It acknowledged our pushes, then its process was replaced by a new one that joins later: the
    next probe (every second) hears "not in this round", and the others redo without it."""
    a, b, c = make_swarm(3, timeout=30.0)
    for p in (a, b, c):
        p.join_rounds(5)
    group = sorted(p.peer_id for p in (a, b, c))
    xs = [torch.randn(300), torch.randn(300)]
    start = time.monotonic()

    def restart_c():
        wait_until(lambda: {a.peer_id, b.peer_id} <= c.averager.mailbox.senders("probed/r"), 20, "both pushes to c")
        c.averager.first_round = 6  # as a new process that announced round 6 first
        return None

    ra, rb, _ = run_in_threads([lambda p=p, x=x: p.average(x, group, "probed", round=5) for p, x in zip((a, b), xs)]
                               + [restart_c])
    assert time.monotonic() - start < 8.0  # the timeout is 30 s
    for r in (ra, rb):
        assert r.complete and r.absent == [c.peer_id]
        torch.testing.assert_close(r.tensor, (xs[0] + xs[1]) / 2, rtol=0, atol=1e-6)


def test_a_newcomer_that_meant_to_join_a_round_a_member_finished_before_it_joined_stalls_nobody(make_swarm):
    """A newcomer's donor can report a stale step, so it means to join round 5 under way when a member has
    already ended it: that member pushed to it before it joined, heard "not in this round" and went on
    without it. The newcomer then takes part from round 6 on, answers the others' pushes for round 5 so
    and does not average round 5 itself, so every member of round 5 redoes it without the newcomer within
    seconds instead of the newcomer and the member who counted on it waiting out the timeout."""
    timeout = 10.0
    a, b, newcomer = make_swarm(3, timeout=timeout)
    for p in (a, b):
        p.join_rounds(5)
    group = sorted(p.peer_id for p in (a, b, newcomer))
    xs = [torch.randn(300) for _ in range(3)]
    finished = {}

    def late_newcomer_and_b():
        wait_until(lambda: newcomer.peer_id in a.averager.mailbox.senders("stale/x"), 10,
                   "a hearing that the newcomer takes no part in round 5")
        newcomer.join_rounds(5, first=True)  # as its stale donor step made it mean to
        return run_in_threads([lambda: timed_average(finished, "b", b, xs[1], group, "stale", 5),
                               lambda: timed_average(finished, "newcomer", newcomer, xs[2], group, "stale", 5)])

    start = time.monotonic()
    ra, (rb, rn) = run_in_threads([lambda: timed_average(finished, "a", a, xs[0], group, "stale", 5),
                                   late_newcomer_and_b])
    assert newcomer.averager.first_round == 6
    assert max(finished.values()) - start < timeout / 2
    for r in (ra, rb):
        assert r.complete and r.absent == [newcomer.peer_id]
        torch.testing.assert_close(r.tensor, (xs[0] + xs[1]) / 2, rtol=0, atol=1e-6)
    assert not rn.complete and torch.equal(rn.tensor, xs[2])
    assert rn.left_out == sorted([a.peer_id, b.peer_id])  # they averaged it without the newcomer: it takes their state
    wait_until(lambda: newcomer.peer_id in a.members(6), 10, "the newcomer announced round 6")
    assert newcomer.peer_id not in a.members(5)
