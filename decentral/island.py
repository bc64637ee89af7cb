"""A fast island: the `Transport` interface over torch.distributed (NCCL on GPU, gloo on CPU).

An island is a fixed set of `world_size` ranks that always average over all of them, e.g. the GPUs
of one machine, or the DDP baseline of the benchmarks (gloo all-reduce over capped links). Every
rank is a member of every round, so `join_rounds` and `set_progress` have nothing to do.

Starting state: the sync protocols call `fetch_state()` and then `offer_state()` in `start()`. On an
island rank 0 is the donor: its first `offer_state()` broadcasts that snapshot, and every other
rank receives it in its first `fetch_state()`. Rank 0's own `fetch_state()` returns None (it keeps
its state), so all ranks start from rank 0's state without any change to the protocols.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import urllib.parse
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from decentral.transport import ROUNDS_AHEAD, AverageResult, EncodedAverage, all_finite, finished

Snapshot = tuple[dict, dict[str, torch.Tensor]]


class RendezvousError(RuntimeError):
    """The ranks of an island did not all meet at `init_method` within the timeout."""


class IslandError(RuntimeError):
    """A rank of the island failed or is gone: a collective with it failed, and the island cannot go on."""


def _check_rendezvous_answers(init_method: str, where: str, rank: int, world_size: int, timeout: float) -> None:
    """(a rank other than 0, before it joins) torch's TCPStore client waits forever on a port where another
    program listens and never answers its handshake; so connect once from a thread first, and give up
    after `timeout` (+ a few seconds of its retry) with a RendezvousError, as when nothing answers at all.
    Until rank 0 is up the client retries, as the real rendezvous does. Only tcp:// and env:// are checked."""
    if init_method == "env://":
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    elif init_method.startswith("tcp://"):
        address = urllib.parse.urlparse(init_method)
        host, port = address.hostname, address.port
    else:
        return
    if not host or not port:
        return  # torch's own rendezvous says what is missing
    failed: list[Exception] = []
    answered = threading.Event()

    def connect() -> None:
        try:  # without world_size: the check is not counted among the ranks rank 0 waits for
            dist.TCPStore(host, int(port), None, is_master=False, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 (nobody came to the port in time: said below)
            failed.append(e)
        answered.set()

    threading.Thread(target=connect, daemon=True, name="rendezvous-check").start()
    if not answered.wait(timeout + min(10.0, timeout)):  # (the client's last retry may run past `timeout`)
        try:
            socket.create_connection((host, int(port)), timeout=2.0).close()
        except OSError:  # nothing listens: torch's client gives up by itself once its timeout has passed. Wait for
            # it: a process that exits while that thread is inside the client aborts ("terminate called ...", 134)
            if not answered.wait(timeout + 30.0):
                failed.append(TimeoutError(f"nobody answered within {timeout:g}s"))
        else:
            raise RendezvousError(f"rank {rank} of {world_size} could not join the island at {where}: something "
                                  f"listens there but did not answer as torch.distributed's rendezvous within "
                                  f"{timeout:g}s (another program on that port? give the island another port)")
    if failed:
        raise RendezvousError(f"rank {rank} of {world_size} could not join the island at {where} (timeout "
                              f"{timeout:g}s): {_said(failed[0])}")


class IslandTransport:
    """Join island `init_method` (e.g. "tcp://10.0.0.1:29500") as `rank` of `world_size`.

    backend: "nccl" or "gloo"; None picks nccl when CUDA is available. With NCCL, set the rank's
    CUDA device (torch.cuda.set_device) first: averages run on the current device.
    timeout: seconds for the rendezvous and for each collective; a rank that does not show up
    in time makes them raise rather than hang.
    One island per process: torch.distributed holds a single default process group.
    """

    error_feedback = False  # averages are exact float32 all-reduces

    def __init__(
        self, init_method: str, rank: int, world_size: int, *, backend: str | None = None, timeout: float = 60.0
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: one island per process")
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.rank, self.world_size = rank, world_size
        self.peer_id = f"rank{rank}"
        self._ids = [f"rank{r}" for r in range(world_size)]  # numeric order, the same on every rank
        where = init_method
        if init_method == "env://":  # torchrun's rendezvous: say where that is
            where += f" ({os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')})"
        if rank != 0:
            _check_rendezvous_answers(init_method, where, rank, world_size, timeout)
        try:
            dist.init_process_group(
                self.backend, init_method=init_method, rank=rank, world_size=world_size,
                timeout=timedelta(seconds=timeout),
            )
        except Exception as exc:
            if dist.is_initialized():
                dist.destroy_process_group()
            raise RendezvousError(
                f"rank {rank} of {world_size} could not join the island at {where} "
                f"(backend {self.backend}, timeout {timeout:g}s): {exc}"
            ) from exc
        self._group = dist.group.WORLD  # every collective names it explicitly
        self._device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
        self._state_shared = False
        self._closed = False
        self._bytes = 0
        self._collectives: queue.SimpleQueue = queue.SimpleQueue()  # started asynchronous all-reduces, in order
        self._waiter: threading.Thread | None = None  # finishes their futures: `_finish_averages`

    @property
    def bytes_sent(self) -> int:
        """Estimated bytes this rank sent in averages (torch.distributed does not count them)."""
        return self._bytes

    @property
    def bytes_received(self) -> int:
        """Estimated bytes this rank received in averages; equal to bytes_sent for a ring all-reduce."""
        return self._bytes

    def join_rounds(self, round: int, *, first: bool = False, ahead: int = ROUNDS_AHEAD) -> None:
        """Nothing to announce: every rank takes part in every round."""

    def members(self, round: int) -> list[str]:
        """All ranks' ids, rank0, rank1, … in numeric order."""
        return list(self._ids)

    def members_async(self, round: int) -> Future[list[str]]:
        return finished(self.members(round))

    def set_progress(self, step: int, round: int, digest: str | None = None) -> None:
        """Nothing to report: the collectives themselves keep the ranks in step (and identical)."""

    def progress(self, max_age_s: float = 0.0) -> dict[str, dict]:
        return {rank: {} for rank in self._ids}

    def set_card(self, now: bool = True, **fields) -> None:
        """No heartbeat to carry them: the fields are dropped."""

    def average(self, tensor: torch.Tensor, group: list[str], tag: str, round: int | None = None,
                note: dict | None = None) -> AverageResult:
        """Mean of a flat tensor over all ranks: one all-reduce of the sum, divided by the rank count.

        `group` must be all ranks (islands average over all ranks); `tag` and `round` are unused since
        collectives match by call order, and a collective carries no `note`. Every rank must call it. The
        byte counters grow by the bandwidth-optimal ring estimate 2 (k-1)/k * numel * 4 each way. Raises
        RuntimeError when the mean is not finite: a collective cannot drop one rank's part.
        """
        values, buffer = self._prepare(tensor, group)
        try:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self._group)
        except RuntimeError as e:  # gloo's "Connection closed by peer", NCCL's watchdog, a collective's timeout
            raise _failed(self.rank, e) from e
        return _mean(values, buffer, self._ids, tag)

    def _prepare(self, tensor: torch.Tensor, group: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(our values as float32 on the collective's device, the buffer the all-reduce sums into); the byte
        counters count the all-reduce about to run."""
        if set(group) != set(self._ids):
            raise ValueError(f"islands average over all ranks {self._ids}; got group {sorted(group)}")
        values = tensor.detach().reshape(-1).to(device=self._device or "cpu", dtype=torch.float32)
        k = self.world_size
        self._bytes += int(2 * (k - 1) / k * values.numel() * values.element_size())
        return values, values.clone()

    def average_async(self, tensor: torch.Tensor, group: list[str] | None, tag: str, round: int | None = None,
                      note: dict | None = None) -> Future[AverageResult]:
        """`average` as an asynchronous all-reduce (`async_op`): returns at once; the future is done when the
        collective is. Every rank must start its averages in the same order (`group` None: all ranks). A failed
        collective fails the future with IslandError (its buffer holds no sum)."""
        values, buffer = self._prepare(tensor, self._ids if group is None else group)
        future: Future[AverageResult] = Future()
        try:
            work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
        except RuntimeError as e:
            future.set_exception(_failed(self.rank, e))
            return future
        if self._waiter is None:
            self._waiter = threading.Thread(target=_finish_averages, args=(self._collectives, self.rank, self._ids),
                                            daemon=True, name=f"island-rank{self.rank}-averages")
            self._waiter.start()
        self._collectives.put((work, values, buffer, future, tag))
        return future

    def wait_for_peers(self, count: int, timeout_s: float, round: int = 0) -> None:
        """Every rank met the others at the rendezvous already."""

    def multiaddrs(self) -> list[str]:
        """Ranks meet at the island's init_method, not through addresses of ours."""
        return []

    def offer_state(self, meta: dict, tensors: dict[str, torch.Tensor], digest: str | None = None,
                    led_by: EncodedAverage | None = None) -> None:
        """Rank 0's first offer is the island's starting state: broadcast it to the other ranks, which
        receive it in their first `fetch_state()`. Later offers, and other ranks' offers, are not needed
        (an island stays identical) and do nothing."""
        if self.rank == 0 and not self._state_shared:
            self._broadcast((meta, tensors))
            self._state_shared = True

    def fetch_rounds(self, donor: str, digest: str, numel: int) -> None:
        """Never needed: an island's ranks hold one state."""
        return None

    def fetch_state(self, have: dict[str, torch.Tensor] | None = None, donors: set[str] | None = None,
                    meta_if_past: bool = False) -> tuple[str, Snapshot] | None:
        """On ranks other than 0, the first call blocks until rank 0's first `offer_state()` and returns
        ("rank0", (meta, tensors)). Rank 0, and every later call, gets None. `have`, `donors` and
        `meta_if_past` are not used: the broadcast is a collective every rank joins."""
        if self.rank == 0 or self._state_shared:
            return None
        snapshot = self._broadcast(None)
        self._state_shared = True
        return self._ids[0], snapshot

    def request_join(self, donor: str) -> None:
        """An island's ranks are fixed when it forms: nobody joins one later."""
        return None

    def join_requests(self) -> list:
        return []

    def _broadcast(self, snapshot: Snapshot | None) -> Snapshot:
        box = [snapshot]
        try:
            dist.broadcast_object_list(box, src=0, group=self._group, device=self._device)
        except RuntimeError as e:  # a rank gone, or one that met us at the rendezvous with another --world-size
            raise IslandError(f"rank {self.rank}: sending the island's starting state to the other ranks failed: a "
                              f"rank is gone, hung, or started with another --world-size than {self.world_size} "
                              f"({_said(e)})") from e
        return box[0]

    def close(self) -> None:
        """Leave the island (destroys the process group); safe to call twice."""
        if not self._closed and dist.is_initialized():
            dist.destroy_process_group(self._group)
        if not self._closed and self._waiter is not None:
            self._collectives.put(None)  # its last collectives end with the group's connections
        self._closed = True


def _finish_averages(collectives: queue.SimpleQueue, rank: int, ids: list[str]) -> None:
    """(a thread of ours per island) wait for each asynchronous all-reduce in the order they were started and finish
    its future. Not a callback on the collective's own future: that runs on a thread of the process group's and
    stays referenced from its work; whatever the future then reaches (an IslandError's traceback, the frames in it,
    the transport) could be let go there last, and the group's destructor, joining that very thread, aborted the
    process ("terminate called ... Resource deadlock avoided", exit 134 where a rank of a CO2 island died)."""
    while (started := collectives.get()) is not None:
        work, values, buffer, future, tag = started
        del started
        try:
            work.wait()  # raises what failed the collective: its buffer is then not a sum
        except RuntimeError as e:
            future.set_exception(_failed(rank, e))
        else:
            try:
                future.set_result(_mean(values, buffer, ids, tag))
            except Exception as e:  # a non-finite mean
                future.set_exception(e)
        del work, values, buffer, future


def _failed(rank: int, error: Exception) -> IslandError:
    return IslandError(f"rank {rank}: the all-reduce with the other ranks failed, a rank is gone or hung "
                       f"({_said(error)})")


def _said(error: Exception) -> str:
    """The first line of what a failed collective raised (its type when it says nothing)."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _mean(values: torch.Tensor, summed: torch.Tensor, ids: list[str], tag: str) -> AverageResult:
    """The result of an all-reduce of `values` over the ranks `ids` that summed into `summed`."""
    k = len(ids)
    mean = (summed / k).cpu()
    if not all_finite(mean):
        raise RuntimeError(f"island average {tag!r} is not finite")
    return AverageResult(tensor=mean, sent=values.cpu(), group=list(ids), complete=True, contributors=k)
