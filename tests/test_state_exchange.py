"""The state exchange on real peers: a newcomer downloads a state in shares from the peers that hold it."""

import threading
from types import SimpleNamespace

import pytest
import torch

from conftest import fail_to_open_once, wait_until, wait_until_senders_counted
from decentral.swarm import wire
from decentral.transport import EncodedAverage, StateUnavailable, state_digest


def test_a_share_whose_holder_moved_on_comes_from_another_holder_not_a_whole_download(make_swarm):
    """Two peers publish the same state of round 3; one of them has moved on to another state when the
    newcomer asks for its share. That share comes from the other holder: the newcomer ends with the state
    and has received it once (before, the refused share made it download the whole state again: 1.5×)."""
    a, b, newcomer = make_swarm(3)
    state = {"slow": torch.randn(200_000), "momentum": torch.randn(200_000)}
    digest = state_digest(state)
    meta = {"protocol": "diloco", "round": 3, "step": 30}
    a.state.offer(meta, state)
    b.state.offer({**meta, "round": 4, "step": 40}, {k: t + 1 for k, t in state.items()})  # b moved on
    candidates = {p.peer_id: {"round": 3, "digests": {"3": digest}} for p in (a, b)}
    before = newcomer.bytes_received
    donor, (got_meta, got) = newcomer.state.fetch(candidates, timeout=15, have={k: torch.zeros_like(t)
                                                                               for k, t in state.items()})
    received = newcomer.bytes_received - before
    assert donor in (a.peer_id, b.peer_id) and got_meta["round"] == 3
    assert all(torch.equal(got[k], state[k]) for k in state)
    state_bytes = sum(t.nbytes for t in state.values())
    assert state_bytes < received < 1.1 * state_bytes, (received, state_bytes)


def test_the_rounds_since_a_state_come_in_shares_as_far_as_other_holders_kept_them(make_swarm):
    """The donor kept rounds 1-3 after the newcomer's state, the other member only rounds 1-2 so far (it has
    not ended round 3 yet): rounds 1 and 2 come half from each (before, a holder that lacked the donor's last
    round sent nothing), round 3 at the next call from the donor alone; once the other holds it too, half of
    round 3 comes from each (a chunk each: before, one round went whole over one uplink)."""
    a, b, newcomer = make_swarm(3)
    codec, n = newcomer.averager.codec, 100_000
    base = {k: torch.randn(n) for k in ("slow", "momentum", "other")}  # as many bytes as the three rounds (kept)
    averages = [torch.randn(n) for _ in range(3)]
    digests = [state_digest(base)] + [f"state after round {r}" for r in (1, 2, 3)]

    def offer(holder, r):
        halves = [(codec.encode(half), half.numel()) for half in averages[r - 1].tensor_split(2)]  # two owners' chunks
        holder.state.offer({"protocol": "diloco", "round": r}, base, digests[r], EncodedAverage(codec, halves))

    def fetch(since):
        sent, received = [a.bytes_sent, b.bytes_sent], newcomer.bytes_received
        rounds, _ = newcomer.state.fetch_rounds([a.peer_id, b.peer_id], digests[since], n, codec, timeout=15)
        assert all(torch.equal(r.average.decode(), averages[r.meta["round"] - 1]) for r in rounds)
        wait_until_senders_counted((a, b), sent, newcomer, received)
        return [r.meta["round"] for r in rounds], [(peer.bytes_sent - s) / (4 * n) for peer, s in zip((a, b), sent)]

    for holder, rounds in ((a, 3), (b, 2)):
        holder.state.offer({"protocol": "diloco", "round": 0}, base)
        holder.state.rounds.want(digests[0])
        for r in range(1, rounds + 1):
            offer(holder, r)
    got, sent = fetch(0)  # sent: in rounds' averages (float32)
    assert got == [1, 2] and all(1 < s < 1.2 for s in sent), sent
    got, sent = fetch(2)
    assert got == [3] and 1 < sent[0] < 1.2 and sent[1] < 0.2, sent
    offer(b, 3)
    got, sent = fetch(2)
    assert got == [3] and all(0.5 < s < 0.7 for s in sent), sent


def test_a_holder_that_cut_the_same_rounds_into_other_chunks_sends_no_share(make_swarm):
    """Two holders kept the same rounds, one cut each average into 2 chunks (a flat peer), the other into 3
    (an island in sharded mode: a chunk per shard's owner). Their chunks cannot be mixed: the rounds come from
    the donor alone (before, the other's share matched none of the donor's chunks and no round came)."""
    a, b, newcomer = make_swarm(3)
    codec, n = newcomer.averager.codec, 30_000
    base = {k: torch.randn(n) for k in ("slow", "momentum")}
    averages = [torch.randn(n) for _ in range(2)]
    digests = [state_digest(base), "state after round 1", "state after round 2"]
    for holder, pieces in ((a, 2), (b, 3)):
        holder.state.offer({"protocol": "diloco", "round": 0}, base)
        holder.state.rounds.want(digests[0])
        for r in (1, 2):
            chunks = [(codec.encode(piece), piece.numel()) for piece in averages[r - 1].tensor_split(pieces)]
            holder.state.offer({"protocol": "diloco", "round": r}, base, digests[r], EncodedAverage(codec, chunks))
    sent = b.bytes_sent
    rounds, _ = newcomer.state.fetch_rounds([a.peer_id, b.peer_id], digests[0], n, codec, timeout=15)
    assert [r.meta["round"] for r in rounds] == [1, 2]
    assert all(torch.equal(r.average.decode(), averages[r.meta["round"] - 1]) for r in rounds)
    assert b.bytes_sent - sent < 0.1 * 4 * n  # b listed its rounds, and sent none of them


@pytest.mark.solo
def test_a_share_waits_for_a_member_a_round_behind_while_the_donor_sends_its_own(make_swarm, monkeypatch):
    """A member ends its round a moment after the donor (their boundaries are not simultaneous): the newcomer
    that asks in between gets half the state from the donor and, once that member publishes the same state,
    the other half from it (before: all of it from the donor, over one uplink)."""
    monkeypatch.setattr(wire, "LINK", wire.LinkShaper(rate_bps=16e6))  # our streams paced: a share takes 1 s
    a, b, newcomer = make_swarm(3)
    state = {"slow": torch.randn(500_000), "momentum": torch.randn(500_000)}
    digest = state_digest(state)
    a.offer_state({"protocol": "diloco", "round": 3, "step": 30}, state, digest)
    a.set_progress(30, 3, digest)
    b.offer_state({"protocol": "diloco", "round": 2, "step": 20}, {k: t - 1 for k, t in state.items()})
    b.set_progress(29, 2)
    wait_until(lambda: newcomer.progress().get(b.peer_id, {}).get("round") == 2
               and newcomer.progress().get(a.peer_id, {}).get("round") == 3, 30, "the newcomer seeing a at 3, b at 2")
    sent, received, got = [a.bytes_sent, b.bytes_sent], newcomer.bytes_received, []
    download = threading.Thread(target=lambda: got.append(newcomer.fetch_state(have={k: torch.zeros_like(t) for k, t
                                                                                      in state.items()})))
    download.start()
    wait_until(lambda: a.bytes_sent - sent[0] > 100_000, 30, "the donor sending its share")
    b.offer_state({"protocol": "diloco", "round": 3, "step": 30}, state, digest)  # b ends its round: the same state
    b.set_progress(30, 3, digest)
    download.join(timeout=60)
    wait_until_senders_counted((a, b), sent, newcomer, received)
    donor, (meta, tensors) = got[0]
    assert donor == a.peer_id and meta["round"] == 3 and all(torch.equal(tensors[k], state[k]) for k in state)
    half = 4 * 500_000
    assert [0.9 * half < peer.bytes_sent - s < 1.2 * half for peer, s in zip((a, b), sent)] == [True, True]


def test_a_state_stream_libp2p_fails_to_open_is_asked_again_not_the_download_lost(make_swarm, monkeypatch):
    """Right after a reset between live peers, libp2p's daemon can fail to open a stream ("Connect failed"):
    a state download asks once more, as the averager's pushes do; before, that donor was skipped."""
    a, b = make_swarm(2)
    a.state.offer({"protocol": "noloco", "round": 3}, {"slow": torch.arange(4.0)})
    failed = fail_to_open_once(b.peer, "state", monkeypatch)
    donor, (meta, tensors) = b.state.fetch({a.peer_id: {"round": 3}}, timeout=15)
    assert failed == [a.peer_id] and donor == a.peer_id
    assert meta["round"] == 3 and torch.equal(tensors["slow"], torch.arange(4.0))


def test_a_state_far_larger_than_ours_is_refused_before_any_of_it_is_allocated(make_swarm):
    """A download accepted any state up to 16 GiB: a donor of another model (or one that lies about its size) had
    the newcomer allocate and fill it before anything compared it with ours. Now a state more than STATE_GROWTH
    times ours is refused as its length arrives, and one of our own size still comes."""
    a, b = make_swarm(2)
    a.state.offer({"protocol": "diloco", "round": 3}, {"slow": torch.zeros(100_000), "momentum": torch.zeros(100_000)})
    ours = {"slow": torch.ones(1_000), "momentum": torch.ones(1_000)}
    with pytest.raises(StateUnavailable, match=r"WireError: frame length 800000 exceeds the \d+-byte limit"):
        b.state.fetch({a.peer_id: {"round": 3}}, timeout=15, have=ours)
    a.state.offer({"protocol": "diloco", "round": 4}, {"slow": torch.arange(1_000.0), "momentum": torch.zeros(1_000)})
    donor, (meta, tensors) = b.state.fetch({a.peer_id: {"round": 4}}, timeout=15, have=ours)
    assert donor == a.peer_id and torch.equal(tensors["slow"], torch.arange(1_000.0))


@pytest.mark.parametrize("meta", [{"protocol": "diloco", "round": "three"}, {"protocol": "diloco"},
                                  {"protocol": "diloco", "round": 3, "step": -5}],
                         ids=["a-round-that-is-no-number", "no-round", "a-negative-step"])
def test_a_state_whose_meta_names_no_round_and_step_is_refused(make_swarm, meta):
    """A donor's meta went to the newcomer's protocol as it came: a round that is no number stopped its training
    with a ValueError (`int(meta["round"])`), one with none with a KeyError. The download fails instead, as one
    of the wrong size does, and the newcomer asks another donor or says none handed over its state."""
    a, b = make_swarm(2)
    a.state.offer(meta, {"slow": torch.arange(4.0)})
    with pytest.raises(StateUnavailable, match="WireError: a state whose meta names no round and inner step"):
        b.state.fetch({a.peer_id: {"round": 3}}, timeout=15)


def test_a_state_holding_nan_or_inf_is_refused_and_the_next_donor_asked(make_swarm):
    """A donor's state went to the newcomer as it came: one holding NaN (a broken or hostile member) was taken,
    and the newcomer's first step diverged, reported as its own training's fault. The download fails instead,
    naming the tensor, and the newcomer asks another donor (or says that none handed over its state)."""
    a, b, newcomer = make_swarm(3)
    bad = {"slow": torch.arange(4.0), "momentum": torch.tensor([0.0, float("nan"), 0.0, float("inf")])}
    a.state.offer({"protocol": "diloco", "round": 3}, bad)
    with pytest.raises(StateUnavailable, match=r"WireError: a state holding NaN or inf \(in momentum\)"):
        newcomer.state.fetch({a.peer_id: {"round": 3}}, timeout=15)
    b.state.offer({"protocol": "diloco", "round": 3}, {"slow": torch.ones(4), "momentum": torch.zeros(4)})
    donor, (meta, tensors) = newcomer.state.fetch({a.peer_id: {"round": 3}, b.peer_id: {"round": 3}}, timeout=15)
    assert donor == b.peer_id and torch.equal(tensors["slow"], torch.ones(4))


def test_a_granted_join_whose_state_holds_nan_is_no_join(make_swarm):
    """DDP's join at the next step: a donor that grants a state holding NaN gives the newcomer no state to
    start from (it asks again, or another donor), as one that refuses does; before, it took the NaN."""
    donor, newcomer = make_swarm(2)
    donor.join_requests()  # from now on the donor queues join requests, as a DDP member does
    got, requests = [], []
    asking = threading.Thread(target=lambda: got.append(newcomer.request_join(donor.peer_id)))
    asking.start()
    wait_until(lambda: requests.extend(donor.join_requests()) or requests, 30, "the request reaching the donor")
    requests[0].grant(({"protocol": "ddp", "round": 0, "step": 0, "joined_step": 7},
                       {"weights": torch.tensor([1.0, float("nan")])}))
    asking.join(timeout=30)
    assert got == [None]


def test_a_donor_serving_another_state_than_it_publishes_is_refused(make_swarm):
    """A whole download was taken as it came: a member could publish the swarm's digest (so that shares and
    replica checks saw nothing amiss) and serve another state. It must be the state it publishes for its round."""
    a, newcomer = make_swarm(2)
    honest = {"slow": torch.arange(4.0), "momentum": torch.zeros(4)}
    a.state.offer({"protocol": "diloco", "round": 3}, {"slow": -torch.arange(4.0), "momentum": torch.zeros(4)})
    heard = {a.peer_id: {"round": 3, "digests": {"3": state_digest(honest)}}}
    with pytest.raises(StateUnavailable, match="a state of round 3 other than the one it publishes for that round"):
        newcomer.state.fetch(heard, timeout=15, progress=lambda: heard)
    a.state.offer({"protocol": "diloco", "round": 3}, honest)
    donor, (meta, tensors) = newcomer.state.fetch(heard, timeout=15, progress=lambda: heard)
    assert donor == a.peer_id and torch.equal(tensors["slow"], honest["slow"])


def test_the_state_most_donors_publish_is_downloaded_not_a_lone_members_other_one(make_swarm, monkeypatch):
    """Three members at round 3: two publish and serve the swarm's state, one another (its own digest of it).
    The newcomer asks the two first, whatever the random order (here: the lone one first); before, it
    downloaded whatever the first in random order served."""
    a, b, lone, newcomer = make_swarm(4)
    state = {"slow": torch.arange(4.0), "momentum": torch.zeros(4)}
    other = {"slow": torch.full((4,), 7.0), "momentum": torch.zeros(4)}
    for member, held in ((a, state), (b, state), (lone, other)):
        member.state.offer({"protocol": "diloco", "round": 3}, held)
    heard = {m.peer_id: {"round": 3, "digests": {"3": state_digest(held)}}
             for m, held in ((a, state), (b, state), (lone, other))}
    lone_first = SimpleNamespace(shuffle=lambda peers: peers.sort(key=lambda p: p != lone.peer_id))
    monkeypatch.setattr("decentral.swarm.state.random", lone_first)  # (that module's only use of random)
    donor, (meta, tensors) = newcomer.state.fetch(heard, timeout=15)
    assert donor in (a.peer_id, b.peer_id) and torch.equal(tensors["slow"], state["slow"])
