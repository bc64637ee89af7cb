"""SkipPipe (Blagoev et al. 2025, ALGORITHMS.md §5): partial pipelines planned for a heterogeneous network.

    network = load_network("examples/networks/regions20.json")   # or regions_network(nodes=20, seed=0)
    found = plan(network)                          # allocation + one path per microbatch, in seconds
    print(found.makespan_ms, full_pipeline(network).makespan_ms, network_blind(network).makespan_ms)
    after = replan(found, network, dead=["n07"])   # survivors keep their stages where possible

The planner:
network.py      the JSON network description, validation, synthetic geo-distributed networks
simulator.py    discrete-event simulation of one iteration (FIFO links and uplinks, memory gating, deadlocks)
constraints.py  the convergence constraints: path length, stage sets and orders, balanced visits
routing.py      network- and load-aware path choice per microbatch for a given allocation
planner.py      allocation search, routing, polish, re-planning
baselines.py    the full pipeline and network-blind skipping
The runtime (`decentral pipeline train|node|eval`; imported on demand, it needs torch and grpcio):
stages.py       the reference GPT cut into stages (stage 0: embedding, first blocks, head)
stage.proto     the wire format; frames.py writes and reads it (no generated code)
links.py        a node's outgoing gRPC calls: FIFO per destination or uplink, emulated latency
node.py         a stage server: one task at a time, memory-gated, one optimizer step per iteration
coordinator.py  iterations over the live nodes; re-planning and re-sending when a node dies or joins
discovery.py    stage servers announced in the swarm's DHT
serve.py        a node as a process; launch.py: a whole pipeline of processes here (loopback or netlab)
recipe.py       protocols/skippipe.yaml; evaluate.py: whole model vs stages dropped at inference
plot.py, cli.py, bench.py (the planner's benchmark), trainbench.py (the runtime's)
"""

from __future__ import annotations

from decentral.pipeline.baselines import full_pipeline, network_blind
from decentral.pipeline.constraints import path_length
from decentral.pipeline.network import (Network, NetworkError, Node, PipelineError, load_network, parse_network,
                                        regions_network)
from decentral.pipeline.planner import Plan, plan, replan
from decentral.pipeline.simulator import Deadlock, Timeline, simulate

__all__ = ["Deadlock", "Network", "NetworkError", "Node", "PipelineError", "Plan", "Timeline", "full_pipeline",
           "load_network",
           "network_blind", "parse_network", "path_length", "plan", "regions_network", "replan", "simulate"]
