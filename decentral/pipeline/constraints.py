"""SkipPipe's convergence constraints on the stages a microbatch visits (arXiv 2502.19913; ALGORITHMS.md §5).

A path visits stage 0 first (and returns to its stage-0 node for the loss), then `length - 1`
distinct non-zero stages:
- **length**: fixed by the skip ratio, `path_length(stages, skip)`;
- **order**: increasing, except up to `MAX_SWAPS` swaps, each of two neighbours in the path that are
  consecutive stages (1, 3, 2, 4 swaps 2 and 3; swaps do not overlap);
- **hops**: at most `MAX_SKIP` stages skipped between two stages visited one after the other, counted on
  the visited stages in increasing order, and also after the last one (the hop into the loss:
  stages 0, 2, 3, 5 of 8 skip 1, 0, 1, then 6 and 7);
- **balance**: over an iteration, every non-zero stage is visited by as many microbatches as any
  other, ±1 (`Balance`, `balanced_sets`).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from decentral.pipeline.network import NetworkError

MAX_SWAPS = 2
MAX_SKIP = 3
MAX_STAGE_SETS = 100_000  # the planner tries every one (12 stages at skip 0.33 have 322, and take minutes)


def path_length(stages: int, skip: float) -> int:
    """Stages a microbatch visits, stage 0 included: `stages - round(skip * stages)`, halves rounded
    up (6 stages at skip 0.33 skip 2 and visit 4; at 0.25, 1.5 rounds to 2, also 4).

    Raises NetworkError when fewer than 2 stages are left, when no path can skip that many stages
    with at most MAX_SKIP per hop, or when there are more than MAX_STAGE_SETS sets of stages to plan over.
    """
    if stages < 2:
        raise NetworkError(f"stages must be at least 2, got {stages}")
    if not 0 <= skip < 1:
        raise NetworkError(f"skip must be in [0, 1), got {skip}")
    length = stages - math.floor(skip * stages + 0.5)
    if length < 2:
        raise NetworkError(f"skip {skip} with {stages} stages leaves {length} stage(s) per path; a path needs "
                           f"stage 0 and at least one other: lower the skip ratio")
    count, visited = _count_stage_sets(stages, length)
    unreachable = sorted(set(range(1, stages)) - visited)
    if unreachable:
        raise NetworkError(f"skip {skip} with {stages} stages: no path of {length} stages skipping at most {MAX_SKIP} "
                           f"per hop visits stage(s) {unreachable}, so visits cannot be balanced: lower the skip ratio")
    if count > MAX_STAGE_SETS:
        raise NetworkError(f"skip {skip} with {stages} stages: paths of {length} stages may visit {count:,} sets of "
                           f"stages, and the planner tries every one (at most {MAX_STAGE_SETS:,}): fewer stages, or a "
                           "skip ratio further from a half")
    return length


def _count_stage_sets(stages: int, length: int) -> tuple[int, set[int]]:
    """How many sets `stage_sets(stages, length)` holds, and the stages any of them visits, counted without listing
    them: ways[k][x], the increasing runs of k non-zero stages from 0 that end at x, and ends[j][x], the ways to
    choose j more after x and reach the loss, each hop skipping at most MAX_SKIP."""
    last = length - 1
    ways = [[int(k == 0 and x == 0) for x in range(stages)] for k in range(length)]
    for k in range(1, length):
        for x in range(1, stages):
            ways[k][x] = sum(ways[k - 1][a] for a in range(max(0, x - MAX_SKIP - 1), x) if (a > 0) == (k > 1))
    ends = [[int(stages - x - 1 <= MAX_SKIP) for x in range(stages)]]
    for j in range(1, length):
        ends.append([sum(ends[j - 1][b] for b in range(x + 1, min(stages, x + MAX_SKIP + 2))) for x in range(stages)])
    count = sum(ways[last][x] * ends[0][x] for x in range(stages))
    visited = {s for s in range(1, stages) if any(ways[k][s] and ends[last - k][s] for k in range(1, length))}
    return count, visited


def stage_sets(stages: int, length: int) -> list[tuple[int, ...]]:
    """Every set of non-zero stages (increasing) a path of `length` may visit under the hop rule."""
    found = []
    for chosen in itertools.combinations(range(1, stages), length - 1):
        bounds = (0, *chosen, stages)
        if all(b - a - 1 <= MAX_SKIP for a, b in zip(bounds, bounds[1:])):
            found.append(chosen)
    return found


def orders(stage_set: Sequence[int], swaps: bool = True) -> list[tuple[int, ...]]:
    """The orders a path may visit `stage_set` in: increasing, then with each choice of up to
    MAX_SWAPS disjoint swaps of neighbours that are consecutive stages."""
    base = tuple(stage_set)
    if not swaps:
        return [base]
    swappable = [i for i in range(len(base) - 1) if base[i + 1] == base[i] + 1]
    found = [base]
    for count in range(1, MAX_SWAPS + 1):
        for positions in itertools.combinations(swappable, count):
            if any(b - a < 2 for a, b in zip(positions, positions[1:])):
                continue  # overlapping swaps
            order = list(base)
            for i in positions:
                order[i], order[i + 1] = order[i + 1], order[i]
            found.append(tuple(order))
    return found


class Balance:
    """Visits per non-zero stage kept balanced while microbatches choose stage sets one by one.

    With V = microbatches * (length - 1) = q * (stages - 1) + extra visits in all, a balanced
    iteration visits `extra` stages q + 1 times and the others q times. `open()` lists the sets the
    next microbatch may take: no stage goes past q + 1, at most `extra` stages reach it, and the
    microbatches left can still bring every stage to q and `extra` of them to q + 1 (enough when
    every set is allowed; the hop rule can still lead into a dead end, see `balanced_sets`).
    """

    def __init__(self, sets: Sequence[tuple[int, ...]], stages: int, length: int, microbatches: int):
        self.sets = sets
        self.q, self.extra = divmod(microbatches * (length - 1), stages - 1)
        self.counts = [0] * stages  # index 0 unused
        self.left = microbatches
        self._visits = np.zeros((len(sets), stages - 1), dtype=int)  # the stages (1...) each set visits
        for i, chosen in enumerate(sets):
            self._visits[i, np.asarray(chosen, dtype=int) - 1] = 1

    def open(self) -> list[int]:
        """The sets the next microbatch may take (all of them checked at once)."""
        q, left = self.q, self.left - 1
        counts = np.asarray(self.counts[1:]) + self._visits  # each set's visits per stage once taken
        top = (counts == q + 1).sum(axis=1)
        room = ((counts <= q) & (q + 1 - counts <= left)).sum(axis=1)
        fits = ((top <= self.extra) & (counts.max(axis=1) <= q + 1) & (q - counts.min(axis=1) <= left)
                & (self.extra - top <= room))
        return np.flatnonzero(fits).tolist()

    def take(self, index: int) -> None:
        for stage in self.sets[index]:
            self.counts[stage] += 1
        self.left -= 1


class Drawn:
    """A fixed multiset of stage sets (indices), handed out in any order: the same interface as Balance."""

    def __init__(self, indices: Sequence[int]):
        self.left = Counter(indices)

    def open(self) -> list[int]:
        return sorted(i for i, count in self.left.items() if count)

    def take(self, index: int) -> None:
        self.left[index] -= 1


def balanced_sets(sets: Sequence[tuple[int, ...]], stages: int, length: int, microbatches: int,
                  rng: np.random.Generator, tries: int = 100) -> list[int]:
    """One index into `sets` per microbatch, visits balanced: each microbatch takes, among the sets
    Balance leaves open, one whose stages are furthest below q, then one with the stage that the
    fewest open sets visit, ties broken at random; a dead end (possible under the hop rule) starts
    over. NetworkError when every try fails."""
    for _ in range(tries):
        balance, chosen = Balance(sets, stages, length, microbatches), []
        for _ in range(microbatches):
            allowed = balance.open()
            if not allowed:
                break
            served = Counter(stage for i in allowed for stage in sets[i])
            rank = [(sum(balance.q - balance.counts[s] for s in sets[i]), -min(served[s] for s in sets[i]))
                    for i in allowed]
            best = [i for i, key in zip(allowed, rank) if key == max(rank)]
            chosen.append(best[int(rng.integers(len(best)))])
            balance.take(chosen[-1])
        else:
            return chosen
    raise NetworkError(f"found no balanced set of paths of {length} of {stages} stages for {microbatches} "
                       f"microbatches in {tries} tries: change the skip ratio or the number of microbatches")


def violations(stage_of: Sequence[int], paths: Sequence[Sequence[int]], stages: int, length: int,
               swaps: bool = True) -> list[str]:
    """Every convergence constraint that node paths break, given each node's stage; [] when none."""
    found = []
    if sorted(set(stage_of)) != list(range(stages)):
        found.append(f"stages without a node: {sorted(set(range(stages)) - set(stage_of))}")
    allowed = {order for stage_set in stage_sets(stages, length) for order in orders(stage_set, swaps)}
    visits = Counter()
    for m, path in enumerate(paths):
        visited = tuple(stage_of[node] for node in path)
        if visited[0] != 0 or visited[1:] not in allowed:
            found.append(f"microbatch {m}: stage order {list(visited)} is not allowed")
        visits.update(visited[1:])
    counts = [visits[s] for s in range(1, stages)]
    if paths and max(counts) - min(counts) > 1:
        found.append(f"unbalanced visits per stage 1..{stages - 1}: {counts}")
    return found
