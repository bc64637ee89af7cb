"""Membership over a real DHT: all peers derive the same round members; leaving and dying both drop a peer."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import running, wait_until
from decentral.cpu import descendants
from decentral.swarm import SwarmError, SwarmPeer
from decentral.swarm import peer as peer_module
from decentral.swarm.peer import _DHTProcess
from decentral.swarm.transport import HEARTBEAT_STALL_S


def test_every_peer_sees_the_same_members_for_a_round(make_swarm):
    peers = make_swarm(3)
    for p in peers[:2]:
        p.join_rounds(5)
    expected = sorted(p.peer_id for p in peers[:2])
    for p in peers:
        assert p.members(5) == expected  # the third never announced round 5
        assert p.members(7) == expected  # announced ahead (lookahead 2)
        assert p.members(8) == []


async def forget_every_neighbour(dht, node) -> int:
    """(In a DHT process) what a request to each neighbour that timed out does: drop it from the routing table."""
    table = node.protocol.routing_table
    for node_id in list(table.uid_to_peer_id):
        del table[node_id]
    return len(table.uid_to_peer_id)


async def count_neighbours(dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def test_two_peers_whose_dht_nodes_dropped_each_other_find_each_other_again(make_swarm):
    """hivemind drops a DHT neighbour at its first unanswered request: two peers that each timed out once on the
    other (a busy moment) stopped seeing each other's records for good: two resumed peers trained apart to the
    end, each alone in its rounds. The membership's heartbeat now pings the peer it joined through again."""
    peers = make_swarm(2)
    assert [p.peer.dht.run_coroutine(forget_every_neighbour) for p in peers] == [0, 0]
    for p in peers:
        p.join_rounds(5)
    both = sorted(p.peer_id for p in peers)
    wait_until(lambda: all(p.members(5) == both for p in peers), 15, "each peer seeing the other's round again")


def test_pinging_a_frozen_entry_peer_holds_up_no_caller(make_swarm):
    """keep_in_touch ran on the membership's heartbeat thread and the pipeline's server view, and waited out a
    frozen entry peer's dial and ping (up to two RPC timeouts): the next beat, the view's refresh, waited too."""
    entry, peer = make_swarm(2)
    peer.membership._stop.set()  # no heartbeat's own calls in between
    peer.membership._thread.join()
    assert peer.peer.dht.run_coroutine(forget_every_neighbour) == 0
    os.kill(entry.peer.dht.pid, signal.SIGSTOP)  # its libp2p daemon takes the ping; its DHT node cannot answer
    try:
        peer.peer.keep_in_touch()
        pinging = peer.peer._pinging
        assert pinging is not None and not pinging.done()  # returned with the ping under way
        peer.peer.keep_in_touch()
        assert peer.peer._pinging is pinging  # and sends none while it is
    finally:
        os.kill(entry.peer.dht.pid, signal.SIGCONT)
    pinging.result(timeout=30)
    wait_until(lambda: peer.peer.keep_in_touch() or peer.peer.dht.run_coroutine(count_neighbours) == 1, 15,
               "the entry peer in the table again")


def test_a_peer_that_closes_drops_out_at_once(make_swarm):
    peers = make_swarm(3)
    for p in peers:
        p.join_rounds(0)
    assert len(peers[0].members(1)) == 3
    peers[2].close()
    assert peers[2].peer_id not in peers[0].members(1)
    assert peers[2].peer_id not in peers[1].membership.alive()


def test_a_silent_peer_expires_after_the_sync_timeout_or_a_few_dht_request_timeouts(make_swarm):
    peers = make_swarm(2, heartbeat_s=0.5, timeout=3.0)
    assert peers[0].membership.expire_s == HEARTBEAT_STALL_S == 9.0
    peers[1].membership._stop.set()  # heartbeats stop, as when the process is frozen or killed
    peers[1].membership._thread.join()
    deadline = time.monotonic() + 15
    while peers[1].peer_id in peers[0].membership.alive():
        assert time.monotonic() < deadline, "a peer without heartbeats never expired"
        time.sleep(0.1)  # polling the DHT for the expiry


def test_a_fixed_port_a_peer_listens_on_is_refused_and_a_restart_takes_its_own_back(tmp_path):
    """p2pd listens with SO_REUSEPORT: a second peer on a port taken by another came up beside it (which was
    no longer reached) instead of failing. A peer restarted under its identity still gets its port back."""
    run, identity = f"t{time.monotonic_ns()}", tmp_path / "identity.key"
    first = SwarmPeer(run, identity_path=identity)
    port = int(first.multiaddrs()[0].split("/")[4])
    try:
        with pytest.raises(SwarmError, match=f"cannot listen on 127.0.0.1:{port}: the port is in use"):
            SwarmPeer(run, port=port)
    finally:
        first.shutdown()
    SwarmPeer(run, port=port, identity_path=identity).shutdown()


def test_a_peer_whose_dht_process_died_says_so_and_shuts_down():
    """A DHT call on a DHT process that died (killed, or by the OOM killer) would never return: a lookup
    under way when it dies, and any after, raise SwarmError, and the peer still shuts down."""
    peer = SwarmPeer(f"t{time.monotonic_ns()}")
    failures = []

    def look_up_until_it_fails():
        try:
            while True:
                peer.lookup("servers")
        except SwarmError as e:
            failures.append(e)

    looking = threading.Thread(target=look_up_until_it_fails, daemon=True)
    looking.start()
    wait_until(lambda: peer._dht_lock.locked(), 10, "a lookup under way")
    os.kill(peer.dht.pid, signal.SIGKILL)
    looking.join(30)
    assert not looking.is_alive() and "DHT process" in str(failures[0])
    with pytest.raises(SwarmError, match="cannot reach the swarm"):
        peer.publish("peers", peer.peer_id, {}, ttl=5)
    closing = threading.Thread(target=peer.shutdown, daemon=True)
    closing.start()
    closing.join(60)
    assert not closing.is_alive()


ORPHAN_OWNER = """
import asyncio, sys, time
from decentral.swarm.peer import _DHTProcess

class HangingShutdown(_DHTProcess):
    orphan_grace_s = 1.0

    async def _shutdown(self):  # as a shutdown whose daemon went first can: it never finishes
        await asyncio.Event().wait()

dht = HangingShutdown(start=True)
dht._outer_pipe.send(("_shutdown", [], {}))  # the owner's own shutdown request, then it is killed
print(dht.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads the process tree from Linux /proc")
def test_a_dht_process_whose_owner_dies_mid_shutdown_ends_itself_and_its_daemon(tmp_path):
    """The owner sent the DHT process its shutdown request and was SIGKILLed (as the launcher kills a node slow
    to stop); that shutdown hangs. The DHT process and its libp2p daemon still end, within the grace period."""
    owner = subprocess.Popen([sys.executable, "-c", ORPHAN_OWNER], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        dht_pid = int(owner.stdout.readline())
        below = {dht_pid} | descendants(dht_pid)
        assert len(below) >= 2, "the DHT process runs its own libp2p daemon"
    finally:
        owner.kill()
        owner.wait()
    try:
        wait_until(lambda: not any(running(pid) for pid in below), 30, "the orphaned DHT process and its daemon to end")
    finally:
        for pid in filter(running, below):  # left behind when the test fails
            os.kill(pid, signal.SIGKILL)


class StuckShutdown(_DHTProcess):
    kill_grace_s = 1.0

    async def _shutdown(self):  # a loop stuck in a callback: the SIGTERM's interrupt, queued on it, never runs
        time.sleep(600)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads the process tree from Linux /proc")
def test_a_dht_process_whose_shutdown_is_stuck_ends_with_its_daemon_while_its_owner_lives():
    """hivemind's shutdown asks, waits, then sends SIGTERM and returns: a DHT process stuck (or stopped) went on
    living beside the process that started it, its libp2p daemon a zombie (seen once in a test run). It is
    killed, with its daemon, once the SIGTERM has had its grace period."""
    dht = StuckShutdown(start=False)
    below = set()
    try:
        dht.run_in_background(await_ready=True, timeout=60)  # (one that never came up would hang the suite)
        below = {dht.pid} | descendants(dht.pid)
        assert len(below) >= 2, "the DHT process runs its own libp2p daemon"
        sockets = [path for pid in below for path in peer_module._daemon_sockets(pid)]
        assert len(sockets) == 2 and os.path.exists(sockets[0]), sockets  # the daemon's (hivemind's: once it serves)
        shutting = threading.Thread(target=dht.shutdown, daemon=True)
        shutting.start()
        shutting.join(60)
        assert not shutting.is_alive(), "the shutdown returned"
        wait_until(lambda: not any(running(pid) for pid in below), 10, "the DHT process and its daemon to end")
    finally:
        for pid in filter(running, below | ({dht.pid} if dht.pid else set())):  # left behind when the test fails
            os.kill(pid, signal.SIGKILL)
    assert not any(os.path.exists(path) for path in sockets), sockets  # (each killed peer left both in /tmp)


def test_a_peer_that_fails_to_start_leaves_no_dht_process_behind(monkeypatch):
    """A failure (or Ctrl-C) after its DHT process started left that process running for the life of ours."""
    started = set()

    def failing(peer):
        started.update({peer.dht.pid} | descendants(peer.dht.pid))
        raise RuntimeError("the reach-check service could not start")

    monkeypatch.setattr(peer_module, "serve_reach_checks", failing)
    with pytest.raises(RuntimeError, match="reach-check"):
        SwarmPeer(f"t{time.monotonic_ns()}")
    assert len(started) >= 2, "the DHT process runs its own libp2p daemon"
    try:
        wait_until(lambda: not any(running(pid) for pid in started), 15, "the DHT process and its daemon to end")
    finally:
        for pid in filter(running, started):  # left behind when the test fails
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("setting", [{"aggregation": "median"}, {"hang_s": 1.0}])
def test_a_transport_refused_for_a_setting_leaves_no_peer_behind(setting):
    """The peer and its heartbeat were up before the averager refused the setting: a live ghost member, beating
    its heartbeat and serving no average, for the life of the process."""
    from decentral.swarm.transport import SwarmTransport

    def started() -> set[int]:  # (but the helpers a library's first use starts and keeps)
        return {pid for pid in descendants(os.getpid()) - before if running(pid) and not _library_helper(pid)}

    before = descendants(os.getpid())
    with pytest.raises(SwarmError, match="aggregation|hang_s"):
        SwarmTransport(f"t{time.monotonic_ns()}", **setting)
    wait_until(lambda: not started(), 15, "the DHT process and its daemon to end")
    assert not [t for t in threading.enumerate() if t.name == "heartbeat" and t.is_alive()]


def _library_helper(pid: int) -> bool:
    """Whether `pid` is multiprocessing's resource tracker or torch's shared-memory manager, which live on."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"resource_tracker" in cmdline or b"torch_shm_manager" in cmdline


def test_why_a_join_failed_is_told_also_from_inside_a_running_event_loop():
    """A notebook's cell runs in an event loop: the diagnosis of a join that failed (asyncio.run of a plain dial)
    raised "asyncio.run() cannot be called from a running event loop" instead of saying what was wrong."""
    import asyncio
    import socket

    from decentral.swarm.peer import startup_error

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # (nothing listens there once closed)
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"

    async def in_a_loop():
        return startup_error(RuntimeError("bootstrap failed"), [address], "127.0.0.1", 0)

    said = asyncio.run(in_a_loop())
    assert said.startswith(f"could not reach any peer at {address}: nothing answered there"), said


A_PEER_KILLED_HOLDING_A_LOCK = """
import os, signal, time
from hivemind.utils.mpfuture import MPFuture
from decentral.swarm import SwarmPeer

async def take_the_update_lock(dht, node):  # (in the DHT process) as one sending a result does, then it is killed
    MPFuture._update_lock.acquire()

def held_elsewhere(lock) -> bool:
    if lock.acquire(block=False):
        lock.release()
        return False
    return True

peer = SwarmPeer("t-killed-holding-a-lock")
peer.dht.run_coroutine(take_the_update_lock, return_future=True)
while not held_elsewhere(MPFuture._update_lock):
    time.sleep(0.01)
os.kill(peer.dht.pid, signal.SIGKILL)
peer.shutdown()
after = SwarmPeer("t-after-the-killed-one")
after.publish("peers", after.peer_id, {"up": 1}, ttl=30)
print("looked up:", after.lookup("peers"), flush=True)
after.shutdown()
"""


def test_a_dht_process_killed_holding_hiveminds_shared_lock_does_not_stall_the_next_one():
    """hivemind's MPFuture locks are shared by every process forked after import: a DHT process killed outright
    (the OOM killer, our own last-resort SIGKILL) while it held one left it held for good, and every DHT process
    started after it stalled on its first answer. (In a process of its own: on the old code it hangs.)"""
    try:
        done = subprocess.run([sys.executable, "-c", A_PEER_KILLED_HOLDING_A_LOCK], capture_output=True, text=True,
                              timeout=90)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the peer started after the killed one stalled: {e.stdout}{e.stderr}")
    assert "looked up: {" in done.stdout and "'up': 1" in done.stdout, done.stdout + done.stderr


def test_a_peer_whose_dht_process_took_the_groups_sigterm_leaves_without_a_warning(caplog):
    """`timeout` or a scheduler's cancel sends SIGTERM to the whole process group: the DHT process ends first,
    and the member's orderly stop ended in a warning that it could not announce leaving."""
    from decentral.swarm.transport import SwarmTransport

    member = SwarmTransport(f"t{time.monotonic_ns()}", heartbeat_s=0.5)
    os.kill(member.peer.dht.pid, signal.SIGTERM)
    member.peer.dht.join(30)
    assert member.peer.dht.exitcode == 0
    with caplog.at_level(logging.INFO, logger="decentral.swarm.membership"):
        member.close()
    assert [r.levelname for r in caplog.records if "could not announce leaving" in r.getMessage()] == ["INFO"]
