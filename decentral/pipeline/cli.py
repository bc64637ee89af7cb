"""`decentral pipeline`: SkipPipe. `plan` plans which stages each microbatch visits over a network and
simulates the plan; `train` runs a pipeline of processes here (or `node`, one per machine); `eval` scores
what a run trained, whole and with stages dropped. `decentral pipeline COMMAND --help` says more.

example:
  decentral pipeline train --steps 300 --out runs/skippipe
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from decentral.cli import described, interrupting, number_type, positive_int
from decentral.netlab import rate_argument
from decentral.pipeline.baselines import full_pipeline, network_blind
from decentral.pipeline.constraints import path_length
from decentral.pipeline.network import PipelineError, load_network
from decentral.pipeline.planner import Plan, plan
from decentral.pipeline.recipe import SHIPPED_RECIPE


PLAN_HELP = """Read a network file (see decentral.pipeline.network), plan the allocation and the path of every
microbatch, and simulate one iteration of three plans: the full pipeline (every stage, network-aware),
network-blind skipping, and the plan. Writes the plan as JSON and, with --plot, their Gantt charts.

example:
  decentral pipeline plan examples/networks/regions20.json --stages 6 --skip 0.33 --out plan.json --plot plan.png
"""

TRAIN_HELP = """Train the reference GPT with SkipPipe: one `decentral pipeline node` process per node of the
network (the recipe's pipeline.network, --network, or pipeline.nodes equal nodes on loopback), each
with its stage; the first head leads. With --netlab, every node runs in its own network namespace
behind an uplink capped at that rate, with --latency-ms added to every message. Afterwards the
model is put together from the nodes' checkpoints and evaluated whole and with --drop of its
stages dropped (stage 0 kept). Writes OUT/<node>/stage/ (its checkpoint), OUT/<node>.log (its
output), OUT/<lead>/metrics.jsonl (one record per iteration: loss, measured and simulated
makespan), OUT/eval.json. When the lead dies,
another head takes over; nodes checkpoint every train.eval_every iterations, and --resume goes on
from there (after a stop, or the death of a run's only head).

example:
  decentral pipeline train --steps 300 --out runs/skippipe
"""

EVAL_HELP = """Evaluate a `decentral pipeline train` run: validation loss and perplexity of the whole model and,
with a share --drop of its stages dropped at inference (stage 0 kept, the others a sorted subset),
the mean perplexity over subsets (all of them when there are at most 20 or at most --draws, else --draws
at random). Written to RUN/eval.json, in place of the last evaluation (the one its training wrote).

example:
  decentral pipeline eval runs/skippipe --drop 0.5
"""

NODE_HELP = """One node of a pipeline (what `pipeline train` starts per node; run it yourself on each machine):
joins the swarm's DHT, serves its stage over gRPC, announces itself; with --lead (a stage-0 node)
it also coordinates: plans, runs --steps iterations, re-plans when a node dies or joins.

example:
  decentral pipeline node --recipe protocols/skippipe.yaml --network net.json --name a1 --lead --out runs/a1
"""


def add_pipeline_parser(subparsers) -> argparse.ArgumentParser:
    """Register `pipeline plan|train|eval|node` on the `decentral` command's subparsers; returns the
    `pipeline` parser."""
    pipeline = subparsers.add_parser("pipeline", help="SkipPipe: plan, train and evaluate partial pipelines",
                                     **described(__doc__))
    commands = pipeline.add_subparsers(dest="pipeline_command", required=True)
    p = commands.add_parser("plan", help="plan stages and microbatch paths; simulate them against the baselines",
                            **described(PLAN_HELP))
    p.add_argument("network", metavar="NETWORK.json", help="nodes, links and training shape (JSON)")
    p.add_argument("--stages", type=int, help="pipeline stages (default: the file's)")
    p.add_argument("--skip", type=float, help="share of stages each microbatch skips, in [0, 1) (default: the file's)")
    p.add_argument("--microbatches", type=int, help="microbatches per iteration (default: the file's)")
    p.add_argument("--activation-bytes", type=int, help="bytes of one microbatch's activations on the wire "
                   "(default: the file's)")
    p.add_argument("--seed", type=number_type(int, 0), default=0, help="seed of the planner's search and of the blind "
                   "baseline")
    p.add_argument("--effort", type=number_type(float, 0, strict=True), default=1.0,
                   help="scales the planner's search (default 1: seconds for 20 nodes and 6 stages, about 2 "
                        "minutes at 12)")
    p.add_argument("--out", default="plan.json", help="where to write the plan (default: plan.json)")
    p.add_argument("--plot", metavar="PNG", help="also draw the three plans' Gantt charts here")
    p.set_defaults(func=cmd_plan)

    t = commands.add_parser("train", help="train the reference GPT with SkipPipe on local processes; evaluate it",
                            **described(TRAIN_HELP))
    t.add_argument("--recipe", default=SHIPPED_RECIPE,
                   help="a SkipPipe recipe (default: the shipped protocols/skippipe.yaml)")
    t.add_argument("--network", metavar="NETWORK.json", help="the nodes and links to plan for (default: the "
                   "recipe's pipeline.network, else pipeline.nodes equal nodes); the pipeline's shape (stages, skip, "
                   "microbatches, activation size) is the recipe's, whatever the file says; not with --resume, which "
                   "keeps the run's OUT/network.json")
    t.add_argument("--steps", type=positive_int, help="iterations, the learning rate schedule's length (default: the "
                   "recipe's train.steps)")
    t.add_argument("--out", default="runs/skippipe", help="the run's folder: a folder and a log per node, "
                   "network.json, eval.json (default: runs/skippipe)")
    t.add_argument("--data", action="append", metavar="PATH", help="text file or folder (default: Python's stdlib)")
    t.add_argument("--netlab", metavar="RATE", type=rate_argument, help="run every node in its own netlab host, uplink "
                   "capped at RATE (e.g. 20mbit); needs root, else loopback with paced sends")
    t.add_argument("--latency-ms", type=number_type(float, 0), default=0.0, help="latency added to every message we send")
    t.add_argument("--drop", type=float, default=0.5, help="share of stages dropped in the evaluation (default 0.5)")
    t.add_argument("--timeout", type=number_type(float, 0, strict=True), default=3600.0,
                   help="the longest the run may take, in seconds, its nodes' start-up included; then the nodes stop "
                        "(saving their checkpoints takes seconds more) and the command exits 2")
    t.add_argument("--resume", action="store_true", help="go on from the nodes' checkpoints in OUT (a run "
                   "stopped or whose lead died), to --steps")
    t.set_defaults(func=cmd_train)

    e = commands.add_parser("eval", help="evaluate a pipeline run: whole model and with stages dropped",
                            **described(EVAL_HELP))
    e.add_argument("run", metavar="RUN", help="a `decentral pipeline train` output folder")
    e.add_argument("--drop", type=float, default=0.5, help="share of stages dropped (default 0.5)")
    e.add_argument("--draws", type=positive_int, default=10,
                   help="random subsets scored when there are more than 20 (all of them when there are at most "
                   "this many; default 10)")
    e.add_argument("--data", action="append", metavar="PATH", help="text whose validation split scores the model "
                   "(default: Python's stdlib)")
    e.add_argument("--seed", type=number_type(int, 0), default=0, help="seed of the random subsets of stages "
                   "dropped (default 0)")
    e.set_defaults(func=cmd_eval)

    n = commands.add_parser("node", help="one node of a pipeline (started by `pipeline train`, or by you per machine)",
                            **described(NODE_HELP))
    n.add_argument("--recipe", required=True, help="the SkipPipe recipe every node of the run uses")
    n.add_argument("--network", metavar="NETWORK.json", help="the network (default: the recipe's); the lead plans "
                   "over it, the others read their stage and memory from it")
    n.add_argument("--name", required=True, help="this node's name in the network file")
    n.add_argument("--stage", type=int, help="the stage to serve (default: the network file's pin)")
    n.add_argument("--out", required=True, help="folder for the stage checkpoint, identity and (lead) metrics")
    n.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for other machines")
    n.add_argument("--port", type=int, default=0, help="gRPC port (0: any free one)")
    n.add_argument("--dht-port", type=int, default=0, help="DHT port (0: any free one)")
    n.add_argument("--announce-host", help="address other machines reach us at, when it differs from --host")
    n.add_argument("--join", action="append", metavar="MADDR", help="multiaddr of any swarm member (repeatable)")
    n.add_argument("--swarm-key", metavar="FILE", help="the swarm's key (default: $DECENTRAL_SWARM_KEY, else the "
                   "recipe's swarm.key_file, else an open swarm)")
    n.add_argument("--maddr-file", help="write our DHT multiaddrs here once up")
    n.add_argument("--lead", action="store_true", help="also coordinate the run (a stage-0 node)")
    n.add_argument("--steps", type=positive_int, help="iterations, the learning rate schedule's length, which the lead "
                   "tells every node: for the lead and any head that may take over from it (default: the recipe's "
                   "train.steps)")
    n.add_argument("--data", action="append", metavar="PATH",
                   help="training text, for heads (default: Python's stdlib)")
    n.add_argument("--wait", type=number_type(float, 0, strict=True), default=300.0,
                   help="seconds the lead waits for the network's nodes")
    n.add_argument("--resume", action="store_true", help="start from OUT/stage (the lead: from its iteration)")
    n.set_defaults(func=cmd_node)
    return pipeline


def cmd_train(args) -> int:
    """Run `train_run`; Ctrl-C, SIGTERM or SIGHUP ends every node and says where the run can go on from (exit 130)."""
    from decentral.pipeline.evaluate import format_evaluation
    from decentral.pipeline.launch import resume_hint, stage_checkpoints, train_run

    if not args.resume and stage_checkpoints(args.out):  # (a benchmark's train_run may write over its own)
        raise PipelineError(f"{args.out} holds an earlier run (stage checkpoints): --resume goes on from it; to start "
                            "over, remove it or give another --out")
    try:
        with interrupting(signal.SIGTERM, signal.SIGHUP):
            result = train_run(args.recipe, args.out, network_path=args.network, netlab=args.netlab,
                               latency_ms=args.latency_ms, steps=args.steps, data=args.data, drop=args.drop,
                               timeout_s=args.timeout, resume=args.resume)
    except KeyboardInterrupt:
        print(f"pipeline train: interrupted; {resume_hint(args.out, args.recipe)}", file=sys.stderr, flush=True)
        return 130
    print(format_evaluation(result["evaluation"]))
    print(f"wrote {args.out}/eval.json; `decentral pipeline eval {args.out}` scores it again")
    return 0


def cmd_eval(args) -> int:
    from decentral.pipeline.evaluate import evaluate_run, format_evaluation

    result = evaluate_run(args.run, drop=args.drop, draws=args.draws, data=args.data, seed=args.seed)
    print(format_evaluation(result))
    print(f"wrote {Path(args.run) / 'eval.json'} (in place of the last evaluation)")
    return 0


def cmd_node(args) -> int:
    from decentral.pipeline.launch import node_network
    from decentral.pipeline.recipe import load_pipeline_recipe
    from decentral.pipeline.serve import NodeOptions, run_node
    from decentral.swarm.admission import KEY_ENV, OPEN_SWARM_NOTICE, SwarmKey, key_file_note

    signal.signal(signal.SIGINT, signal.default_int_handler)  # how `pipeline train` stops a node, even one it
    # started in the background (which inherits SIGINT ignored): as on Ctrl-C, its DHT and server close on the way out
    recipe = load_pipeline_recipe(args.recipe)
    key = args.swarm_key or os.environ.get(KEY_ENV) or recipe.recipe.swarm.key_file
    if not key:
        print(OPEN_SWARM_NOTICE + " Without one, the pipeline's gRPC calls are not signed either.", file=sys.stderr,
              flush=True)
    elif (note := key_file_note(key)) is not None:
        print(note, file=sys.stderr, flush=True)
    return run_node(NodeOptions(
        name=args.name, recipe=recipe, network=node_network(recipe, args.network), out=Path(args.out),
        stage=args.stage, host=args.host, port=args.port, dht_port=args.dht_port, announce_host=args.announce_host,
        join=args.join or (), swarm_key=SwarmKey.load(key) if key else None, lead=args.lead, steps=args.steps,
        data=args.data, maddr_file=Path(args.maddr_file) if args.maddr_file else None, wait_s=args.wait,
        resume=args.resume, print_fn=lambda line: print(line, flush=True)))


def cmd_plan(args) -> int:
    from tqdm import tqdm

    from decentral.metrics import cell, format_table

    out = Path(args.out)
    if out.is_dir():
        raise PipelineError(f"--out {out} is a folder: give the plan's file name, e.g. {out / 'plan.json'}")
    if args.plot:
        from decentral.metrics import check_picture_path

        check_picture_path(args.plot, "--plot")
    network = load_network(args.network, {"stages": args.stages, "skip": args.skip, "microbatches": args.microbatches,
                                          "activation_bytes": args.activation_bytes})
    with tqdm(total=0, desc="planning", unit="allocation", disable=None, leave=False) as bar:  # on a terminal only
        def tried(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        start = time.perf_counter()
        planned = plan(network, seed=args.seed, effort=args.effort, progress=tried)
        planning_s = round(time.perf_counter() - start, 3)  # as the record keeps it: printed from the same value
    length = path_length(network.stages, network.skip)  # checked by `plan`, after the nodes are counted
    full = full_pipeline(network, seed=args.seed, effort=args.effort)
    blind = network_blind(network, seed=args.seed)
    print(f"{args.network}: {len(network)} nodes, {network.stages} stages, skip {network.skip:g} "
          f"({length} stages per path), {network.microbatches} microbatches")
    rows = [("simulated iteration", "time", "vs full", "vs blind")]
    full_ms, blind_ms = _iteration_ms(full), _iteration_ms(blind)
    for name, found in (("full pipeline", full), ("network-blind skipping", blind), ("planned", planned)):
        ms = _iteration_ms(found)
        rows.append((name, "deadlocks" if ms is None else f"{ms / 1e3:.1f} s",
                     cell(ms and full_ms and ms / full_ms, ".2f") + ("x" if ms and full_ms else ""),
                     cell(ms and blind_ms and ms / blind_ms - 1, "+.0%")))
    print(format_table(rows))
    target = out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(_compact_json(_plan_record(args, network, length, planned, full, blind, planning_s)))
        if args.plot:
            from decentral.pipeline.plot import plot_plans

            target = Path(args.plot)
            plot_plans(network, [("full pipeline", full), ("network-blind skipping", blind), ("planned", planned)],
                       target)
    except OSError as e:
        raise PipelineError(f"cannot write {target}: {e.strerror or e} ({e.filename})") from None
    print(f"planned in {planning_s:.1f} s; wrote {out}" + (f", {args.plot}" if args.plot else ""))
    return 0


def _plan_record(args, network, length: int, planned: Plan, full: Plan, blind: Plan, planning_s: float) -> dict:
    return {
        "inputs": {"network": str(args.network), "nodes": len(network), "stages": network.stages,
                   "skip": network.skip, "path_length": length, "microbatches": network.microbatches,
                   "activation_bytes": network.activation_bytes, "seed": args.seed, "effort": args.effort},
        "iteration_ms": {"full_pipeline": _iteration_ms(full), "network_blind": _iteration_ms(blind),
                         "planned": _iteration_ms(planned)},  # (null: the plan deadlocks)
        "planning_s": round(planning_s, 3),
        **planned.to_json(),
    }


def _iteration_ms(plan: Plan) -> float | None:
    """`plan`'s simulated iteration in ms (3 decimals); None when it deadlocks (JSON has no infinity)."""
    return round(plan.makespan_ms, 3) if math.isfinite(plan.makespan_ms) else None


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
