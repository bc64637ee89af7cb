"""Averages between real swarm peers when some of them misbehave or die: the honest peers' results
stay finite, within a stated bound of the honest mean, and nobody waits out the timeout for a dead peer."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import torch

from conftest import run_in_threads
from decentral.swarm import SwarmPeer
from decentral.swarm.mailbox import Mailbox, Message
from decentral.swarm.wire import read_frame, write_message

CHILD_PEER = """
import os, sys, time
os.environ["HIVEMIND_LOGLEVEL"] = "ERROR"
from decentral.swarm import SwarmTransport
t = SwarmTransport(sys.argv[1], [sys.argv[2]], timeout=30.0, heartbeat_s=0.5)
print(t.peer_id, flush=True)
time.sleep(600)
"""


def killed_peer(first) -> str:
    """The id of a swarm peer, in another process, that was SIGKILLed."""
    child = subprocess.Popen([sys.executable, "-c", CHILD_PEER, first.peer.run, first.multiaddrs()[0]],
                             stdout=subprocess.PIPE, text=True)
    try:
        peer_id = child.stdout.readline().strip()
        assert peer_id, "the peer did not start"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    return peer_id


def test_a_sigkilled_partner_costs_seconds_not_the_timeout(make_swarm):
    (me,) = make_swarm(1, timeout=30.0)
    partner = killed_peer(me)
    start = time.monotonic()
    result = me.average(torch.randn(1000), sorted([me.peer_id, partner]), "killed")
    assert time.monotonic() - start < 5.0  # the timeout is 30 s
    assert not result.complete and result.absent == [partner]


def test_survivors_redo_the_average_without_a_dead_member_and_agree(make_swarm):
    a, b = make_swarm(2, timeout=30.0)
    dead = killed_peer(a)
    group = sorted([a.peer_id, b.peer_id, dead])
    xs = [torch.randn(900), torch.randn(900)]
    start = time.monotonic()
    ra, rb = run_in_threads([lambda p=p, x=x: p.average(x, group, "redo") for p, x in zip((a, b), xs)])
    assert time.monotonic() - start < 5.0
    for r in (ra, rb):  # without the redo each would keep its own values for the dead member's chunk
        assert r.complete and r.absent == [dead] and r.group == sorted([a.peer_id, b.peer_id])
        torch.testing.assert_close(r.tensor, (xs[0] + xs[1]) / 2, rtol=0, atol=1e-6)
    start = time.monotonic()  # the next average leaves the dead member out from the start
    ra, rb = run_in_threads([lambda p=p, x=x: p.average(x, group, "next") for p, x in zip((a, b), xs)])
    assert ra.complete and rb.complete and ra.absent == [dead] and time.monotonic() - start < 5.0


def honest_and_bad(make_swarm, n=4, **kwargs):
    peers = make_swarm(n, **kwargs)
    group = sorted(p.peer_id for p in peers)
    xs = [torch.randn(400, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    return peers, group, xs


def test_a_member_at_minus_99_times_the_update_is_rejected_and_excluded(make_swarm):
    peers, group, xs = honest_and_bad(make_swarm)
    xs[3] = -99 * xs[3]
    results = run_in_threads([lambda p=p, x=x: p.average(x, group, "flip") for p, x in zip(peers, xs)])
    honest_mean = sum(xs[:3]) / 3
    bad = peers[3].peer_id
    for p, r in zip(peers[:3], results[:3]):
        assert "exceeds the bound" in r.rejected[bad]
        assert bad in p.averager.banned
        chunks = torch.tensor_split(torch.arange(400), 4)
        for j, owner in enumerate(group):
            if owner != bad:  # chunks the honest peers own: exactly the honest mean
                torch.testing.assert_close(r.tensor[chunks[j]], honest_mean[chunks[j]], rtol=0, atol=1e-5)
    # the next average: the excluded member is neither waited for nor trusted
    start = time.monotonic()
    again = run_in_threads([lambda p=p, x=x: p.average(x, group, "after") for p, x in zip(peers[:3], xs[:3])])
    assert time.monotonic() - start < 5.0
    assert all("excluded" in r.rejected[bad] for r in again)


def test_trimmed_aggregation_keeps_one_member_within_the_others_range(make_swarm):
    """A member whose part is inside the norm bound but far from the others moves a trimmed mean only
    inside the honest values' range, coordinate by coordinate."""
    peers, group, xs = honest_and_bad(make_swarm, aggregation="trimmed", max_norm_ratio=10.0)
    honest = torch.stack(xs[:3])
    low, high = honest.min(0).values, honest.max(0).values
    xs[3] = high + 5  # every coordinate beyond the honest range, the norm inside the bound
    results = run_in_threads([lambda p=p, x=x: p.average(x, group, "trim") for p, x in zip(peers, xs)])
    for r in results[:3]:
        assert torch.isfinite(r.tensor).all()
        assert bool(((r.tensor >= low - 1e-5) & (r.tensor <= high + 1e-5)).all())


async def push_raw(sender: SwarmPeer, target: str, header: dict, payload: bytes) -> bytes | None:
    """A hand-made push; the answer frame, or None when the receiver closed the stream without one."""
    reader, writer = await sender.open_stream(target, "push")
    await write_message(writer, header, payload, sender.stats)
    try:
        return await read_frame(reader, sender.stats, 1)
    except asyncio.IncompleteReadError:
        return None


def test_a_push_announcing_a_huge_part_is_dropped_before_reading_it(make_swarm):
    me, member = make_swarm(2)
    me.average(torch.randn(100), [me.peer_id], "sized")  # parts now fit 100 elements at most
    header = {"tag": "x/r", "wire": "float32", "view": "", "numel": 1 << 40}
    assert member.peer.call(push_raw(member.peer, me.peer_id, header, b"")).result(timeout=10) is None
    assert not me.averager.mailbox.senders("x/r")


def test_pushes_from_a_peer_without_a_heartbeat_are_refused(make_swarm):
    a, b = make_swarm(2)
    stranger = SwarmPeer(a.peer.run, a.multiaddrs())  # in the DHT, but no heartbeat: not a member
    try:
        header = {"tag": "s/r", "wire": "float32", "view": "", "numel": 2}
        answer = stranger.call(push_raw(stranger, a.peer_id, header, torch.ones(2).numpy().tobytes())).result(timeout=10)
        assert answer == b"\x00"  # refused, unread
        assert not a.averager.mailbox.senders("s/r")
        xs = [torch.randn(50), torch.randn(50)]
        ra, rb = run_in_threads([lambda p=p, x=x: p.average(x, sorted([a.peer_id, b.peer_id]), "s") for p, x in zip((a, b), xs)])
        torch.testing.assert_close(ra.tensor, (xs[0] + xs[1]) / 2, rtol=0, atol=1e-6)
    finally:
        stranger.shutdown()


def test_a_flood_from_one_sender_never_erases_another_senders_part():
    async def scenario():
        box = Mailbox(per_sender=16)
        await box.put("round/7/r", Message("honest", 1.0, torch.ones(3)))
        for i in range(300):
            await box.put(f"junk/{i}/r", Message("flooder", 1.0, torch.zeros(3)))
        got = await box.collect("round/7/r", {"honest"}, asyncio.get_running_loop().time() + 1)
        return got, box.senders("junk/299/r"), box.senders("junk/0/r")

    got, newest, oldest = asyncio.run(scenario())
    assert torch.equal(got["honest"].tensor, torch.ones(3))
    assert newest == {"flooder"} and oldest == set()  # the flooder's own oldest went
