"""SkipPipe planning in seconds: which node holds which stage, and the path of every microbatch.

The reference scheduler (Blagoev et al. 2025: a genetic allocation, then time-dependent A* and
conflict-based search per microbatch) takes 15-25 minutes for 20 nodes. Here every candidate is
scored by the simulator itself (decentral.pipeline.simulator, about 1 ms an iteration):

1. **Allocation**: for each stage-0 size worth trying (from stage 0's share of the work up to one
   head per `memory` microbatches: a head holds each of its microbatches for a whole round trip),
   the other nodes split evenly over the other stages, and nodes grouped by agglomerative
   clustering on transfer time into groups of at most one path's length, each group a head (its
   fastest node) and distinct stages, so that whole paths can stay inside fast islands. From each
   start a local search (move a node to another stage, swap two nodes' stages) keeps every change
   after which the routed plan's simulated iteration is no longer; the best result wins.
2. **Routing** (decentral.pipeline.routing): microbatches are dealt evenly to the heads, and each in
   turn takes the cheapest path that keeps visits balanced: transfer and compute time plus a
   penalty for the work already routed through its nodes. Three penalty weights are tried; the
   best simulated routing counts.
3. **Polish**: random changes (another replica or head, another allowed order, two microbatches
   trading one stage so that visits stay balanced, two microbatches trading priorities), each
   kept when the simulated iteration gets shorter (ties: when microbatches finish earlier on average).

`replan` keeps survivors on their stages after nodes die (or join), refills stages left empty, may
move a few more survivors, and routes again. Every plan obeys constraints.violations; memory and
one task at a time per node are the simulator's semantics, which the scores include.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from decentral.pipeline.constraints import orders, path_length, stage_sets, violations
from decentral.pipeline.network import Network, NetworkError
from decentral.pipeline.routing import Router, node_work
from decentral.pipeline.simulator import Deadlock, simulate

LOAD_WEIGHTS = (0.5, 1.0, 2.0)  # routing penalties tried for every allocation; the best simulated one counts
ALLOCATION_EVALS = 200  # allocations scored per plan at effort 1
POLISH_EVALS = 600  # simulated path changes per plan at effort 1
REPLAN_EVALS = 200  # survivor moves tried per re-plan at effort 1


@dataclass(frozen=True)
class Plan:
    """Which node holds which stage and the path of every microbatch, for one network."""

    nodes: tuple[str, ...]  # the network's node names, in its order: paths index into it
    stage_of: tuple[int, ...]  # per node
    paths: tuple[tuple[int, ...], ...]  # per microbatch, node indices, its head (stage 0) first
    stages: int
    skip: float
    makespan_ms: float  # simulated iteration time

    @property
    def heads(self) -> list[int]:
        return self.members(0)

    def members(self, stage: int) -> list[int]:
        return [node for node, s in enumerate(self.stage_of) if s == stage]

    def to_json(self) -> dict:
        """The allocation (node names per stage) and the paths (node names per microbatch)."""
        return {"allocation": [[self.nodes[n] for n in self.members(s)] for s in range(self.stages)],
                "paths": [[self.nodes[n] for n in path] for path in self.paths]}


def plan(network: Network, seed: int = 0, effort: float = 1.0, swaps: bool = True,
         fixed: dict[str, int] | None = None, progress: Callable[[int, int], None] | None = None) -> Plan:
    """Plan `network.microbatches` paths over `network.stages` stages at `network.skip`.

    `fixed` pins nodes (by name) to stages, on top of the nodes the network pins itself; `effort`
    scales the number of simulated candidates (1: about 3.5 s for 20 nodes and 6 stages on one core);
    `swaps=False` keeps every path in increasing stage order. `progress(done, total)` is told of each allocation
    the search tries (most of the time planning takes). Raises NetworkError for impossible
    requests (more stages than nodes, a skip ratio that leaves fewer than 2 stages).
    """
    problem = _Problem(network, _check_request(network), swaps)
    pinned = _pinned(network, fixed)
    rng = np.random.default_rng(seed)
    starts = [_initial_allocation(network, problem.length, pinned, heads)
              for heads in _head_counts(network, problem.length)]
    budget = round(effort * ALLOCATION_EVALS / len(starts))
    scored = itertools.count(1)
    scoring = (lambda: progress(next(scored), budget * len(starts))) if progress else (lambda: None)
    _, stage_of, paths = min((_search_allocation(problem, start, pinned, rng, budget, scoring) for start in starts),
                             key=lambda found: found[0])
    return _finish(problem, stage_of, paths, rng, round(effort * POLISH_EVALS))


def replan(old: Plan, network: Network, dead: Sequence[str] | str = (), seed: int = 0, moves: int = 2,
           effort: float = 0.3) -> Plan:
    """A plan for `network` without the nodes named in `dead` (one name, or several) that keeps survivors
    on their stages in `old` where possible: a stage left with no node takes the survivor whose move gives
    the shortest simulated iteration; then a short local search may move up to `moves` more survivors (each
    move is a stage's weights to fetch) when that shortens the iteration. Nodes of `network` that
    `old` does not know (newcomers) take the stage where they help most. Paths are routed and
    polished again (`effort` as in `plan`)."""
    survivors = network.without([dead] if isinstance(dead, str) else list(dead))
    problem = _Problem(survivors, _check_request(survivors), True)
    old_stage = dict(zip(old.nodes, old.stage_of))
    stage_of = np.array([old_stage.get(node.name, -1) for node in survivors.nodes])
    pinned = _pinned(survivors, None)
    for node, stage in pinned.items():
        stage_of[node] = stage

    def refill_cost(node: int, stage: int) -> tuple[int, float]:
        """How good moving `node` to empty `stage` is: the simulated iteration once no stage is empty; while
        others still are (no path exists to simulate), leave the most nodes behind (a newcomer: all of them)."""
        candidate = _with(stage_of, node, stage)
        if len(set(candidate.tolist()) - {-1}) == survivors.stages:
            return 0, _route(problem, candidate)[0]
        return 1, -math.inf if stage_of[node] < 0 else -float((stage_of == stage_of[node]).sum())

    for stage in range(survivors.stages):
        if (stage_of == stage).any():
            continue
        movable = [n for n in range(len(survivors))
                   if n not in pinned and (stage_of[n] < 0 or (stage_of == stage_of[n]).sum() > 1)]
        if not movable:
            raise NetworkError(f"stage {stage} lost all its nodes and no survivor can move to it")
        stage_of[min(movable, key=lambda n: refill_cost(n, stage))] = stage
    for node in np.flatnonzero(stage_of < 0):  # newcomers no empty stage took: where they help most
        stage_of[node] = min(range(survivors.stages), key=lambda s: _route(problem, _with(stage_of, node, s))[0])
    rng = np.random.default_rng(seed)
    kept = stage_of.copy()
    best, paths = _route(problem, stage_of)
    for _ in range(round(effort * REPLAN_EVALS)):
        node = int(rng.integers(len(survivors)))
        candidate = _with(stage_of, node, int(rng.integers(survivors.stages)))
        if node in pinned or (candidate != kept).sum() > moves or len(set(candidate.tolist())) < survivors.stages:
            continue
        score, routed = _route(problem, candidate)
        if score < best:
            best, stage_of, paths = score, candidate, routed
    return _finish(problem, stage_of, paths, rng, round(effort * POLISH_EVALS))


def simulated_ms(network: Network, paths: Sequence[Sequence[int]]) -> float:
    """The simulated iteration time of `paths`; infinite when it deadlocks."""
    try:
        return simulate(network, paths, record=False).makespan_ms
    except Deadlock:
        return math.inf


def make_plan(network: Network, stage_of: Sequence[int], paths: Sequence[Sequence[int]]) -> Plan:
    """A Plan of these paths, its iteration time simulated."""
    return Plan(tuple(node.name for node in network.nodes), tuple(int(s) for s in stage_of),
                tuple(tuple(int(n) for n in path) for path in paths), network.stages, network.skip,
                simulated_ms(network, paths))


@dataclass(frozen=True)
class _Problem:
    network: Network
    length: int  # stages per path
    swaps: bool  # whether paths may swap neighbouring stages


def _check_request(network: Network) -> int:
    if network.stages > len(network):
        raise NetworkError(f"{network.source}: {network.stages} stages need at least {network.stages} nodes, "
                           f"the network has {len(network)}")
    return path_length(network.stages, network.skip)


def _pinned(network: Network, fixed: dict[str, int] | None) -> dict[int, int]:
    pinned = {i: node.stage for i, node in enumerate(network.nodes) if node.stage is not None}
    for name, stage in (fixed or {}).items():
        if not 0 <= stage < network.stages:
            raise NetworkError(f"fixed stage of {name!r} must be in [0, {network.stages - 1}], got {stage}")
        pinned[network.index(name)] = stage
    missing = sorted(set(range(network.stages)) - set(pinned.values()))
    if len(network) - len(pinned) < len(missing):
        raise NetworkError(f"{network.source}: stages {missing} have no pinned node and only "
                           f"{len(network) - len(pinned)} nodes are free to take them")
    return pinned


def _stage_sizes(network: Network, heads: int) -> list[int]:
    """`heads` nodes for stage 0, the others shared among stages 1.. (equal work), at least one each."""
    count, others = len(network), network.stages - 1
    base, extra = divmod(count - heads, others)
    return [heads] + [base + (s < extra) for s in range(others)]


def _head_counts(network: Network, length: int) -> range:
    """Stage-0 sizes worth trying: from stage 0's share of the work up to one head per `memory`
    microbatches (heads hold a microbatch for its whole round trip, so memory often limits them)."""
    count, stages = len(network), network.stages
    per_visit = node_work(network, [1] * count).mean()
    head_work = node_work(network, [0] * count).mean()
    share = head_work / (head_work + per_visit * (length - 1))
    memory = min(node.memory for node in network.nodes)
    low = max(1, min(count - stages + 1, math.floor(share * count)))
    high = max(low, min(count - stages + 1, math.ceil(network.microbatches / memory)))
    return range(low, high + 1)


def _initial_allocation(network: Network, length: int, pinned: dict[int, int], heads: int) -> np.ndarray:
    """Clusters of at most `length` nodes close in transfer time, each a head and distinct stages."""
    slots = _stage_sizes(network, heads)
    stage_of = np.full(len(network), -1)
    for node, stage in pinned.items():
        stage_of[node] = stage
        slots[stage] -= 1
    compute = np.array([node.compute_ms for node in network.nodes])
    for group in _clusters(network.transfer_ms + network.transfer_ms.T, length):
        taken = {stage_of[n] for n in group if stage_of[n] >= 0}
        for node in sorted((n for n in group if stage_of[n] < 0), key=lambda n: compute[n]):
            fresh = [s for s in range(network.stages) if s not in taken and slots[s] > 0]
            open_ = fresh or [s for s in range(network.stages) if slots[s] > 0]
            if not open_:
                open_ = [int(np.argmax(slots))]
            stage = 0 if 0 in open_ else max(open_, key=lambda s: (slots[s], -s))
            stage_of[node] = stage
            slots[stage] -= 1
            taken.add(stage)
    _fill_empty_stages(stage_of, pinned, network.stages)
    return stage_of


def _clusters(distance: np.ndarray, size: int) -> list[list[int]]:
    """Average-linkage agglomerative clusters of at most `size` nodes, largest first."""
    groups = [[i] for i in range(len(distance))]
    while True:
        best, pair = math.inf, None
        for a in range(len(groups)):
            for b in range(a + 1, len(groups)):
                if len(groups[a]) + len(groups[b]) <= size:
                    d = distance[np.ix_(groups[a], groups[b])].mean()
                    if d < best:
                        best, pair = d, (a, b)
        if pair is None:
            return sorted(groups, key=len, reverse=True)
        a, b = pair
        groups[a] += groups.pop(b)


def _fill_empty_stages(stage_of: np.ndarray, pinned: dict[int, int], stages: int) -> None:
    for stage in range(stages):
        if not (stage_of == stage).any():
            donors = [n for n in range(len(stage_of)) if n not in pinned and (stage_of == stage_of[n]).sum() > 1]
            stage_of[max(donors, key=lambda n: ((stage_of == stage_of[n]).sum(), -n))] = stage


def _search_allocation(problem: _Problem, stage_of: np.ndarray, pinned: dict[int, int], rng: np.random.Generator,
                       evals: int, scored: Callable[[], None]) -> tuple[tuple[float, float], np.ndarray,
                                                                         list[tuple[int, ...]]]:
    """Local search from `stage_of`: `evals` random moves and swaps of free nodes, each kept when the routed
    plan's simulated iteration is no longer (`scored()` as each begins). Returns the score, allocation and
    paths found."""
    network = problem.network
    free = [n for n in range(len(network)) if n not in pinned]
    best, paths = _route(problem, stage_of)
    for _ in range(evals if free else 0):
        scored()
        candidate = stage_of.copy()
        node = free[rng.integers(len(free))]
        if rng.random() < 0.5:
            candidate[node] = rng.integers(network.stages)
        else:
            other = free[rng.integers(len(free))]
            candidate[node], candidate[other] = stage_of[other], stage_of[node]
        if (candidate == stage_of).all() or len(set(candidate.tolist())) < network.stages:
            continue
        score, routed = _route(problem, candidate)
        if score <= best:
            best, stage_of, paths = score, candidate, routed
    return best, stage_of, paths


def _route(problem: _Problem, stage_of: np.ndarray) -> tuple[tuple[float, float], list[tuple[int, ...]]]:
    """The best simulated of the routings with each of LOAD_WEIGHTS, each in routing order and
    renumbered longest round trip first, and its score. Should every one deadlock (swapped stages
    under tight memory can), the paths are routed without swaps, which cannot: a resident
    microbatch then only waits for higher stages, or for its loss and backwards."""
    network = problem.network
    router = Router(network, stage_of, problem.length, problem.swaps)
    routed = [router.route(network.microbatches, weight) for weight in LOAD_WEIGHTS]
    routed += [router.longest_first(paths) for paths in routed]
    score, paths = min(((_objective(network, paths), paths) for paths in routed), key=lambda found: found[0])
    if math.isinf(score[0]) and problem.swaps:
        return _route(_Problem(network, problem.length, False), stage_of)
    return score, paths


def _with(stage_of: np.ndarray, node: int, stage: int) -> np.ndarray:
    changed = stage_of.copy()
    changed[node] = stage
    return changed


def _finish(problem: _Problem, stage_of: np.ndarray, paths: list[tuple[int, ...]], rng: np.random.Generator,
            evals: int) -> Plan:
    """Polish the paths, check every constraint, simulate."""
    paths = _polish(problem, stage_of, paths, rng, evals)
    found = make_plan(problem.network, stage_of, paths)
    problems = violations(found.stage_of, found.paths, problem.network.stages, problem.length, problem.swaps)
    if problems:
        raise RuntimeError(f"the planner broke its own constraints: {problems}")
    return found


def _polish(problem: _Problem, stage_of: np.ndarray, paths: list[tuple[int, ...]], rng: np.random.Generator,
            evals: int) -> list[tuple[int, ...]]:
    """Random changes that keep every constraint, each kept when the simulation improves."""
    network, length, swaps = problem.network, problem.length, problem.swaps
    members = [np.flatnonzero(stage_of == s) for s in range(network.stages)]
    valid = set(stage_sets(network.stages, length))
    best = _objective(network, paths)
    for _ in range(evals):
        candidate = list(paths)
        m = int(rng.integers(len(paths)))
        path = paths[m]
        kind = rng.integers(5)
        if kind == 4:  # another priority: trade places (ids) with another microbatch
            k = int(rng.integers(len(paths)))
            candidate[m], candidate[k] = paths[k], paths[m]
        elif kind == 0:  # another node for one stage (the head included)
            i = int(rng.integers(len(path)))
            candidate[m] = _replace(path, i, int(rng.choice(members[stage_of[path[i]]])))
        elif kind == 1 and swaps:  # another allowed order of the same stages
            by_stage = {int(stage_of[n]): n for n in path}
            options = orders(sorted(by_stage)[1:], swaps)
            order = options[int(rng.integers(len(options)))]
            candidate[m] = (path[0], *(by_stage[s] for s in order))
        elif kind in (2, 3) and length < network.stages:  # trade one stage with another microbatch
            k = int(rng.integers(len(paths)))
            traded = _trade(paths[m], paths[k], stage_of, valid, rng)
            if traded is None:
                continue
            candidate[m], candidate[k] = traded
        if candidate == paths:
            continue
        score = _objective(network, candidate)
        if score < best:
            best, paths = score, candidate
    return paths


def _objective(network: Network, paths: Sequence[Sequence[int]]) -> tuple[float, float]:
    try:
        timeline = simulate(network, paths, record=False)
    except Deadlock:
        return math.inf, math.inf
    return timeline.makespan_ms, sum(timeline.finish_ms)


def _replace(path: tuple[int, ...], i: int, node: int) -> tuple[int, ...]:
    return (*path[:i], node, *path[i + 1:])


def _trade(a: tuple[int, ...], b: tuple[int, ...], stage_of: np.ndarray, valid: set, rng: np.random.Generator):
    """a gives b one of its stages that b skips and takes one of b's that it skips (nodes included);
    both end in increasing order. None when no such trade keeps both stage sets valid."""
    stages_a = {int(stage_of[n]): n for n in a[1:]}
    stages_b = {int(stage_of[n]): n for n in b[1:]}
    give = sorted(set(stages_a) - set(stages_b))
    take = sorted(set(stages_b) - set(stages_a))
    if not give or not take:
        return None
    s, t = give[int(rng.integers(len(give)))], take[int(rng.integers(len(take)))]
    new_a = {**{k: v for k, v in stages_a.items() if k != s}, t: stages_b[t]}
    new_b = {**{k: v for k, v in stages_b.items() if k != t}, s: stages_a[s]}
    if tuple(sorted(new_a)) not in valid or tuple(sorted(new_b)) not in valid:
        return None
    return (a[0], *(new_a[k] for k in sorted(new_a))), (b[0], *(new_b[k] for k in sorted(new_b)))
