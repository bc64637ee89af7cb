"""The state exchange on real peers: a newcomer downloads a state in shares from the peers that hold it."""

import torch

from decentral.transport import state_digest


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
