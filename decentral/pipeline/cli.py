"""`decentral pipeline plan`: plan SkipPipe paths for a network and compare them with the baselines.

Reads a network file (see decentral.pipeline.network), plans the allocation and the path of every
microbatch, and simulates one iteration of three plans: the full pipeline (every stage, network-aware),
network-blind skipping, and the plan. Writes the plan as JSON and, with --plot, their Gantt charts.

example:
  decentral pipeline plan examples/networks/regions20.json --stages 6 --skip 0.33 --out plan.json --plot plan.png
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from decentral.pipeline.baselines import full_pipeline, network_blind
from decentral.pipeline.constraints import path_length
from decentral.pipeline.network import load_network
from decentral.pipeline.planner import Plan, plan


DESCRIPTION, _, EXAMPLE = __doc__.partition("\nexample:")


def add_pipeline_parser(subparsers) -> argparse.ArgumentParser:
    """Register `pipeline plan` on the `decentral` command's subparsers; returns the `pipeline` parser."""
    help_text = dict(description=DESCRIPTION, epilog="example:" + EXAMPLE,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    pipeline = subparsers.add_parser("pipeline", help="SkipPipe: plan partial pipelines over a heterogeneous network",
                                     **help_text)
    commands = pipeline.add_subparsers(dest="pipeline_command", required=True)
    p = commands.add_parser("plan", help="plan stages and microbatch paths; simulate them against the baselines",
                            **help_text)
    p.add_argument("network", metavar="NETWORK.json", help="nodes, links and training shape (JSON)")
    p.add_argument("--stages", type=int, help="pipeline stages (default: the file's)")
    p.add_argument("--skip", type=float, help="share of stages each microbatch skips, in [0, 1) (default: the file's)")
    p.add_argument("--microbatches", type=int, help="microbatches per iteration (default: the file's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the planner's search and of the blind baseline")
    p.add_argument("--effort", type=float, default=1.0, help="scales the planner's search (default 1: seconds "
                   "for 20 nodes)")
    p.add_argument("--out", default="plan.json", help="where to write the plan (default: plan.json)")
    p.add_argument("--plot", metavar="PNG", help="also draw the three plans' Gantt charts here")
    p.set_defaults(func=cmd_plan)
    return pipeline


def cmd_plan(args) -> int:
    from decentral.metrics import format_table

    network = load_network(args.network).replace(stages=args.stages, skip=args.skip, microbatches=args.microbatches)
    length = path_length(network.stages, network.skip)
    start = time.perf_counter()
    planned = plan(network, seed=args.seed, effort=args.effort)
    planning_s = time.perf_counter() - start
    full = full_pipeline(network, seed=args.seed, effort=args.effort)
    blind = network_blind(network, seed=args.seed)
    print(f"{args.network}: {len(network)} nodes, {network.stages} stages, skip {network.skip:g} "
          f"({length} stages per path), {network.microbatches} microbatches")
    rows = [("simulated iteration", "time", "vs full", "vs blind")]
    for name, found in (("full pipeline", full), ("network-blind skipping", blind), ("planned", planned)):
        rows.append((name, f"{found.makespan_ms / 1e3:.1f} s", f"{found.makespan_ms / full.makespan_ms:.2f}x",
                     f"{found.makespan_ms / blind.makespan_ms - 1:+.0%}"))
    print(format_table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_compact_json(_plan_record(args, network, length, planned, full, blind, planning_s)))
    written = [str(out)]
    if args.plot:
        from decentral.pipeline.plot import plot_plans

        written.append(str(plot_plans(network, [("full pipeline", full), ("network-blind skipping", blind),
                                                ("planned", planned)], args.plot)))
    print(f"planned in {planning_s:.1f} s; wrote {', '.join(written)}")
    return 0


def _plan_record(args, network, length: int, planned: Plan, full: Plan, blind: Plan, planning_s: float) -> dict:
    return {
        "inputs": {"network": str(args.network), "nodes": len(network), "stages": network.stages,
                   "skip": network.skip, "path_length": length, "microbatches": network.microbatches,
                   "activation_bytes": network.activation_bytes, "seed": args.seed, "effort": args.effort},
        "iteration_ms": {"full_pipeline": round(full.makespan_ms, 3), "network_blind": round(blind.makespan_ms, 3),
                         "planned": round(planned.makespan_ms, 3)},
        "planning_s": round(planning_s, 3),
        **planned.to_json(),
    }


def _compact_json(record: dict) -> str:
    """JSON with one top-level key per line, and one line per stage or path inside lists of lists."""
    lines = []
    for key, value in record.items():
        if isinstance(value, list):
            inner = ",\n".join(f"  {json.dumps(item)}" for item in value)
            lines.append(f" {json.dumps(key)}: [\n{inner}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"
