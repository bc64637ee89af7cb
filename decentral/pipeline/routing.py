"""Network-aware, load-aware path choice for every microbatch, given which node holds which stage.

Microbatches are routed one after another and dealt evenly to the heads (±1: a head holds each of
its microbatches for a whole round trip, so its count bounds the iteration). For each, one dynamic
program over every allowed stage order (constraints.orders of the stage sets still open for
balance), every head that still takes microbatches and every choice of replicas picks the path of
least cost, where a node costs its work for this microbatch (forward + backward, plus the loss on
the head) plus `load_weight` times the work already routed through it, and a hop costs its
transfer time both ways (activations out, gradients back), the hop from the last stage to the head
and back included. All orders are evaluated at once with numpy, each prefix they share once (stage
replicas padded to one width): routing 24 microbatches over 20 nodes takes about 5 ms at 6 stages,
about 50 ms at 12 (2740 orders of 8-stage paths).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from decentral.pipeline.constraints import Balance, Drawn, balanced_sets, orders, stage_sets
from decentral.pipeline.network import Network, NetworkError


def node_work(network: Network, stage_of: Sequence[int]) -> np.ndarray:
    """Compute time one microbatch costs each node at its stage: forward + backward (+ loss on stage 0)."""
    compute = np.array([node.compute_ms for node in network.nodes])
    heads = np.asarray(stage_of) == 0
    return compute * (1 + network.backward_factor + network.loss_factor * heads)


class Router:
    """Routes microbatches for one allocation (`stage_of[node]`, every stage held by some node)."""

    def __init__(self, network: Network, stage_of: Sequence[int], length: int, swaps: bool = True):
        self.network = network
        self.stages = network.stages
        self.length = length
        self.stage_of = stage_of = np.asarray(stage_of)
        members = [np.flatnonzero(stage_of == s) for s in range(self.stages)]
        width = max(len(m) for m in members)
        count = len(network)
        self.members = np.full((self.stages, width), count)  # padded with a sentinel node
        for s, nodes in enumerate(members):
            self.members[s, :len(nodes)] = nodes
        self.work = node_work(network, stage_of)
        round_trip = np.full((count + 1, count + 1), np.inf)
        round_trip[:count, :count] = network.transfer_ms + network.transfer_ms.T
        blocks = round_trip[self.members[:, None, :, None], self.members[None, :, None, :]]  # (S, S, width, width)
        self.sets = stage_sets(self.stages, length)
        self.orders = [(i, order) for i, chosen in enumerate(self.sets) for order in orders(chosen, swaps)]
        order_stages = np.array([order for _, order in self.orders]).reshape(len(self.orders), length - 1)
        self.order_set = np.array([i for i, _ in self.orders])
        self.order_stages = order_stages
        self.levels = _prefix_levels(order_stages)
        self.first_hop = blocks[0, self.levels[0].stage]  # (first stages, heads, replicas)
        self.hops = [blocks[previous.stage[level.parent], level.stage]  # (prefixes, width, width)
                     for previous, level in zip(self.levels, self.levels[1:])]
        self.last_hop = blocks[order_stages[:, -1], 0].transpose(0, 2, 1)  # (orders, heads, replicas)

    def route(self, microbatches: int, load_weight: float) -> list[tuple[int, ...]]:
        """One path per microbatch (node indices, head first) obeying every convergence constraint.

        Stage sets stay open as Balance allows; when the hop rule leads into a dead end, routing
        starts over with a fixed balanced multiset of sets (constraints.balanced_sets).
        """
        paths = self._route(Balance(self.sets, self.stages, self.length, microbatches), microbatches, load_weight)
        if paths is None:
            paths = self._route(Drawn(_balanced_sets(tuple(self.sets), self.stages, self.length, microbatches)),
                                microbatches, load_weight)
        return paths

    def longest_first(self, paths: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """The same paths renumbered (lower ids start first) so that each head starts its longest
        round trips first, heads taking turns: its last microbatches wait for memory, so they had
        better be quick."""
        trip = self.network.transfer_ms

        def round_trip(path: tuple[int, ...]) -> float:
            hops = sum(trip[a, b] + trip[b, a] for a, b in zip(path, path[1:] + path[:1]))
            return hops + self.work[list(path)].sum()

        rank = {}
        for head in set(path[0] for path in paths):
            mine = sorted((p for p in range(len(paths)) if paths[p][0] == head), key=lambda p: -round_trip(paths[p]))
            rank.update({p: r for r, p in enumerate(mine)})
        return [paths[p] for p in sorted(range(len(paths)), key=lambda p: (rank[p], paths[p][0]))]

    def _route(self, sets: Balance | Drawn, microbatches: int, load_weight: float) -> list[tuple[int, ...]] | None:
        load = np.zeros(len(self.network) + 1)
        heads = self.members[0][self.members[0] < len(self.network)]
        per_head = np.zeros(self.members.shape[1], dtype=int)
        fewest, extra = divmod(microbatches, len(heads))
        paths = []
        for _ in range(microbatches):
            allowed = sets.open()
            if not allowed:
                return None
            full = per_head >= fewest + (np.sum(per_head > fewest) < extra)
            path, order = self._best_path(load_weight * load, np.isin(self.order_set, allowed), full)
            sets.take(int(self.order_set[order]))
            paths.append(path)
            per_head[np.flatnonzero(self.members[0] == path[0])[0]] += 1
            load[list(path)] += self.work[list(path)]
        return paths

    def _best_path(self, penalty: np.ndarray, allowed: np.ndarray,
                   full_heads: np.ndarray) -> tuple[tuple[int, ...], int]:
        """The cheapest path (and its index in self.orders) over allowed orders and heads that are not full.
        The dynamic program runs over the orders' distinct prefixes, each once (orders share most of theirs)."""
        cost = np.append(self.work, np.inf) + penalty
        cost = cost[self.members]  # (S, width)
        total = cost[0][None, :, None] + self.first_hop + cost[self.levels[0].stage][:, None, :]
        back = []
        for level, hop in zip(self.levels[1:], self.hops):
            before = total[level.parent]  # (prefixes, heads, previous replica)
            total = before[:, :, 0, None] + hop[:, None, 0, :]  # (prefixes, heads, next replica), via replica 0
            best = np.zeros(total.shape, dtype=int)
            for replica in range(1, hop.shape[1]):  # a few replicas: one pass each beats a 4-d argmin
                via = before[:, :, replica, None] + hop[:, None, replica, :]
                shorter = via < total  # (ties keep the lower replica)
                total = np.where(shorter, via, total)
                best[shorter] = replica
            back.append(best)
            total = total + cost[level.stage][:, None, :]
        total = total[self.levels[-1].of_order] + self.last_hop  # (orders, heads, replicas)
        total[~allowed] = np.inf
        total[:, full_heads] = np.inf
        o, h, j = np.unravel_index(int(np.argmin(total)), total.shape)
        if not np.isfinite(total[o, h, j]):
            raise NetworkError("no path exists: a stage has no node")
        replicas, prefix = [j], self.levels[-1].of_order[o]
        for level, best in zip(reversed(self.levels[1:]), reversed(back)):
            replicas.append(int(best[prefix, h, replicas[-1]]))
            prefix = level.parent[prefix]
        replicas.reverse()
        return (int(self.members[0, h]),
                *(int(self.members[s, r]) for s, r in zip(self.order_stages[o], replicas))), int(o)


class _Level(NamedTuple):
    """The distinct prefixes of length i + 1 of the orders: each one's last stage, the index of its own prefix
    one shorter among level i - 1's (level 0: none), and each order's prefix here."""
    stage: np.ndarray
    parent: np.ndarray | None
    of_order: np.ndarray


def _prefix_levels(order_stages: np.ndarray) -> list[_Level]:
    """`order_stages` (orders, positions) as a tree of shared prefixes, one level per position."""
    levels = []
    for i in range(order_stages.shape[1]):
        prefixes, of_order = np.unique(order_stages[:, :i + 1], axis=0, return_inverse=True)
        of_order = of_order.reshape(-1)
        parent = None
        if levels:
            parent = np.empty(len(prefixes), dtype=int)
            parent[of_order] = levels[-1].of_order
        levels.append(_Level(prefixes[:, i], parent, of_order))
    return levels


@functools.lru_cache(maxsize=64)
def _balanced_sets(sets: tuple[tuple[int, ...], ...], stages: int, length: int, microbatches: int) -> list[int]:
    return balanced_sets(sets, stages, length, microbatches, np.random.default_rng(0))
