"""`decentral bench pipeline`: SkipPipe's planner against the full pipeline and network-blind skipping
(`decentral bench pipeline convergence|timing` benchmark the runtime: decentral.pipeline.trainbench).

For each seed, a synthetic geo-distributed network (network.regions_network: `nodes` nodes in
`regions` regions, links from about 1 ms / 2 Gb/s inside a region to 130 ms / 75 Mb/s across) is
planned; the three plans' iterations are simulated; then one random node that is not a head dies
and the plan is re-planned. Reported per seed and as the median over seeds: the iteration times,
planned ÷ full, planned against blind, planning time, re-planning time and the iteration after the
death. Writes OUT/results.json, OUT/pipeline_bench.png (bars per seed) and
OUT/pipeline_gantt_seedN.png (the Gantt charts of the median seed N). The issue's targets:
planned ≤ 0.5 × full, ≥ 15% below blind, planning < 10 s, re-planning < 2 s.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from decentral.netlab import rate_argument
from decentral.pipeline.baselines import full_pipeline, network_blind
from decentral.pipeline.network import regions_network
from decentral.pipeline.planner import plan, replan

TARGETS = {"planned_vs_full": 0.5, "planned_vs_blind": -0.15, "plan_s": 10.0, "replan_s": 2.0}


def plan_bench(seeds=(0, 1, 2), nodes: int = 20, stages: int = 6, skip: float = 0.33, regions: int = 5,
               microbatches: int = 24, effort: float = 1.0, out: str | Path = "runs/bench-pipeline") -> list[dict]:
    """Run the benchmark (module docstring); print the table and return one row per seed, then the median row."""
    from decentral.metrics import format_table, results_folder
    from decentral.pipeline.plot import plot_bench, plot_plans

    with results_folder(out, "bench pipeline"):
        rows, plans = [], {}
        for seed in tqdm(seeds, desc="bench pipeline", unit="seed", disable=None, leave=False):  # on a terminal only
            network = regions_network(nodes=nodes, regions=regions, seed=seed, stages=stages, skip=skip,
                                      microbatches=microbatches)
            start = time.perf_counter()
            planned = plan(network, seed=seed, effort=effort)
            plan_s = time.perf_counter() - start
            full = full_pipeline(network, seed=seed, effort=effort)
            blind = network_blind(network, seed=seed)
            rng = np.random.default_rng(seed)
            dead = planned.nodes[int(rng.choice([n for n, s in enumerate(planned.stage_of) if s != 0]))]
            start = time.perf_counter()
            after = replan(planned, network, dead=[dead], seed=seed)
            replan_s = time.perf_counter() - start
            rows.append({"seed": seed, "full_s": full.makespan_ms / 1e3, "blind_s": blind.makespan_ms / 1e3,
                         "planned_s": planned.makespan_ms / 1e3,
                         "planned_vs_full": planned.makespan_ms / full.makespan_ms,
                         "planned_vs_blind": planned.makespan_ms / blind.makespan_ms - 1, "plan_s": plan_s,
                         "dead": dead, "replan_s": replan_s, "after_death_s": after.makespan_ms / 1e3})
            plans[seed] = (network, full, blind, planned)
        median = {key: statistics.median(row[key] for row in rows) for key in rows[0] if key not in ("seed", "dead")}
        table = [("seed", "full", "blind", "planned", "planned/full", "vs blind", "plan", "replan", "after death")]
        for row in rows + [{**median, "seed": "median"}]:
            table.append((str(row["seed"]), f"{row['full_s']:.1f} s", f"{row['blind_s']:.1f} s",
                          f"{row['planned_s']:.1f} s", f"{row['planned_vs_full']:.2f}",
                          f"{row['planned_vs_blind']:+.0%}",
                          f"{row['plan_s']:.1f} s", f"{row['replan_s']:.2f} s", f"{row['after_death_s']:.1f} s"))
        print(f"{nodes} nodes in {regions} regions, {stages} stages, skip {skip}, {microbatches} microbatches, "
              f"effort {effort}; simulated iteration times")
        print(format_table(table))
        met = {key: (median[key] <= limit) for key, limit in TARGETS.items()}
        print("targets (median): " + ", ".join(f"{key} {median[key]:.3f} {'<=' if ok else '>'} {TARGETS[key]} "
                                               f"{'met' if ok else 'MISSED'}" for key, ok in met.items()))
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        settings = {"nodes": nodes, "regions": regions, "stages": stages, "skip": skip, "microbatches": microbatches,
                    "effort": effort, "machine": platform.platform(), "python": platform.python_version()}
        (out / "results.json").write_text(json.dumps({"settings": settings, "rows": rows, "median": median,
                                                      "targets": TARGETS, "met": met}, indent=1) + "\n")
        plot_bench(rows, out / "pipeline_bench.png",
                   title=f"{nodes} nodes, {regions} regions, {stages} stages, skip {skip}")
        middle = sorted(rows, key=lambda row: row["planned_vs_full"])[len(rows) // 2]["seed"]
        network, full, blind, planned = plans[middle]
        plot_plans(network, [("full pipeline", full), ("network-blind skipping", blind), ("planned", planned)],
                   out / f"pipeline_gantt_seed{middle}.png")
        print(f"wrote {out / 'results.json'}, {out / 'pipeline_bench.png'}, {out / f'pipeline_gantt_seed{middle}.png'}")
        return rows + [{**median, "seed": "median"}]


def add_arguments(parser) -> None:
    """`decentral bench pipeline` (the planner), `... pipeline convergence` and `... pipeline timing` (the
    runtime: decentral.pipeline.trainbench)."""
    from decentral.cli import example, number_type, positive_int
    from decentral.pipeline import trainbench
    from decentral.pipeline.recipe import SHIPPED_RECIPE

    suites = parser.add_subparsers(dest="pipeline_suite", title="the runtime's benchmarks")
    convergence = suites.add_parser("convergence", help="skip vs no skip at equal iterations; half the stages "
                                    "dropped at inference", description=trainbench.__doc__, **example(
                                        "decentral bench pipeline convergence --steps 300 --out runs/bench-skippipe"))
    convergence.add_argument("--recipe", default=SHIPPED_RECIPE,
                             help="a SkipPipe recipe (default: the shipped protocols/skippipe.yaml)")
    convergence.add_argument("--steps", type=int, help="iterations (default: the recipe's)")
    convergence.add_argument("--skips", type=float, nargs="+", default=[0.0, 0.33], help="the first is the baseline")
    convergence.add_argument("--drop", type=float, default=0.5)
    convergence.add_argument("--data", action="append", metavar="PATH")
    convergence.add_argument("--netlab", metavar="RATE", type=rate_argument,
                             help="run the nodes on netlab hosts with this uplink")
    convergence.add_argument("--out", default="runs/bench-skippipe")
    convergence.set_defaults(func=lambda args: trainbench.convergence_bench(
        args.out, args.recipe, args.steps, tuple(args.skips), args.drop, args.data, args.netlab) and 0)
    timing = suites.add_parser("timing", help="the runtime's iteration time on netlab hosts against the simulator's",
                               description=trainbench.__doc__, **example(
                                   "decentral bench pipeline timing --nodes 4 --stages 4 --out runs/bench-skippipe-timing"))
    timing.add_argument("--recipe", default=SHIPPED_RECIPE,
                        help="model and microbatch shape (default: the shipped protocols/skippipe.yaml)")
    timing.add_argument("--bandwidth", type=rate_argument, default="20mbit", help="every host's uplink cap")
    timing.add_argument("--latency-ms", type=number_type(float, 0), default=20.0)
    timing.add_argument("--nodes", type=int, default=8)
    timing.add_argument("--stages", type=int, default=4)
    timing.add_argument("--skips", type=float, nargs="+", default=[0.0, 0.25])
    timing.add_argument("--microbatches", type=int, default=8)
    timing.add_argument("--iterations", type=positive_int, default=6, help="measured iterations (after the warm-up)")
    timing.add_argument("--warmup", type=int, default=2, help="iterations whose measured compute the plan is "
                        "made again with, left out of the comparison")
    timing.add_argument("--data", action="append", metavar="PATH")
    timing.add_argument("--out", default="runs/bench-skippipe-timing")
    timing.set_defaults(func=lambda args: trainbench.timing_bench(
        args.out, args.recipe, args.bandwidth, args.latency_ms, args.nodes, args.stages, tuple(args.skips),
        args.microbatches, args.iterations, args.warmup, args.data) and 0)
    parser.add_argument("--seeds", type=number_type(int, 0), nargs="+", default=[0, 1, 2])
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--regions", type=int, default=5)
    parser.add_argument("--stages", type=int, default=6)
    parser.add_argument("--skip", type=float, default=0.33)
    parser.add_argument("--microbatches", type=int, default=24)
    parser.add_argument("--effort", type=float, default=1.0, help="scales the planner's search")
    parser.add_argument("--out", default="runs/bench-pipeline")
    parser.set_defaults(func=lambda args: plan_bench(tuple(args.seeds), nodes=args.nodes, stages=args.stages,
                                                     skip=args.skip, regions=args.regions,
                                                     microbatches=args.microbatches, effort=args.effort,
                                                     out=args.out) and 0)
