"""IslandTransport on real gloo groups over loopback: one process per rank, results checked
against arithmetic done independently here in the parent."""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import socket
import threading
import time
import traceback

import pytest
import torch

from conftest import free_port
from decentral.island import IslandError, IslandTransport, RendezvousError
from decentral.sync import DDP, DiLoCo

TIMEOUT = 30.0  # seconds for a whole island run; each rank's collectives time out after 20 s


def _rank_main(fn, rank: int, world_size: int, port: int, queue, timeout: float = 20.0) -> None:
    try:
        transport = IslandTransport(f"tcp://127.0.0.1:{port}", rank, world_size, backend="gloo", timeout=timeout)
        try:
            queue.put((rank, "ok", fn(transport, rank)))
        finally:
            transport.close()
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, sizes: list[int], timeout: float = 20.0) -> list[tuple[str, object]]:
    """Run fn(transport, rank) on a rank per entry of `sizes` (the world size that rank is given) of a fresh
    island; by rank, ("ok", what fn returned) or ("error", the traceback of what it raised)."""
    ctx = mp.get_context("forkserver")  # a clean process imports torch once; ranks fork from it
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "decentral.sync", __name__])  # optimizers load dynamo
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, size, port, queue, timeout)) for r, size in enumerate(sizes)]
    for p in procs:
        p.start()
    try:
        results: dict[int, tuple[str, object]] = {}
        for _ in procs:
            rank, status, value = queue.get(timeout=TIMEOUT)
            results[rank] = (status, value)
        return [results[r] for r in range(len(procs))]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def run_island(fn, world_size: int) -> list:
    """Run fn(transport, rank) on every rank of a fresh island; their return values, by rank."""
    results = run_ranks(fn, [world_size] * world_size)
    for rank, (status, value) in enumerate(results):
        assert status == "ok", f"rank {rank} failed:\n{value}"
    return [value for _, value in results]


# ----- average and its group check (one 3-rank island) -----

def rank_values(rank: int) -> torch.Tensor:
    return torch.arange(5, dtype=torch.float32) * (rank + 1) - rank


def _average(transport: IslandTransport, rank: int) -> dict:
    result = transport.average(rank_values(rank), transport.members(0), "t")
    try:
        transport.average(rank_values(rank), ["rank0", "rank1"], "subset")
        subset_error = None
    except ValueError as exc:
        subset_error = str(exc)
    return {"mean": result.tensor.tolist(), "group": result.group, "complete": result.complete,
            "contributors": result.contributors, "members": transport.members(7),
            "bytes": (transport.bytes_sent, transport.bytes_received), "subset_error": subset_error}


@pytest.fixture(scope="module")
def averaged() -> list[dict]:
    return run_island(_average, 3)


def test_average_over_three_ranks(averaged):
    expected = sum(rank_values(r) for r in range(3)) / 3
    ring_bytes = int(2 * 2 / 3 * 5 * 4)  # 5 values, fp32
    for out in averaged:
        torch.testing.assert_close(torch.tensor(out["mean"]), expected)
        assert out["group"] == out["members"] == ["rank0", "rank1", "rank2"]
        assert out["complete"] and out["contributors"] == 3
        assert out["bytes"] == (ring_bytes, ring_bytes)


def test_average_over_a_subset_raises(averaged):
    for out in averaged:
        assert out["subset_error"] is not None and "all ranks" in out["subset_error"]


# ----- DDP over an island equals one process stepping with the averaged gradient -----

def linear(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)) for _ in range(steps)]


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


DDP_STEPS = 3


def _ddp(transport: IslandTransport, rank: int) -> list[float]:
    model = linear(seed=rank)  # different on each rank: start() must make them identical
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with DDP(model, optimizer, transport):
        for x, y in batches(rank, DDP_STEPS):
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return flat(model).tolist()


def test_ddp_over_island_matches_single_process_with_averaged_gradient():
    world_size = 2
    finals = [torch.tensor(f) for f in run_island(_ddp, world_size)]
    assert torch.equal(finals[0], finals[1])

    model = linear(seed=0)  # rank 0's start, which every rank adopts
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [batches(r, DDP_STEPS) for r in range(world_size)]
    for step in range(DDP_STEPS):
        loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in (d[step] for d in data)) / world_size
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(finals[0], flat(model))


# ----- DiLoCo: identical start from different seeds, identical slow weights after an outer step -----

EVERY, INNER_LR, OUTER_LR, OUTER_MOMENTUM = 2, 0.1, 0.7, 0.9


def _diloco(transport: IslandTransport, rank: int) -> dict:
    model = linear(seed=10 + rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    protocol = DiLoCo(model, optimizer, transport, every=EVERY, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
    with protocol:
        start = flat(model).tolist()
        for x, y in batches(rank, EVERY):
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return {"start": start, "slow": protocol.slow.tolist(), "model": flat(model).tolist(), "round": protocol.round}


def test_diloco_over_island_starts_identical_and_agrees_on_slow_weights():
    outs = run_island(_diloco, 2)
    start = flat(linear(seed=10))  # rank 0's initial weights
    assert not torch.equal(start, flat(linear(seed=11)))  # the seeds really differ
    for out in outs:
        assert torch.equal(torch.tensor(out["start"]), start)
        assert out["round"] == 1
    assert outs[0]["slow"] == outs[1]["slow"] == outs[0]["model"] == outs[1]["model"]

    # the outer step done independently: inner SGD from the common start, then torch's Nesterov SGD
    fasts = []
    for rank in range(2):
        model = linear(seed=0)
        torch.nn.utils.vector_to_parameters(start.clone(), model.parameters())
        optimizer = torch.optim.SGD(model.parameters(), lr=INNER_LR)
        for x, y in batches(rank, EVERY):
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        fasts.append(flat(model))
    slow = start.clone().requires_grad_(True)
    slow.grad = sum(start - f for f in fasts) / 2
    torch.optim.SGD([slow], lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True).step()
    torch.testing.assert_close(torch.tensor(outs[0]["slow"]), slow.detach())


# ----- a rendezvous that cannot complete -----

def _average_after_rank_1_left(transport, rank: int) -> str:
    transport.average(torch.ones(4), transport.members(0), "first")
    if rank == 1:
        return "left"  # run_island closes its transport: its connections to rank 0 close
    try:
        transport.average(torch.ones(4), transport.members(0), "second")
    except IslandError as e:
        return str(e)
    return "averaged alone"


def _average_async_after_rank_1_left(transport, rank: int) -> str:
    transport.average_async(torch.ones(4), None, "first").result(timeout=60)
    if rank == 1:
        return "left"
    try:
        return f"averaged alone to {transport.average_async(torch.ones(4), None, 'second').result(timeout=60).tensor}"
    except IslandError as e:
        return str(e)


@pytest.mark.parametrize("average", [_average_after_rank_1_left, _average_async_after_rank_1_left],
                         ids=["blocking", "async"])
def test_an_average_after_a_rank_left_is_an_island_error_not_gloos_own(average):
    """A `--island` run whose rank died ended in gloo's raw RuntimeError (exit 1, a traceback) on the others;
    the asynchronous average (CO2, Streaming) handed back the unsummed buffer as the mean."""
    said, left = run_island(average, 2)
    assert left == "left" and said.startswith("rank 0: the all-reduce with the other ranks failed, a rank is gone")


def _failed_average(transport: IslandTransport) -> str:
    try:  # (the IslandError's traceback keeps this frame, and so the transport, for as long as the error lives)
        transport.average_async(torch.ones(4), None, "second").result(timeout=60)
    except IslandError as e:
        return str(e)
    return "averaged alone"


def _rank_lets_go_of_its_island(rank: int, port: int, said) -> None:
    """Rank 1 leaves after one average; rank 0's next fails, and it lets go of its island while the thread that
    finished the failed future is still holding it (slowed here by two seconds)."""
    if rank == 0:
        set_exception = concurrent.futures.Future.set_exception

        def set_exception_slowly(future, error):
            set_exception(future, error)
            if threading.current_thread() is not threading.main_thread():
                time.sleep(2.0)  # the process group's own thread or ours: it lets go of the future after ours
        concurrent.futures.Future.set_exception = set_exception_slowly
    transport = IslandTransport(f"tcp://127.0.0.1:{port}", rank, 2, backend="gloo", timeout=20.0)
    transport.average_async(torch.ones(4), None, "first").result(timeout=60)
    if rank == 0:
        said.put(_failed_average(transport))
    transport.close()
    del transport
    time.sleep(3.0 if rank == 0 else 0.0)  # until the slowed thread has let go of the last of it


def test_a_rank_that_lets_go_of_its_island_after_a_failed_async_average_exits_cleanly():
    """The future of an asynchronous average was finished by a callback on the process group's own thread, which
    kept it (through the IslandError's traceback: the frames, the transport, the group) after the rank let go: the
    group's destructor ran there and joined its own thread, and the rank aborted (torch's "terminate called ...
    Resource deadlock avoided", exit 134) where it should have said which rank failed."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "decentral.island", __name__])
    said, port = ctx.Queue(), free_port()
    ranks = [ctx.Process(target=_rank_lets_go_of_its_island, args=(rank, port, said)) for rank in range(2)]
    for rank in ranks:
        rank.start()
    try:
        assert said.get(timeout=TIMEOUT).startswith("rank 0: the all-reduce with the other ranks failed")
        for rank in ranks:
            rank.join(timeout=TIMEOUT)
        assert [rank.exitcode for rank in ranks] == [0, 0]
    finally:
        for rank in ranks:
            if rank.is_alive():
                rank.kill()


def _offer_a_state(transport: IslandTransport, rank: int) -> str:
    try:
        transport.offer_state({"round": 0}, {"slow": torch.zeros(4)}) if rank == 0 else transport.fetch_state()
    except IslandError as e:
        return str(e)
    return "offered"


def test_a_rank_started_with_another_world_size_is_named_in_one_line_not_gloos_traceback():
    """Rank 1 given --world-size 3, rank 0 --world-size 2: where rank 0 met it at the rendezvous, its broadcast of
    the starting state timed out in gloo's raw RuntimeError (exit 1, a traceback); where the rendezvous itself
    timed out, that was said in one line already."""
    (status0, said0), (status1, said1) = run_ranks(_offer_a_state, [2, 3], timeout=2.0)
    assert ((status0 == "ok" and "started with another --world-size than 2" in said0)
            or (status0 == "error" and "RendezvousError: rank 0 of 2 could not join the island" in said0)), said0
    assert status1 == "error" and "RendezvousError: rank 1 of 3 could not join the island" in said1, said1


def test_a_torchrun_rendezvous_nobody_comes_to_names_its_address(monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with pytest.raises(RendezvousError, match=rf"rank 0 of 2 could not join the island at env:// \(127.0.0.1:{port}\)"):
        IslandTransport("env://", 0, 2, backend="gloo", timeout=2.0)
    assert not torch.distributed.is_initialized()


def test_a_rank_whose_rendezvous_port_another_program_holds_stops_instead_of_waiting_forever():
    """torch's store client connected to a program that never answered its handshake, and waited for good."""
    with socket.socket() as other:  # listens and accepts, as a web server would, but says nothing
        other.bind(("127.0.0.1", 0))
        other.listen()
        accepted = []
        threading.Thread(target=lambda: accepted.append(other.accept()), daemon=True).start()
        init_method = f"tcp://127.0.0.1:{other.getsockname()[1]}"
        with pytest.raises(RendezvousError, match=rf"rank 1 of 2 could not join the island at {init_method}: "
                                                  "something listens there but did not answer"):
            IslandTransport(init_method, 1, 2, backend="gloo", timeout=1.0)
        assert accepted and not torch.distributed.is_initialized()
    accepted[0][0].close()


def test_rendezvous_without_peers_raises_within_timeout():
    init_method = f"tcp://127.0.0.1:{free_port()}"
    began = time.monotonic()
    with pytest.raises(RendezvousError, match=rf"rank 0 of 2 .*{init_method}"):
        IslandTransport(init_method, 0, 2, backend="gloo", timeout=3.0)
    assert time.monotonic() - began < 3.0 + 5.0
    assert not torch.distributed.is_initialized()
