"""Admission to a swarm, on real peers: a swarm key keeps strangers off our records and out of every
stream, and records are signed by the peer they describe, key or no key."""

import asyncio
import os
import stat
import tempfile
import time

import pytest
import torch

from conftest import run_in_threads, write_recipe
from decentral.cli import main
from decentral.swarm import AdmissionError, SwarmKey, SwarmPeer
from decentral.swarm.monitor import SwarmMonitor
from decentral.swarm.wire import read_frame, write_frame


async def knock(sender: SwarmPeer, target: str, stream: str) -> bytes | None:
    """Open `stream` to `target`, send a small request; the first frame answered, or None when closed unread."""
    reader, writer = await sender.open_stream(target, stream)
    try:  # a refusal may close the stream before our request is even written
        await write_frame(writer, b'{"tag": "x/r", "wire": "float32", "view": "", "numel": 2}', sender.stats)
        return await asyncio.wait_for(read_frame(reader, sender.stats, 1 << 20), 15)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    finally:
        writer.close()


@pytest.fixture
def keyed_swarm(make_swarm, tmp_path):
    key = SwarmKey.generate(tmp_path / "swarm.key")
    a, b = make_swarm(2, swarm_key=key)
    a.state.offer({"protocol": "noloco", "round": 3}, {"slow": torch.ones(4)})
    return a, b


@pytest.mark.parametrize("stranger_key", ["none", "another"])
def test_a_stranger_without_the_key_reads_no_record_writes_none_and_is_refused_on_every_stream(
        keyed_swarm, tmp_path, stranger_key):
    a, b = keyed_swarm
    key = SwarmKey.generate(tmp_path / "other.key") if stranger_key == "another" else None
    stranger = SwarmPeer(a.peer.run, a.multiaddrs(), swarm_key=key)
    try:
        assert set(b.membership.alive()) == {a.peer_id, b.peer_id}
        assert stranger.lookup("peers") == {}  # sealed: nothing it can read
        stranger.publish("peers", stranger.peer_id, {"step": 0, "round": 0}, ttl=60)
        stranger.publish(f"round/{5}", stranger.peer_id, True, ttl=60)
        assert stranger.peer_id not in b.membership.alive() and b.membership.members(5) == []
        a.join_requests()  # from now on a queues join requests, as a DDP peer does
        for stream in ("push", "state", "ping", "join"):
            assert stranger.call(knock(stranger, a.peer_id, stream)).result(timeout=30) is None, stream
        assert not a.averager.mailbox.senders("x/r") and a.join_requests() == []
        xs = [torch.randn(64), torch.randn(64)]  # the members still average, with each other only
        results = run_in_threads([lambda p=p, x=x: p.average(x, sorted([a.peer_id, b.peer_id]), "k")
                                  for p, x in zip((a, b), xs)])
        for r in results:
            assert r.complete, (r.absent, r.rejected, r.disagree)  # why it did not commit (CI failed once here)
            torch.testing.assert_close(r.tensor, (xs[0] + xs[1]) / 2, rtol=0, atol=1e-6)
    finally:
        stranger.shutdown()


def test_members_holding_the_key_download_state(keyed_swarm):
    a, b = keyed_swarm
    donor, (meta, tensors) = b.state.fetch({a.peer_id: {"round": 3}}, timeout=15)
    assert donor == a.peer_id and meta["round"] == 3 and torch.equal(tensors["slow"], torch.ones(4))


def test_records_are_signed_by_the_peer_they_describe(make_swarm):
    a, b = make_swarm(2)  # an open swarm: signatures hold without a key
    b.peer.publish("peers", a.peer_id, {"step": 0, "round": 0, "left": True}, ttl=3600)  # b forges a's leaving
    b.peer.publish("round/9", a.peer_id, True, ttl=3600)  # and a's announcement
    b.membership.announce(9)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # a few heartbeats: a forged record would have shown by then
        assert a.peer_id in b.membership.alive()
        assert b.membership.members(9) == [b.peer_id]
        time.sleep(0.5)


def test_a_fresh_identitys_private_key_is_gone_from_disk_once_its_peer_or_monitor_runs(make_swarm, monkeypatch):
    folder = tempfile.mkdtemp(prefix="ident-")  # where the peers' fresh identities go (short: see startup_error)
    monkeypatch.setattr(tempfile, "tempdir", folder)
    a, b = make_swarm(2)
    monitor = SwarmMonitor(a.peer.run, a.multiaddrs())  # checks the records with a key of its own
    try:
        assert os.listdir(folder) == []  # nothing left for a process killed from now on to leave behind
        assert {r["id"] for r in monitor.rows()} == {a.peer_id, b.peer_id}
    finally:
        monitor.close()
    xs = [torch.randn(64), torch.randn(64)]  # and the peers, their daemons and signed records work on
    for r in run_in_threads([lambda p=p, x=x: p.average(x, sorted([a.peer_id, b.peer_id]), "k")
                             for p, x in zip((a, b), xs)]):
        assert r.complete, (r.absent, r.rejected, r.disagree)
        torch.testing.assert_close(r.tensor, (xs[0] + xs[1]) / 2, rtol=0, atol=1e-6)
    os.rmdir(folder)


def test_swarm_keygen_writes_a_private_key_and_never_overwrites_one(tmp_path, capsys):
    path = tmp_path / "swarm.key"
    assert main(["swarm", "keygen", str(path)]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_text().strip()) == 64
    before = path.read_text()
    assert main(["swarm", "keygen", str(path)]) == 2
    assert "exists" in capsys.readouterr().err and path.read_text() == before
    SwarmKey.load(path)


@pytest.mark.parametrize("mode,who", [(0o644, "every user of this machine"), (0o640, "the members of its group"),
                                      (0o600, None)])
def test_a_key_file_others_can_read_is_said_to_be(tmp_path, capsys, mode, who):
    """A key copied with the wrong mode (scp, a shared folder) let other users of a machine join the swarm, and
    nothing said so. A note says who can read it, and how to keep it yours; the command goes on."""
    path = tmp_path / "swarm.key"
    assert main(["swarm", "keygen", str(path)]) == 0
    path.chmod(mode)
    capsys.readouterr()
    nobody = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"  # a port nothing holds
    assert main(["status", "--swarm-key", str(path), "--join", nobody, "--once"]) == 2
    err = capsys.readouterr().err.splitlines()
    notes = [line for line in err if "can read the swarm key" in line]
    assert notes == ([] if who is None else [f"note: {who} can read the swarm key {path} (mode {mode:o}), and whoever "
                                              f"reads it can join the swarm; `chmod 600 {path}` keeps it yours"])
    assert "could not reach any peer" in err[-1]


def test_a_malformed_key_file_stops_training_before_it_starts(tmp_path, capsys):
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    with pytest.raises(AdmissionError, match="not a swarm key"):
        SwarmKey.load(bad)
    assert main(["train", "--swarm-key", str(bad), "--out", str(tmp_path / "run"), "--steps", "1"]) == 2
    assert "not a swarm key" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("joiner_key", ["none", "another"])
def test_a_worker_joining_a_keyed_swarm_without_its_key_stops_instead_of_training_alone(
        keyed_swarm, tmp_path, small_corpus, prefork, joiner_key):
    a, _ = keyed_swarm
    recipe = write_recipe(tmp_path / "r.yaml", {"name": "diloco", "every": 5}, steps=10)
    args = ["train", "--protocol", str(recipe), "--run", a.peer.run, "--join", a.multiaddrs()[0],
            "--data", str(small_corpus), "--out", "joiner"]
    if joiner_key == "another":
        SwarmKey.generate(tmp_path / "other.key")
        args += ["--swarm-key", str(tmp_path / "other.key")]
    done = prefork.run(args, tmp_path, timeout=120)
    expected = "is keyed" if joiner_key == "none" else "do not open with swarm key"
    assert done.returncode == 2 and expected in done.stderr, done.stdout + done.stderr
    assert not (tmp_path / "joiner" / "metrics.jsonl").exists()  # it trained no step alone
