"""HierarchicalTransport: 2 islands x 2 gloo ranks (one process per rank), joined by a real swarm on
loopback; results checked against arithmetic done here in the parent."""

from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest
import torch

from conftest import free_port
from decentral.hierarchy import HierarchicalTransport, shard_bounds, shard_run
from decentral.island import IslandTransport
from decentral.swarm import SwarmTransport
from decentral.transport import state_digest

TIMEOUT = 90.0  # seconds for a whole run of both islands
ISLANDS, SIZE = 2, 2


def _rank_main(fn, island: int, rank: int, port: int, mode: str, join: list[str], addrs, queue) -> None:
    try:
        def connect(r: int, leader_addrs: list[str]) -> SwarmTransport:
            return SwarmTransport(shard_run("hier", r), [*join, *leader_addrs], timeout=15.0, heartbeat_s=0.5)

        transport = HierarchicalTransport(
            IslandTransport(f"tcp://127.0.0.1:{port}", rank, SIZE, backend="gloo", timeout=30.0), connect,
            mode=mode, timeout_s=60.0)
        try:
            if island == 0 and rank == 0:
                addrs.put(transport.multiaddrs())
            queue.put((island, rank, "ok", fn(transport, island, rank)))
        finally:
            transport.close()
    except BaseException:
        queue.put((island, rank, "error", traceback.format_exc()))


def run_islands(fn, mode: str) -> dict[tuple[int, int], object]:
    """fn(transport, island, rank) on every rank of 2 islands of 2; {(island, rank): its return value}."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "decentral.swarm", "decentral.hierarchy", __name__])
    queue, addrs = ctx.Queue(), ctx.Queue()
    procs = []

    def start(island: int, join: list[str]) -> None:
        port = free_port()
        for rank in range(SIZE):
            procs.append(ctx.Process(target=_rank_main, args=(fn, island, rank, port, mode, join, addrs, queue)))
            procs[-1].start()

    try:
        start(0, [])
        try:
            join = addrs.get(timeout=TIMEOUT)
        except Exception:
            raise AssertionError(f"island 0 did not come up: {[queue.get(timeout=1) for _ in range(SIZE)]}") from None
        start(1, join)
        results = {}
        for _ in range(ISLANDS * SIZE):
            island, rank, status, value = queue.get(timeout=TIMEOUT)
            assert status == "ok", f"island {island} rank {rank} failed:\n{value}"
            results[island, rank] = value
        return results
    finally:
        for p in procs:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()


NUMEL = 11  # odd: the last shard is shorter


def rank_values(island: int, rank: int) -> torch.Tensor:
    return torch.arange(NUMEL, dtype=torch.float32) * (1 + island) + 10 * rank - 3 * island


def _average(transport: HierarchicalTransport, island: int, rank: int) -> dict:
    transport.join_rounds(0)
    transport.wait_for_peers(ISLANDS, 30.0)
    group = transport.members(0)
    future = transport.average_async(rank_values(island, rank), group, "avg", 0)
    result = future.result(timeout=60)
    looked_up = transport.average_async(rank_values(island, rank), None, "avg, members looked up", 0).result(timeout=60)
    try:  # fails on the connection(s) that average: every rank raises it, none waits in a collective
        transport.average(rank_values(island, rank), [g for g in group if g != transport.peer_id], "not ours", 0)
        error = None
    except ValueError as e:
        error = str(e)
    return {"error": error,"mean": result.tensor.tolist(), "sent": result.sent.tolist(), "group": result.group,
            "complete": result.complete, "contributors": result.contributors, "peer_id": transport.peer_id,
            "bytes_sent": transport.bytes_sent, "connections": transport.connections,
            "looked_up": (looked_up.tensor.tolist(), looked_up.group, looked_up.complete)}


@pytest.mark.parametrize("mode", ["leader", "sharded"])
def test_hierarchical_average_equals_the_flat_mean_of_all_ranks(mode):
    outs = run_islands(_average, mode)
    flat_mean = sum(rank_values(i, r) for i in range(ISLANDS) for r in range(SIZE)) / (ISLANDS * SIZE)
    islands = sorted({out["peer_id"] for out in outs.values()})
    assert len(islands) == ISLANDS  # the ranks of an island share one id, and the islands differ
    for (island, rank), out in outs.items():
        assert out["complete"] and out["contributors"] == ISLANDS
        assert "not in the group" in out["error"]
        assert out["group"] == islands
        assert out["looked_up"] == (out["mean"], islands, True)  # group None: the leader looked the members up
        torch.testing.assert_close(torch.tensor(out["mean"]), flat_mean)
        island_mean = sum(rank_values(island, r) for r in range(SIZE)) / SIZE
        torch.testing.assert_close(torch.tensor(out["sent"]), island_mean)  # what the island counted
    assert len({tuple(out["mean"]) for out in outs.values()}) == 1  # bit-identical on every rank
    for island in range(ISLANDS):
        leader, other = outs[island, 0], outs[island, 1]
        assert leader["connections"][0] == leader["peer_id"]
        assert leader["bytes_sent"] > 0
        if mode == "leader":  # only the leader talks to the swarm
            assert other["bytes_sent"] == 0 and other["connections"][1] is None
        else:  # every rank has its own connection and sends over it
            assert other["bytes_sent"] > 0 and other["connections"][1] not in (None, leader["peer_id"])


def test_shard_bounds_cover_a_tensor_once():
    for numel in (1, 7, 11, 12):
        for shards in (1, 2, 3, 4):
            covered = torch.cat([torch.arange(numel)[shard_bounds(numel, shards, i)] for i in range(shards)])
            assert covered.tolist() == list(range(numel))


def held(phi: torch.Tensor) -> dict[str, torch.Tensor]:
    """An outer state of φ and a momentum that stays 0 (a peer keeps rounds of at most its state's bytes)."""
    return {"phi": phi, "momentum": torch.zeros(NUMEL)}


def _replay(transport: HierarchicalTransport, island: int, rank: int) -> dict:
    """Both islands go through rounds 0 and 1 from one state, offering each state with the average that led to
    it; then island 1 asks island 0 for the rounds since the first state, as a newcomer holding it would."""
    transport.join_rounds(0)
    transport.wait_for_peers(ISLANDS, 30.0)
    group = transport.members(0)
    other = next(p for p in group if p != transport.peer_id)
    phi = torch.zeros(NUMEL)
    transport.offer_state({"round": 0, "step": 0}, held(phi))
    transport.average(rank_values(island, rank), group, "both offered", 0)
    assert transport.fetch_rounds(other, state_digest(held(phi)), NUMEL)[0] == []  # none yet; keep them from now
    results = []
    for r in (0, 1):  # a blocking average, then one in the background (CO2, Streaming DiLoCo)
        values = rank_values(island, rank) * (r + 2)
        result = (transport.average(values, group, f"round {r}", 0) if r == 0 else
                  transport.average_async(values, group, f"round {r}", 0).result(timeout=60))
        assert result.complete
        phi = phi + result.tensor
        transport.offer_state({"round": r + 1, "step": 10 * (r + 1)}, held(phi), led_by=result.encoded)
        results.append(result)
    transport.average(rank_values(island, rank), group, "both offered round 2", 0)  # island 0's last offer is in
    fetched = transport.fetch_rounds(other, state_digest(held(torch.zeros(NUMEL))), NUMEL) if island == 1 else None
    transport.average(rank_values(island, rank), group, "island 1 has them", 0)  # island 0 serves until then
    replayed, digests = torch.zeros(NUMEL), []
    for missed in (fetched[0] if fetched else []):
        replayed = replayed + missed.average.decode()
        digests.append((missed.digest, state_digest(held(replayed)), missed.meta["round"]))
    return {"encoded": [None if r.encoded is None else r.encoded.decode().tolist()
                                                      for r in results],
            "tensors": [r.tensor.tolist() for r in results], "digest": state_digest(held(phi)),
            "digests": digests, "replayed": replayed.tolist()}


@pytest.mark.parametrize("mode", ["leader", "sharded"])
def test_a_newcomer_island_replays_the_rounds_since_its_state_from_another_island(mode):
    outs = run_islands(_replay, mode)
    for (island, rank), out in outs.items():
        # the leader holds each round's average as it travelled (in sharded mode its shards' in order)
        assert out["encoded"] == (out["tensors"] if rank == 0 else [None, None]), (island, rank)
    for rank in range(SIZE):  # every rank of island 1 replayed both rounds and holds island 0's state, bit for bit
        replay = outs[1, rank]
        assert [d[2] for d in replay["digests"]] == [1, 2]
        assert all(published == ours for published, ours, _ in replay["digests"])
        assert replay["digests"][-1][0] == outs[0, 0]["digest"]
        assert replay["replayed"] == outs[1, 0]["replayed"]
