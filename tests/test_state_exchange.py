"""The state exchange on real peers: a newcomer downloads a state in shares from the peers that hold it."""

import torch

from decentral.transport import EncodedAverage, state_digest


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
    not ended round 3 yet): rounds 1 and 2 come one from each, and round 3 at the next call, from the donor.
    (Before, a holder that lacked the donor's last round sent nothing, and the donor all of them alone.)"""
    a, b, newcomer = make_swarm(3)
    codec, n = newcomer.averager.codec, 100_000
    base = {k: torch.randn(n) for k in ("slow", "momentum", "other")}  # as many bytes as the three rounds (kept)
    averages = [torch.randn(n) for _ in range(3)]
    digests = [state_digest(base)] + [f"state after round {r}" for r in (1, 2, 3)]
    for holder, rounds in ((a, 3), (b, 2)):
        holder.state.offer({"protocol": "diloco", "round": 0}, base)
        holder.state.rounds.want(digests[0])
        for r in range(1, rounds + 1):
            holder.state.offer({"protocol": "diloco", "round": r}, base, digests[r],
                               EncodedAverage(codec, [(codec.encode(averages[r - 1]), n)]))
    sent = [a.bytes_sent, b.bytes_sent]
    rounds, _ = newcomer.state.fetch_rounds([a.peer_id, b.peer_id], digests[0], n, codec, timeout=15)
    assert [(r.meta["round"], r.digest) for r in rounds] == [(1, digests[1]), (2, digests[2])]
    assert all(torch.equal(r.average.decode(), average) for r, average in zip(rounds, averages))
    for peer, before in zip((a, b), sent):
        assert 4 * n < peer.bytes_sent - before < 1.2 * 4 * n  # one round's float32 average each
    rounds, _ = newcomer.state.fetch_rounds([a.peer_id, b.peer_id], digests[2], n, codec, timeout=15)
    assert [r.meta["round"] for r in rounds] == [3] and torch.equal(rounds[0].average.decode(), averages[2])
