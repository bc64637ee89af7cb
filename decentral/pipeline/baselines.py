"""What a SkipPipe plan is measured against, scored by the same simulator (ALGORITHMS.md §5).

- `full_pipeline`: no skipping, every microbatch visits every stage in order (DT-FM-style
  pipelines). It gets everything the planner has except skipping and swaps: its own allocation
  search scored for full paths (stage sizes, clustering, local search), the network- and load-aware
  choice of head and replica per microbatch, and the simulator-scored polish. A fair, strong baseline.
- `network_blind`: skipping under the same convergence constraints and skip ratio, chosen without
  looking at the network: nodes shuffled into stages of equal size (±1), microbatches dealt to the
  heads in turn, a balanced multiset of stage sets (constraints.balanced_sets, ties at random), then a random
  allowed order and random replicas. The reviewers' "skip with naive paths" baseline.
"""

from __future__ import annotations

import numpy as np

from decentral.pipeline.constraints import balanced_sets, orders, path_length, stage_sets
from decentral.pipeline.network import Network, NetworkError
from decentral.pipeline.planner import Plan, make_plan, plan


def full_pipeline(network: Network, seed: int = 0, effort: float = 1.0) -> Plan:
    """The planner's plan for `network` with skip 0 and no swaps (see the module docstring)."""
    return plan(network.replace(skip=0.0), seed=seed, effort=effort, swaps=False)


def network_blind(network: Network, seed: int = 0) -> Plan:
    """Constraint-satisfying skipping paths chosen at random, blind to the network (module docstring)."""
    if network.stages > len(network):
        raise NetworkError(f"{network.source}: {network.stages} stages need at least {network.stages} nodes, "
                           f"the network has {len(network)}")
    length = path_length(network.stages, network.skip)
    rng = np.random.default_rng(seed)
    count, stages = len(network), network.stages
    stage_of = np.array([i % stages for i in range(count)])[rng.permutation(count)]
    for i, node in enumerate(network.nodes):  # pinned nodes keep their stage: trade places with a free one
        if node.stage is not None and stage_of[i] != node.stage:
            free = [j for j in np.flatnonzero(stage_of == node.stage) if network.nodes[j].stage is None]
            if free:
                stage_of[free[0]] = stage_of[i]
            stage_of[i] = node.stage
    for s in range(stages):  # a pinned node left a stage no free node could refill: one from the fullest stage
        movable = [j for j in range(count) if network.nodes[j].stage is None and (stage_of == stage_of[j]).sum() > 1]
        if not (stage_of == s).any() and movable:
            stage_of[max(movable, key=lambda j: (stage_of == stage_of[j]).sum())] = s
    members = [np.flatnonzero(stage_of == s) for s in range(stages)]
    if any(len(m) == 0 for m in members):
        raise NetworkError(f"{network.source}: the pinned stages leave a stage without a node")
    sets = stage_sets(stages, length)
    paths = []
    for m, chosen in enumerate(balanced_sets(sets, stages, length, network.microbatches, rng)):
        options = orders(sets[chosen])
        order = options[int(rng.integers(len(options)))]
        head = members[0][m % len(members[0])]
        paths.append((head, *(int(rng.choice(members[s])) for s in order)))
    return make_plan(network, stage_of, paths)
