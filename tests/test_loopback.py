"""The in-process loopback transport: exact means, roll-backs like the swarm's, averages in the background."""

import threading

import pytest
import torch

from conftest import run_in_threads
from decentral.loopback import LoopbackHub
from decentral.transport import ROUNDS_AHEAD, SoloTransport


def test_an_average_is_the_exact_mean_and_runs_in_the_background_until_the_last_member_starts():
    hub = LoopbackHub()
    peers = [hub.transport() for _ in range(3)]
    group = sorted(p.peer_id for p in peers)
    inputs = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    first = peers[0].average_async(inputs[0], group, "t")
    second = peers[1].average_async(inputs[1], group, "t")
    assert not first.done() and not second.done()  # a training step could run here
    last = peers[2].average(inputs[2], group, "t")
    expected = torch.stack(inputs).mean(0)
    for result in (first.result(timeout=1), second.result(timeout=1), last):
        assert result.complete and result.contributors == 3 and torch.equal(result.tensor, expected)
    assert torch.equal(first.result().sent, inputs[0])


def test_a_closed_member_rolls_the_average_back_at_once_and_a_silent_one_after_the_timeout():
    hub = LoopbackHub(timeout_s=0.3)
    a, b, c = (hub.transport() for _ in range(3))
    group = sorted([a.peer_id, b.peer_id, c.peer_id])
    pending = a.average_async(torch.ones(4), group, "closed")
    c.close()
    assert pending.done()  # no timeout waited for a member that left
    result = pending.result()
    assert not result.complete and result.absent == sorted([b.peer_id, c.peer_id])  # b had not started yet
    assert torch.equal(result.tensor, torch.ones(4))
    silent = a.average(torch.ones(4), [a.peer_id, b.peer_id], "silent")  # b never starts it
    assert not silent.complete and silent.absent == [b.peer_id]
    assert c.peer_id not in a.members(0) and c.peer_id not in a.progress()


def test_a_member_whose_first_round_is_later_rolls_an_earlier_average_back_at_once_and_averages_none():
    """As the swarm's averager does for a newcomer or a replica that rejoined further on (see GroupAverager.take_part_from)."""
    hub = LoopbackHub(timeout_s=60.0)
    a, b = hub.transport(), hub.transport()
    group = sorted([a.peer_id, b.peer_id])
    pending = a.average_async(torch.ones(4), group, "r1", round=1)
    later = a.average_async(torch.ones(4), group, "r2", round=2)
    b.join_rounds(2, first=True)
    assert pending.done() and not later.done()  # no timeout waited for round 1
    assert not pending.result().complete and pending.result().absent == [b.peer_id]
    alone = b.average(torch.zeros(4), group, "r1", round=1)  # b itself averages no round before 2
    assert not alone.complete and alone.left_out == [a.peer_id]  # a averages it without b
    done = b.average(torch.full((4,), 3.0), group, "r2", round=2)
    assert done.complete and torch.equal(done.tensor, torch.full((4,), 2.0))


def test_an_average_more_than_rounds_ahead_past_a_members_latest_rolls_back_at_once_one_within_waits_for_it():
    """As the swarm's averager does for a member woken from a freeze: it began round 1, the others went on
    without it, and round 1 + ROUNDS_AHEAD + 1 does not wait for it; round 1 + ROUNDS_AHEAD does (CO2's
    members launch it while a member in step trains toward round 2)."""
    hub = LoopbackHub(timeout_s=60.0)
    a, b = hub.transport(), hub.transport()
    group = sorted([a.peer_id, b.peer_id])
    run_in_threads([lambda p=p: p.average(torch.ones(4), group, "r1", round=1) for p in (a, b)])
    within = a.average_async(torch.ones(4), group, "within", round=1 + ROUNDS_AHEAD)
    past = a.average_async(torch.ones(4), group, "past", round=2 + ROUNDS_AHEAD)
    assert past.done() and not past.result().complete and past.result().absent == [b.peer_id]
    assert not within.done()  # b may still reach it
    done = b.average(torch.full((4,), 3.0), group, "within", round=1 + ROUNDS_AHEAD)
    assert done.complete and torch.equal(within.result(timeout=1).tensor, torch.full((4,), 2.0))


def test_members_progress_and_state_are_what_the_peers_announced():
    hub = LoopbackHub()
    a, b = hub.transport(), hub.transport()
    a.join_rounds(0)
    b.join_rounds(2, first=True)
    assert a.members(0) == [a.peer_id] and a.members(2) == sorted([a.peer_id, b.peer_id])
    a.set_progress(7, 1, "d1")
    assert b.progress()[a.peer_id] == {"step": 7, "round": 1, "digests": {"1": "d1"}}
    state = {"slow": torch.arange(5.0)}
    a.offer_state({"round": 1, "step": 5}, state)
    donor, (meta, tensors) = b.fetch_state()
    assert donor == a.peer_id and meta["donor_step"] == 7 and torch.equal(tensors["slow"], state["slow"])
    a.set_progress(5, 1)
    assert b.fetch_state(have=state) is None  # the same state, and the donor has not trained since
    c = hub.transport()  # open, but it has not announced a round yet: not a peer to train with
    with pytest.raises(TimeoutError, match="fewer than 3"):
        a.wait_for_peers(3, 0.1, round=2)
    waiter = threading.Thread(target=a.wait_for_peers, args=(3, 5.0, 2))
    waiter.start()
    c.join_rounds(0)  # announces rounds 0 to 2
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    # a swarm under way: nobody announces round 1 any more, but b is past it, so a peer back at round 1 (resumed
    # from an older checkpoint) does not wait for the round's announcements, which the others made long ago
    a.join_rounds(5)
    waiter = threading.Thread(target=a.wait_for_peers, args=(2, 5.0, 5))
    waiter.start()
    b.set_progress(400, 8)
    waiter.join(timeout=5)
    assert not waiter.is_alive()


def test_the_solo_transports_background_average_is_done_at_once():
    future = SoloTransport().average_async(torch.ones(3), ["solo"], "t")
    assert future.done() and torch.equal(future.result().tensor, torch.ones(3))


def test_an_average_over_a_rounds_members_looks_up_that_round_and_needs_it_named():
    hub = LoopbackHub()
    a, b, c = hub.transport(), hub.transport(), hub.transport()
    a.join_rounds(1)
    b.join_rounds(1)
    c.join_rounds(2, first=True)  # a member of round 2 only
    xs = [torch.full((4,), float(i)) for i in range(2)]
    first = a.average_async(xs[0], None, "r1", round=1)
    result = b.average(xs[1], None, "r1", round=1)
    for r in (first.result(timeout=1), result):
        assert r.complete and r.group == sorted([a.peer_id, b.peer_id]) and torch.equal(r.tensor, (xs[0] + xs[1]) / 2)
    with pytest.raises(ValueError, match="needs that round"):
        a.average_async(xs[0], None, "which")
