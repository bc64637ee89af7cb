"""Fast islands inside a slow swarm: torch.distributed within an island, an outer protocol between islands.

An island is k ranks (the GPUs of one box, the machines of one rack) that train as one replica: their
gradients are all-reduced every inner step (torch's DistributedDataParallel over the island's process
group: NCCL on CUDA tensors, gloo on CPU), so all k hold the same weights. The island as a whole is one
member of the swarm, named by its leader's (rank 0's) peer id, and the outer protocol (DiLoCo, NoLoCo,
CO2, Streaming DiLoCo) runs between islands through `HierarchicalTransport`, which every rank wraps
its protocol with. It is composed of the two transports we have: an `IslandTransport` for the ranks,
a `SwarmTransport` (or k of them) for the islands.

Lockstep: every rank runs the same protocol on the same state, so every rank calls the transport in
the same order. A call answered by the network (`members`, `progress`, `fetch_state`, `fetch_rounds`) is
answered by the leader and broadcast over the island, so every rank takes the same decisions; `join_rounds` and
`set_progress` go to each rank's own swarm connection; `offer_state` to the leader's.

An average of a flat tensor x (the protocol's outer gradient, or φ) goes in three steps:
1. the island all-reduces x to the mean of its ranks' x;
2. leader mode: rank 0 averages that mean over the swarm with the other islands' leaders.
   Sharded mode: rank r averages shard r (a 1/k slice) over its own swarm connection with the rank-r
   connections of the other islands. Rank r's connection is a peer of the swarm's DHT under run
   "RUN/shardR"; the leader's heartbeat lists its island's connections (`shards`), which is how every
   island finds the rank-r connection of a member. With a NIC per rank, k NICs carry 1/k each;
3. leader mode: the result is broadcast to the island. Sharded: the island all-gathers the shards.
Islands of equal size (the recipe's `island.size`) each count once, so the result equals the flat mean
of every rank's x. The average commits only when every shard committed; otherwise every rank gets
its island's mean back (rolled back, as `AverageResult` says), and a replica left apart by a shard
that committed elsewhere is repaired by the protocols' digest check (decentral.sync.base).

The island's own collectives run on two gloo groups of their own, apart from the DDP all-reduces: one
for the calls made on the training thread, one for the averages, which run in order on one
background thread (so `average_async` returns at once, as CO2 and Streaming DiLoCo need).
"""

from __future__ import annotations

import math
import pickle
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from decentral.island import IslandError, IslandTransport
from decentral.transport import (
    ROUNDS_AHEAD, AverageResult, EncodedAverage, MissedRound, Transport, check_group, longest_hold, with_us,
)

MODES = ("leader", "sharded")


def shard_run(run: str, rank: int) -> str:
    """The swarm run name of rank `rank`'s connection in sharded mode (rank 0 uses the run itself)."""
    return run if rank == 0 else f"{run}/shard{rank}"


def shard_bounds(numel: int, shards: int, index: int) -> slice:
    """Shard `index` of a flat tensor of `numel` elements cut into `shards` nearly equal slices."""
    size = math.ceil(numel / shards)
    return slice(min(numel, index * size), min(numel, (index + 1) * size))


class HierarchicalTransport:
    """The island `island` as one member of a swarm (the `Transport` every rank's protocol uses).

    connect(rank, leader_addrs): opens this rank's swarm connection (a `SwarmTransport` of run
    `shard_run(run, rank)`, also joining the DHT at `leader_addrs`, the leader connection's addresses);
    called on rank 0 (with []) and, in sharded mode, on every other rank. mode: "leader" or "sharded".
    timeout_s: how long a rank waits for the leader's answer or for the others in a collective; it
    must cover the longest network call the leader makes (an average, waiting for peers), so it is long:
    a rank that dies is noticed at once anyway (its connections close), one that hangs after it.
    Takes ownership of `island` (closes it).
    """

    def __init__(self, island: IslandTransport, connect: Callable[[int, list[str]], Transport], *, mode: str = "leader",
                 timeout_s: float = 900.0):
        if mode not in MODES:
            raise ValueError(f"island mode must be one of {MODES}, got {mode!r}")
        self.island, self.mode = island, mode
        self.rank, self.size = island.rank, island.world_size
        self._control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._data = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._averages = ThreadPoolExecutor(1, thread_name_prefix="island-average")
        self.swarm: Transport | None = None
        try:
            self.peer_id, leader_addrs, self.error_feedback = self._from_leader(lambda: self._connect_leader(connect))
            if mode == "sharded":
                self._on_every_rank(lambda: self._connect_shard(connect, leader_addrs))
            connections = self._all_gather(self.swarm.peer_id if self.swarm else None, self._control)
            if self.rank == 0 and mode == "sharded":
                self.swarm.set_card(shards=connections)
        except BaseException:
            self.close()
            raise
        self.connections: list[str | None] = connections  # each rank's swarm connection (None: it has none)

    def _connect_leader(self, connect: Callable[[int, list[str]], Transport]) -> tuple[str, list[str], bool]:
        """(on the leader) Open the island's swarm connection: (its peer id, the island's id; its addresses,
        where the other ranks' connections join; whether its codec needs error feedback)."""
        self.swarm = connect(0, [])
        return self.swarm.peer_id, self.swarm.multiaddrs(), self.swarm.error_feedback

    def _connect_shard(self, connect: Callable[[int, list[str]], Transport], leader_addrs: list[str]) -> None:
        """(sharded mode) Open this rank's own swarm connection; the leader has its own already."""
        if self.swarm is None:
            self.swarm = connect(self.rank, leader_addrs)

    # ----- collectives over the island -----
    def _broadcast(self, value, group):
        """The leader's `value` on every rank (each rank passes its own; the others' are ignored)."""
        box = [value]
        self._collective(dist.broadcast_object_list, box, src=0, group=group)
        return box[0]

    def _all_gather(self, value, group) -> list:
        out = [None] * self.size
        self._collective(dist.all_gather_object, out, value, group=group)
        return out

    def _collective(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            raise IslandError(f"island rank {self.rank}: a collective with the other ranks failed ({e}); "
                              "a rank is gone or hung, so this island leaves the swarm") from e

    def _on_every_rank(self, call: Callable[[], object], group=None) -> list:
        """`call()` on every rank: every rank's result, by rank; or the lowest failed rank's exception, raised
        on every rank (so no rank goes on alone into a collective the others left)."""
        outcomes = self._all_gather(_outcome(call), self._control if group is None else group)
        for kind, value in outcomes:
            if kind == "error":
                raise value
        return [value for _, value in outcomes]

    def _from_leader(self, call: Callable[[], object], group=None):
        """`call()` run on the leader, its result (or its exception) on every rank."""
        kind, value = self._broadcast(_outcome(call) if self.rank == 0 else None,
                                      self._control if group is None else group)
        if kind == "error":
            raise value
        return value

    def from_leader(self, value):
        """The leader's `value` on every rank (each rank passes its own; the others' are not used), e.g.
        the checkpoint an island resumes from."""
        return self._broadcast(value, self._control)

    # ----- Transport -----
    @property
    def bytes_sent(self) -> int:
        """Bytes this rank's own swarm connection sent (0 on a rank without one)."""
        return self.swarm.bytes_sent if self.swarm else 0

    @property
    def bytes_received(self) -> int:
        return self.swarm.bytes_received if self.swarm else 0

    def join_rounds(self, round: int, *, first: bool = False, ahead: int = ROUNDS_AHEAD) -> None:
        if self.swarm:
            self.swarm.join_rounds(round, first=first, ahead=ahead)

    def members(self, round: int) -> list[str]:
        return self._from_leader(lambda: self.swarm.members(round))

    def members_async(self, round: int) -> Future[list[str]]:
        """On the island's averaging thread, in order with the averages (every rank calls it at the same step)."""
        return self._averages.submit(self._from_leader, lambda: self.swarm.members(round), self._data)

    def set_progress(self, step: int, round: int, digest: str | None = None) -> None:
        if self.swarm:
            self.swarm.set_progress(step, round, digest)

    def progress(self, max_age_s: float = 0.0) -> dict[str, dict]:
        return self._from_leader(lambda: self.swarm.progress(max_age_s))

    def set_card(self, now: bool = True, **fields) -> None:
        """On this rank's own swarm connection (the leader's is the island's; a rank without one drops them)."""
        if self.swarm:
            self.swarm.set_card(now, **fields)

    def wait_for_peers(self, count: int, timeout_s: float, round: int = 0) -> None:
        """Every connection waits for `count` connections of its own run (islands, in sharded mode each
        shard's); an error on any rank is raised on every rank."""
        self._on_every_rank(lambda: self.swarm.wait_for_peers(count, timeout_s, round) if self.swarm else None)

    def multiaddrs(self) -> list[str]:
        """Where other islands join the swarm: the leader's addresses ([] on other ranks)."""
        return self.swarm.multiaddrs() if self.rank == 0 else []

    def offer_state(self, meta: dict, tensors: dict[str, torch.Tensor], digest: str | None = None,
                    led_by: EncodedAverage | None = None) -> None:
        """The leader serves the island's state (every rank holds the same)."""
        if self.rank == 0:
            self.swarm.offer_state(meta, tensors, digest, led_by)

    def fetch_rounds(self, donor: str, digest: str, numel: int) -> tuple[list[MissedRound], int] | None:
        """The leader's swarm fetches the rounds (from islands and flat peers alike), every rank replays them."""
        return self._from_leader(lambda: self.swarm.fetch_rounds(donor, digest, numel))

    def fetch_state(self, have: dict[str, torch.Tensor] | None = None, donors: set[str] | None = None,
                    meta_if_past: bool = False):
        return self._from_leader(lambda: self.swarm.fetch_state(have, donors, meta_if_past))

    def request_join(self, donor: str) -> None:
        """An island joins DDP's averages at an epoch boundary only (its ranks take one snapshot together)."""
        return None

    def join_requests(self) -> list:
        """Never taken (a request to our leader is refused at once): an island's state at a step is every rank's."""
        return []

    def average(self, tensor: torch.Tensor, group: list[str], tag: str, round: int | None = None,
                note: dict | None = None) -> AverageResult:
        """As `average_async`, waited for."""
        return self.average_async(tensor, group, tag, round, note).result()

    def average_async(self, tensor: torch.Tensor, group: list[str] | None, tag: str, round: int | None = None,
                      note: dict | None = None) -> Future[AverageResult]:
        """The three steps of the module docstring, on the island's averaging thread; every rank calls it
        with the same group, tag and round (`group` None: the leader looks the members up on that thread).
        A committed result's `encoded` (the whole average as it travelled, for `offer_state(led_by=)`) is
        the leader's only."""
        check_group(group, round)
        values = tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float32, copy=True)
        return self._averages.submit(self._average, values, None if group is None else list(group), tag, round, note)

    def _average(self, values: torch.Tensor, group: list[str] | None, tag: str, round: int | None,
                 note: dict | None) -> AverageResult:
        if group is None:
            group = self._from_leader(lambda: with_us(self.swarm.members(round), self.peer_id), self._data)
        self._collective(dist.all_reduce, values, group=self._data)
        mean = values / self.size
        if self.mode == "sharded":
            return self._sharded_average(mean, group, tag, round, note)
        result = None

        def leader_average() -> dict:  # step 2 over the leader's connection
            nonlocal result
            result = self.swarm.average(mean, group, tag, round, note)
            return _without_tensors(result)

        meta = self._from_leader(leader_average, self._data)
        both = torch.cat([result.tensor, result.sent]) if self.rank == 0 else torch.empty(2 * mean.numel())
        self._collective(dist.broadcast, both, src=0, group=self._data)  # one collective for the two tensors
        return AverageResult(tensor=both[:mean.numel()], sent=both[mean.numel():], **meta,
                             encoded=result.encoded if self.rank == 0 else None)

    def _sharded_average(self, mean: torch.Tensor, group: list[str], tag: str, round: int | None,
                         note: dict | None) -> AverageResult:
        """Step 2 and 3 in sharded mode: our shard over our connection, then the island all-gathers (and, when
        every shard's encoding came, the leader gathers them in order)."""
        shard_groups = self._from_leader(lambda: self._shard_groups(group), self._data)
        island_of = {conn: island for island, conns in shard_groups[-1].items() for conn in conns}
        mine = shard_bounds(mean.numel(), self.size, self.rank)
        result = None

        def shard_average() -> dict:
            nonlocal result
            result = self.swarm.average(mean[mine].clone(), shard_groups[self.rank], tag, round, note)
            return {**_without_tensors(result, island_of), "encoded": result.encoded is not None}

        metas = self._on_every_rank(shard_average, self._data)
        lengths = [len(range(mean.numel())[shard_bounds(mean.numel(), self.size, r)]) for r in range(self.size)]
        longest = lengths[0]  # all-gather needs equal sizes: each rank sends [result; sent], padded to the longest
        own = torch.zeros(2, longest)
        own[0, :lengths[self.rank]], own[1, :lengths[self.rank]] = result.tensor, result.sent
        gathered = [torch.empty(2, longest) for _ in range(self.size)]
        self._collective(dist.all_gather, gathered, own, group=self._data)
        tensor, sent = (torch.cat([g[i, :n] for g, n in zip(gathered, lengths)]) for i in (0, 1))
        complete = all(m["complete"] for m in metas)
        encoded = None
        if complete and all(m["encoded"] for m in metas):
            shards = [None] * self.size if self.rank == 0 else None
            self._collective(dist.gather_object, result.encoded, shards, dst=0, group=self._data)
            if self.rank == 0:  # each shard's chunks in order: the whole average as it travelled
                encoded = EncodedAverage(shards[0].codec, [chunk for shard in shards for chunk in shard.chunks])
        return AverageResult(
            tensor=tensor if complete else mean, sent=sent if complete else mean, group=list(group),
            complete=complete, contributors=min(m["contributors"] for m in metas),
            rejected={p: why for m in metas for p, why in m["rejected"].items()},
            notes={p: n for m in metas for p, n in m["notes"].items()} if complete else {},
            held_by=longest_hold(m["held_by"] for m in metas) if complete else None,
            **{key: sorted({p for m in metas for p in m[key]})
               for key in ("absent", "disagree", "left_out", "elsewhere")},
            encoded=encoded)

    def _shard_groups(self, group: list[str]) -> list:
        """(on the leader) For each rank r, the rank-r connections of `group`'s islands; last, a map
        island -> its connections. An island whose heartbeat lists no connections (not seen yet, or not
        sharded) takes part through its leader's shard only."""
        cards = self.swarm.progress(max_age_s=float("inf"))
        if any(not isinstance(cards.get(p, {}).get("shards"), list) for p in group):
            cards = self.swarm.progress()
        connections = {}
        for island in group:
            shards = cards.get(island, {}).get("shards")
            ok = isinstance(shards, list) and len(shards) == self.size and shards[0] == island
            connections[island] = shards if ok else [island]
        return [[conns[r] for conns in connections.values() if len(conns) > r] for r in range(self.size)] + [connections]

    def close(self) -> None:
        """Stop averaging, leave the swarm (the leader says it left), then leave the island."""
        self._averages.shutdown(wait=False, cancel_futures=True)
        if self.swarm is not None:
            self.swarm.close()
        self.island.close()


def _outcome(call: Callable[[], object]) -> tuple[str, object]:
    """("ok", call()) or ("error", the exception): what a rank tells the others (exceptions that cannot be
    pickled travel as a RuntimeError with their text)."""
    try:
        return "ok", call()
    except Exception as e:
        try:
            pickle.dumps(e)
            return "error", e
        except Exception:
            return "error", RuntimeError(f"{type(e).__name__}: {e}")


def _without_tensors(result: AverageResult, rename: dict[str, str] | None = None) -> dict:
    """An AverageResult's fields besides its tensors, peers named by `rename` (shard connection -> island)."""
    name = (lambda p: rename.get(p, p)) if rename else (lambda p: p)
    return dict(group=[name(p) for p in result.group], complete=result.complete, contributors=result.contributors,
                rejected={name(p): why for p, why in result.rejected.items()},
                absent=[name(p) for p in result.absent], disagree=[name(p) for p in result.disagree],
                left_out=[name(p) for p in result.left_out], elsewhere=[name(p) for p in result.elsewhere],
                notes={name(p): n for p, n in result.notes.items()},
                held_by=None if result.held_by is None else (name(result.held_by[0]), result.held_by[1]))
