"""Group averages between real hivemind peers on loopback: exact means, bad data rejected, dead peers bounded."""

import logging
import threading
import time

import pytest
import torch
from hivemind.p2p import PeerID

from conftest import fail_to_open_once, run_in_threads, timed_average, wait_until
from decentral.swarm import check_part, wire
from decentral.swarm.wire import LinkShaper
from decentral.codec import make_codec
from decentral.swarm.averaging import (
    PhaseTimes, aggregate, check_owner_result, clip, encode_chunks, held_up, norm_bound,
)
from decentral.swarm.peer import DialHeldBack
from decentral.transport import FINITE_CHECK_NUMEL, ROUNDS_AHEAD, all_finite


def test_mean_of_three_peers_equals_independent_mean(make_swarm):
    peers = make_swarm(3)
    group = sorted(p.peer_id for p in peers)
    xs = [torch.randn(1001, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    results = run_in_threads([lambda p=p, x=x: p.average(x, group, "t") for p, x in zip(peers, xs)])
    expected = sum(xs) / 3
    for r in results:
        assert r.complete and r.contributors == 3 and not r.rejected
        torch.testing.assert_close(r.tensor, expected, rtol=0, atol=1e-6)
    assert all(p.bytes_sent > 0 and p.bytes_received > 0 for p in peers)


def test_the_member_whose_part_came_last_is_named_with_how_long_after_the_others(make_swarm):
    """C begins the average 1.5 s after A and B: A and B were held up by C's part, about that long after each
    other's; C found theirs waiting, so its own parts, delivered last, were the last in."""
    a, b, c = make_swarm(3)
    group = sorted(p.peer_id for p in (a, b, c))
    xs = [torch.randn(1001) for _ in range(3)]
    late = threading.Event()
    threading.Timer(1.5, late.set).start()
    ra, rb, rc = run_in_threads([lambda: a.average(xs[0], group, "late"), lambda: b.average(xs[1], group, "late"),
                                 lambda: late.wait() and c.average(xs[2], group, "late")])
    assert ra.complete and rb.complete and rc.complete
    for r in (ra, rb):
        assert r.held_by[0] == c.peer_id and 1.0 < r.held_by[1] < 10.0, r.held_by
    assert rc.held_by[0] == c.peer_id and rc.held_by[1] < 1.0, rc.held_by


def test_a_phase_times_its_last_message_from_its_start_and_ours_when_the_others_had_it():
    assert PhaseTimes(1.0, {"b": 3.0, "c": 5.5}, {"b": 2.0, "c": 2.5}).last_in("a") == ("c", 2.5)
    assert PhaseTimes(1.0, {"b": 0.2, "c": 0.4}, {"b": 2.0, "c": 4.0}).last_in("a") == ("a", 3.0)  # theirs waited
    assert PhaseTimes(1.0, {"b": 0.2}, {"b": 0.5}).last_in("a") == ("a", 0.0)
    assert PhaseTimes(1.0, {"b": 3.0}, {}).last_in("a") is None  # ours reached nobody: nothing to compare


def test_the_member_that_held_an_average_up_longest_is_summed_over_its_phases():
    """A slow uplink's member c: its inputs came 1.9 s after the last of the others (ours), its result 1.5 s
    after theirs. A phase where b's message came last, 0.6 s after ours, names b."""
    inputs = PhaseTimes(0.0, {"b": 0.1, "c": 2.1}, {"b": 0.1, "c": 0.2})
    results = PhaseTimes(2.2, {"b": 2.3, "c": 3.8}, {"b": 2.3, "c": 2.3})
    assert held_up([inputs, results], "a") == ("c", pytest.approx(1.9 + 1.5))
    late_b = PhaseTimes(4.0, {"b": 4.9, "c": 4.1}, {"b": 4.2, "c": 4.3})
    assert held_up([late_b], "a") == ("b", pytest.approx(0.6))
    assert held_up([], "a") is None


def test_a_chunk_that_is_zero_in_every_part_averages_and_commits(make_swarm):
    """Frozen weights give an outer gradient (or DDP a gradient) of exact zeros there: their chunk's owner
    reported only zero norms, which read as "averages no part at all", and each member banned the other for good."""
    peers = make_swarm(2)
    group = sorted(p.peer_id for p in peers)
    xs = [torch.randn(1001, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for x in xs:
        x[:600] = 0  # (chunk 0, the first 501 values, all zeros in both parts)
    results = run_in_threads([lambda p=p, x=x: p.average(x, group, "z") for p, x in zip(peers, xs)])
    for r in results:
        assert r.complete and r.contributors == 2 and not r.rejected, r
        torch.testing.assert_close(r.tensor, (xs[0] + xs[1]) / 2, rtol=0, atol=1e-6)
    assert not any(p.averager.banned for p in peers)


def test_an_averages_model_sized_work_runs_off_the_event_loop_that_answers_probes(make_swarm, monkeypatch):
    """Encoding, decoding, the part checks, the reduction and the digests of an average run in worker
    threads, never on a peer's event loop: a loop busy with a large model for `hang_s` would not answer
    probes, and its peer would be taken for hung."""
    from decentral.swarm import averaging

    peers = make_swarm(3, codec="int8")
    loops = {p.peer.call(_thread_id()).result(timeout=5) for p in peers}  # the threads of their event loops
    ran: dict[str, set[int]] = {}

    def on_threads(name, fn):
        def wrapped(*args, **kwargs):
            ran.setdefault(name, set()).add(threading.get_ident())
            return fn(*args, **kwargs)
        return wrapped

    for name in ("check_part", "aggregate", "chunk_digest", "check_owner_result"):
        monkeypatch.setattr(averaging, name, on_threads(name, getattr(averaging, name)))
    codec = type(peers[0].averager.codec)
    for name in ("encode", "decode"):
        monkeypatch.setattr(codec, name, on_threads(name, getattr(codec, name)))
    group = sorted(p.peer_id for p in peers)
    xs = [torch.randn(3000) for _ in peers]
    results = run_in_threads([lambda p=p, x=x: p.average(x, group, "off-loop") for p, x in zip(peers, xs)])
    assert all(r.complete for r in results)
    assert set(ran) == {"check_part", "aggregate", "chunk_digest", "check_owner_result", "encode", "decode"}
    assert all(not threads & loops for threads in ran.values()), (ran, loops)


async def _thread_id() -> int:
    return threading.get_ident()


def test_fp16_on_the_wire_gives_every_peer_the_same_result(make_swarm):
    peers = make_swarm(2, codec="float16")
    group = sorted(p.peer_id for p in peers)
    xs = [torch.randn(500), torch.randn(500)]
    a, b = run_in_threads([lambda p=p, x=x: p.average(x, group, "h") for p, x in zip(peers, xs)])
    assert torch.equal(a.tensor, b.tensor)
    torch.testing.assert_close(a.tensor, (xs[0] + xs[1]) / 2, rtol=0, atol=2e-3)


def test_wrong_size_from_a_peer_is_rejected(make_swarm):
    peers = make_swarm(2)
    group = sorted(p.peer_id for p in peers)
    xs = [torch.randn(100), torch.randn(160)]
    a, b = run_in_threads([lambda p=p, x=x: p.average(x, group, "shape") for p, x in zip(peers, xs)])
    assert peers[1].peer_id in a.rejected and "wrong size" in a.rejected[peers[1].peer_id]
    assert a.tensor.numel() == 100 and torch.isfinite(a.tensor).all()
    assert not a.complete


def test_a_peer_with_another_view_of_the_group_is_not_waited_for(make_swarm):
    """A believes the group is {A, B}; B believes {A, B, C} (C is up but silent, so B waits out the
    timeout). B's part carries the fingerprint of another member list, so A knows B will not send the
    part A expects either, and finishes at once instead of waiting for B's round to end."""
    timeout = 4.0
    a, b, c = make_swarm(3, timeout=timeout)
    xs = [torch.randn(120), torch.randn(120)]
    finished = {}
    start = time.monotonic()
    ra, rb = run_in_threads([lambda: timed_average(finished, "a", a, xs[0], [a.peer_id, b.peer_id], "views"),
                             lambda: timed_average(finished, "b", b, xs[1], [a.peer_id, b.peer_id, c.peer_id], "views")])
    assert finished["a"] - start < timeout / 2  # B itself is still waiting for C
    assert finished["b"] - start > timeout
    assert "another member list" in ra.rejected[b.peer_id] and not ra.complete
    assert "another member list" in rb.rejected[a.peer_id] and not rb.complete
    assert torch.isfinite(ra.tensor).all() and torch.isfinite(rb.tensor).all()


def test_views_of_the_same_size_never_mix_their_chunks(make_swarm):
    """A averages over {A, B, C}, B over {A, B, D}: the parts have the same sizes, but chunk j belongs
    to another peer in each view. Nothing of B's may enter A's result (and the other way round)."""
    a, b, c, d = make_swarm(4, timeout=3.0)
    xs = [torch.randn(300), torch.randn(300)]
    ra, rb = run_in_threads([lambda: a.average(xs[0], sorted([a.peer_id, b.peer_id, c.peer_id]), "same-size"),
                             lambda: b.average(xs[1], sorted([a.peer_id, b.peer_id, d.peer_id]), "same-size")])
    assert torch.equal(ra.tensor, xs[0]) and torch.equal(rb.tensor, xs[1])  # float32 on the wire: exact
    assert "another member list" in ra.rejected[b.peer_id]
    assert "another member list" in rb.rejected[a.peer_id]


@pytest.mark.parametrize("first", ["insider", "outsider"])
def test_a_peer_left_out_of_the_others_view_does_not_wait_for_them(make_swarm, first):
    """A averages over {A, B}; B, whose view left A out, averages over {B, C} with C up but silent.
    B answers A's push with a notice, so A stops waiting for B (whoever started first) while B waits
    out C, and A learns that B left it out (not that B is gone)."""
    timeout = 6.0
    a, b, c = make_swarm(3, timeout=timeout)
    xs = [torch.randn(64), torch.randn(64)]
    finished = {}

    def outsider():
        if first == "insider":  # B's average is under way before A's push reaches it
            wait_until(lambda: "left-out" in b.averager._groups)
        return timed_average(finished, "a", a, xs[0], [a.peer_id, b.peer_id], "left-out")

    def insider():
        if first == "outsider":  # A's push is waiting in B's mailbox before B starts
            wait_until(lambda: a.peer_id in b.averager.mailbox.senders("left-out/r"))
        return timed_average(finished, "b", b, xs[1], [b.peer_id, c.peer_id], "left-out")

    start = time.monotonic()
    ra, rb = run_in_threads([outsider, insider])
    assert finished["a"] - start < timeout / 2
    assert finished["b"] - start > timeout
    assert torch.equal(ra.tensor, xs[0]) and not ra.complete
    assert ra.left_out == [b.peer_id]
    assert a.peer_id not in rb.rejected and torch.equal(rb.tensor, xs[1])


def test_a_peer_that_finished_an_average_without_us_says_it_left_us_out(make_swarm):
    """B and C commit an average over {B, C}; A, late and sure the group is {A, B, C}, is told by both
    that they averaged without it, at once, and rolls back."""
    timeout = 8.0
    a, b, c = make_swarm(3, timeout=timeout)
    xs = [torch.randn(64) for _ in range(3)]
    rb, rc = run_in_threads([lambda: b.average(xs[1], sorted([b.peer_id, c.peer_id]), "late"),
                             lambda: c.average(xs[2], sorted([b.peer_id, c.peer_id]), "late")])
    assert rb.complete and rc.complete
    start = time.monotonic()
    ra = a.average(xs[0], sorted([a.peer_id, b.peer_id, c.peer_id]), "late")
    assert time.monotonic() - start < timeout / 2
    assert not ra.complete and torch.equal(ra.tensor, xs[0])
    assert ra.left_out == sorted([b.peer_id, c.peer_id])


def test_a_member_the_others_redo_left_out_is_told_it_was_left_out_not_that_they_are_done(make_swarm):
    """B and C wait out A (alive, answering probes, but sending nothing: it trains a round behind) and
    commit their redo without it; A's late part is answered "left out" by both (its protocol then takes
    their state at once), not "done" (which said nothing of whether they committed, or with whom)."""
    timeout = 3.0
    a, b, c = make_swarm(3, timeout=timeout)
    group = sorted([a.peer_id, b.peer_id, c.peer_id])
    xs = [torch.randn(64) for _ in range(3)]
    rb, rc = run_in_threads([lambda: b.average(xs[1], group, "redone"), lambda: c.average(xs[2], group, "redone")])
    assert rb.complete and rc.complete and rb.contributors == 2 and a.peer_id in rb.absent
    ra = a.average(xs[0], group, "redone")
    assert not ra.complete and torch.equal(ra.tensor, xs[0])
    assert ra.left_out == sorted([b.peer_id, c.peer_id])


def test_a_member_that_still_waits_for_one_the_others_gave_up_on_meets_them_in_the_redo(make_swarm):
    """C answers probes but sends nothing (it trains a round behind). A gives up on it after its own short
    timeout and redoes the average with B; B, whose timeout is long, would still wait for C. A's part of the
    redo tells B that A gave the first attempt up (it cannot commit): B stops waiting at once and meets A in
    the redo without C, and both commit the mean of their two parts (before, B waited out its timeout while
    A's redo waited out B: both rolled back)."""
    a, b, c = make_swarm(3, timeout=30.0)
    a.timeout = 2.0  # as if A's probes had taken C for hung at a wake, and B's had not
    group = sorted([a.peer_id, b.peer_id, c.peer_id])
    xs = [torch.randn(64) for _ in range(2)]
    finished = {}
    start = time.monotonic()
    ra, rb = run_in_threads([lambda: timed_average(finished, "a", a, xs[0], group, "split"),
                             lambda: timed_average(finished, "b", b, xs[1], group, "split")])
    assert finished["b"] - start < 15.0  # not B's timeout
    for r in (ra, rb):
        assert r.complete and r.contributors == 2 and r.absent == [c.peer_id], r
        torch.testing.assert_close(r.tensor, (xs[0] + xs[1]) / 2, rtol=0, atol=1e-6)


def test_a_member_that_began_no_average_of_the_rounds_before_is_not_waited_for(make_swarm):
    """A averaged round 1 with B and C, then froze; B and C went on without it (round 2). Woken, A trains toward
    round 2 while B and C reach round 1 + lead + 1, its protocol's lead being one round (DiLoCo's): A answers their
    pushes and probes that it takes no part in it, so they commit without it at once (before, A answered
    "here" and they waited out the timeout, or until A had trained through its stale rounds), and A, asked
    later to take part from that round, takes part from the one after it (they averaged it without A)."""
    timeout, lead = 30.0, 1
    assert lead < ROUNDS_AHEAD  # the lead A's join_rounds says, not the transports' default, decides
    a, b, c = make_swarm(3, timeout=timeout)
    group = sorted([a.peer_id, b.peer_id, c.peer_id])
    for t in (a, b, c):  # (round 1, the first they average: joined at 0, a member not yet in its own average of
        t.join_rounds(1, first=True, ahead=lead)  # round 1 is more than `lead` past any it began, and said so)
    xs = [torch.randn(64) for _ in range(3)]
    assert all(r.complete for r in run_in_threads([lambda t=t, x=x: t.average(x, group, "r1", round=1)
                                                   for t, x in zip((a, b, c), xs)]))
    # B and C go on without A: round 2 (else each, its own latest begun average still round 1's, would be more
    # than `lead` past it in round 3 until it began its own average of round 3, and could turn the other away)
    went_on = sorted([b.peer_id, c.peer_id])
    assert all(r.complete for r in run_in_threads([lambda t=t, x=x: t.average(x, went_on, "r2", round=2)
                                                   for t, x in ((b, xs[1]), (c, xs[2]))]))
    ahead, finished = 2 + lead, {}
    start = time.monotonic()
    rb, rc = run_in_threads([lambda t=t, x=x, n=n: timed_average(finished, n, t, x, group, "ahead", round=ahead)
                             for t, x, n in ((b, xs[1], "b"), (c, xs[2], "c"))])
    assert max(finished.values()) - start < timeout / 3
    assert rb.complete and rc.complete and rb.contributors == 2 and a.peer_id in rb.absent
    torch.testing.assert_close(rb.tensor, (xs[1] + xs[2]) / 2, rtol=0, atol=1e-6)
    assert a.averager.take_part_from(ahead) == ahead + 1


def test_a_member_done_with_an_average_whose_part_to_us_was_lost_is_not_waited_for(make_swarm):
    """B took A's part and is done with the average (as if its own part to A had been lost on the way):
    A's probes ask B about this average, B answers that it sends nothing more, and A stops waiting
    within seconds instead of the timeout."""
    timeout = 20.0
    a, b = make_swarm(2, timeout=timeout)
    finished = {}
    start = time.monotonic()
    ra, _ = run_in_threads([
        lambda: timed_average(finished, "a", a, torch.randn(32), [a.peer_id, b.peer_id], "lost"),
        lambda: (wait_until(lambda: a.peer_id in b.averager.mailbox.senders("lost/r")), b.averager._finish("lost"))])
    assert finished["a"] - start < timeout / 4
    assert not ra.complete and not ra.absent  # B is done with this average, not gone: a redo would count on it


@pytest.mark.solo
def test_a_connection_reset_between_live_members_costs_a_resend_not_the_round(make_swarm, monkeypatch, caplog):
    """The connection between A and B closes while A's part is on its way, and closes again while A sends
    it again (both processes alive, as resets under load do: one reset closes every connection between
    two peers, and a stream opened meanwhile may land on one that is closing): the closed streams are
    not taken for B's death; A sends again on a fresh one, and both commit the exact mean."""
    caplog.set_level(logging.INFO, logger="decentral.swarm.averaging")
    monkeypatch.setattr(wire, "LINK", LinkShaper(rate_bps=10e6))  # a 1 MB part takes 0.8 s on the way
    a, b = make_swarm(2, timeout=30.0)
    group = sorted([a.peer_id, b.peer_id])
    xs = [torch.randn(500_000), torch.randn(500_000)]

    def reset_twice_while_a_push_is_under_way():
        for _ in range(2):
            before = b.bytes_received
            wait_until(lambda: b.bytes_received > before + 100_000, 20, "A's push to B under way")
            a.peer.call(a.peer._p2p._client.disconnect(PeerID.from_base58(b.peer_id))).result(timeout=10)
        return True

    ra, rb, reset = run_in_threads([lambda: a.average(xs[0], group, "reset"), lambda: b.average(xs[1], group, "reset"),
                                reset_twice_while_a_push_is_under_way])
    assert reset
    assert ra.complete and rb.complete and not ra.absent and not rb.absent, caplog.text
    for r in (ra, rb):
        torch.testing.assert_close(r.tensor, (xs[0] + xs[1]) / 2, rtol=0, atol=1e-6)


def test_a_stream_libp2p_fails_to_open_to_a_live_member_is_asked_again_not_the_part_lost(make_swarm, monkeypatch):
    """Right after a reset between live members, libp2p's daemon can fail to open a stream ("Connect failed"):
    that is asked again on a fresh stream, as a stream closed unanswered is; before, the part was dropped
    and the round rolled back after its receiver waited out the timeout (seen once in CI)."""
    a, b = make_swarm(2, timeout=10.0)
    group = sorted([a.peer_id, b.peer_id])
    failed = fail_to_open_once(a.peer, "push", monkeypatch)
    xs = [torch.randn(1000), torch.randn(1000)]
    ra, rb = run_in_threads([lambda: a.average(xs[0], group, "connect"), lambda: b.average(xs[1], group, "connect")])
    assert failed == [b.peer_id]
    for r in (ra, rb):
        assert r.complete and not r.absent, r
        torch.testing.assert_close(r.tensor, (xs[0] + xs[1]) / 2, rtol=0, atol=1e-6)


@pytest.mark.parametrize("address_answers", [True, False])
def test_members_whose_new_dials_libp2p_holds_back_past_hang_s_wait_for_each_other_while_their_addresses_answer(
        make_swarm, monkeypatch, address_answers):
    """After a reset, libp2p may hold back new dials between two live members for its backoff (5 s and
    more, past `hang_s`), on both sides at once, as the reset test above saw on a loaded machine. Held
    back here for 6 s: while the address accepts a plain connection (their daemons are up) that is a sign
    of life, and they commit the exact mean once dials go through; an address that does not answer (a
    host cut off) gives none, and each takes the other for hung after `hang_s`."""
    a, b = make_swarm(2, timeout=30.0)
    group = sorted([a.peer_id, b.peer_id])
    xs = [torch.randn(1000), torch.randn(1000)]
    held_until = time.monotonic() + 6.0
    for t in (a, b):
        async def held_back(peer, name, real=t.peer.open_stream):
            if time.monotonic() < held_until:
                raise DialHeldBack("libp2p holds back dials (injected)", accepted=address_answers)
            return await real(peer, name)

        monkeypatch.setattr(t.peer, "open_stream", held_back)
    ra, rb = run_in_threads([lambda: a.average(xs[0], group, "held"), lambda: b.average(xs[1], group, "held")])
    if address_answers:
        assert time.monotonic() >= held_until
        assert ra.complete and rb.complete and ra.contributors == rb.contributors == 2
        for r in (ra, rb):
            torch.testing.assert_close(r.tensor, (xs[0] + xs[1]) / 2, rtol=0, atol=1e-6)
    else:
        assert not ra.complete and ra.absent == [b.peer_id] and not rb.complete and rb.absent == [a.peer_id]


def test_a_closed_peer_costs_at_most_the_timeout_and_the_survivors_end_alike(make_swarm):
    peers = make_swarm(3, timeout=3.0)
    group = sorted(p.peer_id for p in peers)
    peers[2].close()
    xs = [torch.randn(90), torch.randn(90)]
    start = time.monotonic()
    a, b = run_in_threads([lambda p=p, x=x: p.average(x, group, "dead") for p, x in zip(peers[:2], xs)])
    assert time.monotonic() - start < 1.5 * 3.0 + 2.0
    assert a.complete == b.complete  # both committed the survivors' mean, or both rolled back
    if a.complete:
        for r in (a, b):
            torch.testing.assert_close(r.tensor, (xs[0] + xs[1]) / 2, rtol=0, atol=1e-6)
    else:
        assert torch.equal(a.tensor, xs[0]) and torch.equal(b.tensor, xs[1])


def test_model_sized_helpers_give_what_their_plain_forms_give():
    """The finiteness check in slices, the chunks decoded into one tensor, the mean summed into one buffer:
    the same answers as isfinite over the whole, a list of decoded chunks, and a stacked mean."""
    values = torch.randn(2 * FINITE_CHECK_NUMEL + 5)
    assert all_finite(values)
    for where, bad in ((0, float("nan")), (FINITE_CHECK_NUMEL, float("inf")), (values.numel() - 1, float("-inf"))):
        broken = values.clone()
        broken[where] = bad
        assert not all_finite(broken), where
    codec = make_codec("int8")
    flat = torch.randn(10_001)
    encoded, decoded = encode_chunks(codec, flat, 3)
    assert [numel for _, numel in encoded] == [c.numel() for c in torch.tensor_split(flat, 3)]
    assert torch.equal(decoded, torch.cat([codec.decode(*e) for e in encoded]))
    parts = [torch.randn(1000) for _ in range(4)]
    before = [p.clone() for p in parts]
    torch.testing.assert_close(aggregate(parts, "mean"), torch.stack(before).mean(0), rtol=0, atol=1e-6)
    assert all(torch.equal(p, b) for p, b in zip(parts, before))  # summed into a buffer of its own


def test_part_checks_clip_bound_and_owner_results():
    ref = torch.ones(10)
    assert check_part(torch.ones(10), ref) is None
    assert "wrong size" in check_part(torch.ones(9), ref)
    assert "non-finite" in check_part(torch.full((10,), float("inf")), ref)
    assert norm_bound([1.0, 5.0, 100.0], 2.0, 10) == 10.0  # 2x the lower median, 5
    assert norm_bound([1.0, 100.0], 2.0, 10) == 2.0  # a pair: 2x the smaller
    torch.testing.assert_close(clip(ref * 30, float((ref * 30).norm()), 5.0).norm(), torch.tensor(5.0))
    assert torch.equal(clip(ref, float(ref.norm()), 5.0), ref)
    mean = torch.ones(10)  # norm 3.16, as the mean of parts of norm 3.16 would be
    assert check_owner_result(mean, [3.17, 3.17, 3.17], 0, 3.17, 2.0, "mean", 3) is None
    assert "more than its parts" in check_owner_result(mean * 5, [3.17, 3.17, 3.17], 0, 3.17, 2.0, "mean", 3)
    assert "reports our part" in check_owner_result(mean, [9.0, 3.17, 3.17], 0, 3.17, 2.0, "mean", 3)
    assert "beyond the" in check_owner_result(mean, [3.17, 3.17, 30.0], 0, 3.17, 2.0, "mean", 3)
    assert "without the norms" in check_owner_result(mean, None, 0, 3.17, 2.0, "mean", 3)
    # one norm per member: padded with large ones, the lower median (so the bound) rose and a 50x result passed;
    # short, our own entry was read past its end (an IndexError out of the average)
    assert "without the norms of the 2 parts" in check_owner_result(mean * 10, [3.17, 3.17, 99, 99], 0, 3.17, 2.0,
                                                                      "mean", 2)
    assert "without the norms of the 3 parts" in check_owner_result(mean, [3.17], 2, 3.17, 2.0, "mean", 3)
    # every part all zeros (frozen weights): an honest result, not "no part at all" (its owner was banned for it)
    assert check_owner_result(torch.zeros(10), [0.0, 0.0], 0, 0.0, 2.0, "mean", 2) is None
