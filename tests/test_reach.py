"""A joining peer asks a member to dial it back: real swarm peers on loopback (127.0.0.0/8 is one machine's,
so a peer announcing 127.0.0.3 while its connections come from 127.0.0.1 stands for a wrong --announce-host)."""

import asyncio

import pytest
from conftest import free_port, wait_until
from decentral.swarm import SwarmPeer
from decentral.swarm.reach import MAX_ADDRESSES, _ask, ip_and_port, reach_warning


def test_a_member_dials_back_the_address_we_come_from_and_public_ones_only(make_swarm):
    member, joiner = make_swarm(2)
    ours = int(ip_and_port(joiner.multiaddrs()[0])[1])
    closed = free_port()  # nothing listens there
    answer = joiner.peer.call(_ask(joiner.peer, member.peer_id, [("127.0.0.1", ours), ("127.0.0.1", closed),
                                                                 ("127.0.0.3", ours)])).result(timeout=30)
    assert answer == {"from": "127.0.0.1", "found": [["127.0.0.1", ours, "accepted"], ["127.0.0.1", closed, "refused"],
                                                     ["127.0.0.3", ours, "untried"]]}  # a private address elsewhere
    too_many = [("127.0.0.1", ours)] * (MAX_ADDRESSES + 1)
    with pytest.raises(asyncio.IncompleteReadError):  # refused unanswered: no dial at all
        joiner.peer.call(_ask(joiner.peer, member.peer_id, too_many)).result(timeout=30)


def test_a_peer_announcing_an_address_it_does_not_come_from_is_told_the_one_it_does(make_swarm):
    member, joiner = make_swarm(2)
    via = member.multiaddrs()
    assert reach_warning(joiner.peer, via) is None  # reached where it announces itself
    astray = SwarmPeer(member.peer.run, via, port=free_port(), announce_host="127.0.0.3")
    try:
        warning = reach_warning(astray, via)
    finally:
        astray.shutdown()
    assert warning is not None and "come from 127.0.0.1, but it announces 127.0.0.3" in warning
    assert "give --announce-host 127.0.0.1" in warning


def test_swarm_start_joining_with_a_wrong_announce_host_warns_before_serving(make_swarm, prefork, tmp_path):
    member, = make_swarm(1)
    log = tmp_path / "entry.log"
    entry = prefork.spawn(["swarm", "start", "--run", member.peer.run, "--join", member.multiaddrs()[0],
                           "--announce-host", "127.0.0.3", "--port", str(free_port())], log, cwd=tmp_path)
    try:
        wait_until(lambda: log.exists() and "Ctrl-C to stop." in log.read_text(), 60, "the entry serving")
    finally:
        entry.terminate()
        entry.wait(30)
    printed = log.read_text()
    assert "give --announce-host 127.0.0.1" in printed, printed
    assert printed.index("give --announce-host 127.0.0.1") < printed.index("Peers join with")
