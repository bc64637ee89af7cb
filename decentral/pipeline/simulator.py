"""Discrete-event simulation of one SkipPipe training iteration (arXiv 2502.19913; ALGORITHMS.md §5).

A microbatch's path is a sequence of distinct nodes, its stage-0 node (its head) first. It runs:

    forward on path[0], path[1], ..., path[-1]     (w each, w = that node's compute_ms)
    loss on path[0]                                 (loss_factor w, 0.25 by default: the LM head's forward
                                                    and backward and the loss)
    backward on path[-1], ..., path[1], path[0]     (backward_factor w each, 1.5 by default)

Between two steps on different nodes, the activations (forward, and last node -> head) or the
gradients (head -> last node, backward) travel as one message of `activation_bytes`.

Semantics, all deterministic:
- **Links**: each ordered pair of nodes is a FIFO link carrying one message at a time: a message
  holds it for bytes / bandwidth, starting when it is sent or when the message before it has left,
  and arrives `latency` after it has left. The two directions are independent links, and a node may
  send on several links at once, unless it has an `uplink_mbps`: then its messages also take its
  uplink one at a time, in the order they were sent (a message holds link and uplink together, for
  bytes / the lower of their bandwidths). On one node the next step is ready at once.
- **Compute**: a node runs one task at a time, to the end. When it is idle it starts, among its ready
  tasks, a backward or loss before a forward, then the earliest ready, then the lowest microbatch id.
- **Memory** (SkipPipe's TC1): a microbatch is resident on a node from the start of its forward there
  until the end of its backward there; a node starts a forward only while fewer than `memory`
  microbatches are resident on it (it may run other ready tasks meanwhile).
- Every microbatch is ready at its head at time 0. The iteration time (makespan) is when the last
  backward ends. When nothing can move before every microbatch has finished, `Deadlock` is raised.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

from decentral.pipeline.network import Network

FORWARD, LOSS, BACKWARD = "forward", "loss", "backward"
_RANK = {FORWARD: 1, LOSS: 0, BACKWARD: 0}  # lower starts first
_END, _ARRIVE = 0, 1


class Deadlock(RuntimeError):
    """The simulated iteration cannot finish: every waiting forward needs memory that is never freed."""


@dataclass(frozen=True)
class Task:
    node: int
    microbatch: int
    kind: str  # forward, loss or backward
    start: float  # ms
    end: float


@dataclass(frozen=True)
class Transfer:
    source: int
    target: int
    microbatch: int
    kind: str  # activations or gradients
    start: float  # when it took the link, ms
    end: float  # when it arrived


@dataclass(frozen=True)
class Timeline:
    makespan_ms: float
    finish_ms: tuple[float, ...]  # per microbatch, when its last backward ended
    tasks: tuple[Task, ...] = ()  # empty unless recorded
    transfers: tuple[Transfer, ...] = ()


def simulate(network: Network, paths: Sequence[Sequence[int]], record: bool = True) -> Timeline:
    """Run one iteration in which microbatch m follows `paths[m]` (node indices); see the module docstring.

    `record=False` skips the per-task records (faster; the planner's search uses it).
    """
    count = len(network)
    _check_paths(paths, count)
    compute = [node.compute_ms for node in network.nodes]
    memory = [node.memory for node in network.nodes]
    send = network.send_ms.tolist()
    latency = network.latency_ms.tolist()

    # steps[m][j] = (node, kind, duration); j runs over forwards, the loss, then backwards
    steps = []
    for path in paths:
        head = path[0]
        steps.append([(node, FORWARD, compute[node]) for node in path]
                     + [(head, LOSS, network.loss_factor * compute[head])]
                     + [(node, BACKWARD, network.backward_factor * compute[node]) for node in reversed(path)])
    ready: list[list[tuple]] = [[] for _ in range(count)]  # (rank, ready time, microbatch, step)
    busy = [False] * count
    resident: list[set[int]] = [set() for _ in range(count)]
    link_free: dict[tuple[int, int], float] = {}
    shared = [node.uplink_mbps is not None for node in network.nodes]
    uplink_free = [0.0] * count
    finish = [0.0] * len(paths)
    events: list[tuple] = []  # (time, sequence, event, microbatch, step)
    sequence = 0
    tasks, transfers = [], []
    for m, path in enumerate(paths):
        ready[path[0]].append((_RANK[FORWARD], 0.0, m, 0))

    def dispatch(node: int, now: float) -> None:
        nonlocal sequence
        if busy[node] or not ready[node]:
            return
        best = None
        for entry in ready[node]:
            if entry[0] == _RANK[FORWARD] and len(resident[node]) >= memory[node]:
                continue
            if best is None or entry < best:
                best = entry
        if best is None:
            return
        ready[node].remove(best)
        _, _, m, j = best
        _, kind, duration = steps[m][j]
        busy[node] = True
        if kind == FORWARD:
            resident[node].add(m)
        heapq.heappush(events, (now + duration, sequence, _END, m, j))
        sequence += 1
        if record:
            tasks.append(Task(node, m, kind, now, now + duration))

    for node in range(count):
        dispatch(node, 0.0)
    done = 0
    while events:
        now = events[0][0]
        touched = set()
        while events and events[0][0] == now:
            _, _, event, m, j = heapq.heappop(events)
            node, kind, _ = steps[m][j]
            if event == _ARRIVE:
                ready[node].append((_RANK[steps[m][j][1]], now, m, j))
                touched.add(node)
                continue
            busy[node] = False
            touched.add(node)
            if kind == BACKWARD:
                resident[node].discard(m)
            if j + 1 == len(steps[m]):
                finish[m] = now
                done += 1
                continue
            target, next_kind, _ = steps[m][j + 1]
            if target == node:
                ready[node].append((_RANK[next_kind], now, m, j + 1))
                continue
            start = max(now, link_free.get((node, target), 0.0), uplink_free[node])
            link_free[node, target] = start + send[node][target]
            if shared[node]:
                uplink_free[node] = start + send[node][target]
            arrival = start + send[node][target] + latency[node][target]
            heapq.heappush(events, (arrival, sequence, _ARRIVE, m, j + 1))
            sequence += 1
            if record:
                transfers.append(Transfer(node, target, m, "gradients" if kind != FORWARD else "activations",
                                          start, arrival))
        for node in sorted(touched):
            dispatch(node, now)
    if done < len(paths):
        raise Deadlock(_describe_deadlock(network, ready, resident))
    return Timeline(max(finish, default=0.0), tuple(finish), tuple(tasks), tuple(transfers))


def _check_paths(paths: Sequence[Sequence[int]], count: int) -> None:
    for m, path in enumerate(paths):
        if not path:
            raise ValueError(f"microbatch {m}: empty path")
        if any(not isinstance(node, Integral) or not 0 <= node < count for node in path):
            raise ValueError(f"microbatch {m}: path {list(path)} names a node outside 0..{count - 1}")
        if len(set(path)) != len(path):
            raise ValueError(f"microbatch {m}: path {list(path)} visits a node twice")


def _describe_deadlock(network: Network, ready: list[list[tuple]], resident: list[set[int]]) -> str:
    stuck = []
    for node, entries in enumerate(ready):
        waiting = sorted(m for _, _, m, _ in entries)
        if waiting:
            stuck.append(f"{network.nodes[node].name} holds microbatches {sorted(resident[node])} "
                         f"(memory {network.nodes[node].memory}) while forwards of {waiting} wait")
    return "deadlock: " + "; ".join(stuck)
