"""Benchmarks of the SkipPipe runtime: `decentral bench pipeline convergence` and `... timing`.

**convergence**: the recipe trained as a pipeline of processes twice, with and without skipping, for
the same number of iterations (same data, seed, microbatches); each model is then evaluated whole
and with half its stages dropped at inference (decentral.pipeline.evaluate). The issue's targets: the
skip run's whole-model validation loss within 3% of the no-skip run's, and dropping half the stages
of the skip-trained model costs at most +10% perplexity (the no-skip model's cost is reported too).

**timing**: the runtime's measured iteration against the simulator's prediction for the same paths.
Each node runs in its own netlab host (network namespace, uplink capped by tc tbf) with latency added
to every message; the network file describes exactly that: every node's uplink at the cap
(`uplink_mbps`), every link at the cap and the latency, and each node's forward time, backward and
loss factors measured on this machine for the recipe's stages, one process alone. The run calibrates
(`pipeline.calibrate_at` = `warmup`): after the warm-up iterations the plan takes the compute the
nodes measured and is made again, since N processes sharing a few cores compute slower than one
alone (a real deployment, a machine per node, would not see that; a heterogeneous one would see its
file's guesses corrected). The runtime's makespan (first `begin` at a head to the last backward end)
of every later iteration is compared with `simulate` of the routes it ran: with the calibrated
network (the plan's own prediction, the target: within 15%), and with the file's compute (what an
uncalibrated plan would have predicted).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch
import yaml

from decentral.pipeline.constraints import path_length
from decentral.pipeline.recipe import SHIPPED_RECIPE, load_pipeline_recipe, parse_pipeline_recipe

CONVERGENCE_TARGETS = {"skip_vs_full_val_loss": 0.03, "skip_model_half_ppl": 0.10}
TIMING_TARGET = 0.15


def convergence_bench(out: str | Path = "runs/bench-skippipe", recipe: str | Path = SHIPPED_RECIPE,
                      steps: int | None = None, skips: tuple[float, ...] = (0.0, 0.33), drop: float = 0.5,
                      data=None, netlab: str | None = None) -> list[dict]:
    """Train the recipe at each skip ratio for `steps` iterations, evaluate, print the table (module docstring)."""
    from decentral.metrics import format_table, results_folder
    from decentral.pipeline.launch import train_run

    out = Path(out)
    base = yaml.safe_load(Path(recipe).read_text())
    stages = parse_pipeline_recipe(base, str(recipe)).pipeline.stages
    for skip in skips:  # every variant plannable before the first trains
        path_length(stages, skip)
    with results_folder(out, "bench pipeline convergence"):
        rows = []
        for skip in skips:
            folder = out / f"skip{skip:g}"
            folder.mkdir(parents=True, exist_ok=True)
            variant = {**base, "pipeline": {**base.get("pipeline", {}), "skip": skip}}
            (folder / "recipe.yaml").write_text(yaml.safe_dump(variant, sort_keys=False))
            started = time.perf_counter()
            result = train_run(folder / "recipe.yaml", folder, steps=steps, data=data, drop=drop, netlab=netlab)
            records = [r for r in result["metrics"] if "loss" in r]
            evaluation = result["evaluation"]
            rows.append({"skip": skip, "iterations": len(records), "wall_s": time.perf_counter() - started,
                         "iteration_s": statistics.median(r["wall_ms"] for r in records) / 1e3,
                         "train_loss": statistics.mean(r["loss"] for r in records[-20:]), **evaluation,
                         "losses": [r["loss"] for r in records]})
        full, skipped = rows[0], rows[-1]
        checks = {"skip_vs_full_val_loss": skipped["full_loss"] / full["full_loss"] - 1,
                  "skip_model_half_ppl": skipped["ppl_increase"]}
        table = [("skip", "iterations", "train loss (last 20)", "val loss", "val ppl", f"ppl, {drop:.0%} dropped",
                  "vs whole", "s / iteration")]
        for row in rows:
            table.append((f"{row['skip']:g}", str(row["iterations"]), f"{row['train_loss']:.4f}",
                          f"{row['full_loss']:.4f}", f"{row['full_ppl']:.3f}", f"{row['dropped_ppl']:.3f}",
                          f"{row['ppl_increase']:+.1%}", f"{row['iteration_s']:.2f}"))
        print(format_table(table))
        print("targets: " + ", ".join(f"{key} {value:+.1%} (<= {CONVERGENCE_TARGETS[key]:.0%}: "
                                      f"{'met' if value <= CONVERGENCE_TARGETS[key] else 'MISSED'})"
                                      for key, value in checks.items()))
        _write(out, {"settings": {"recipe": str(recipe), "steps": steps, "skips": list(skips), "drop": drop,
                                  "netlab": netlab, **_machine()}, "rows": rows, "checks": checks,
                     "targets": CONVERGENCE_TARGETS})
        _plot_convergence(rows, drop, out / "convergence.png")
        print(f"wrote {out / 'results.json'}, {out / 'convergence.png'}")
        return rows


def calibrate(recipe, reps: int = 20) -> dict:
    """Forward time (ms) of stage 0 and of the other stages for one microbatch, and the backward's and
    the loss's time in forward times, measured here on one thread (median of `reps`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every node runs
    try:
        return _calibrate(recipe, reps)
    finally:
        torch.set_num_threads(threads)


def _calibrate(recipe, reps: int) -> dict:
    from decentral.pipeline.stages import make_stage

    model, train, stages = recipe.recipe.model, recipe.recipe.train, recipe.pipeline.stages
    head, other = (make_stage(model, stages, s, train.seed) for s in (0, 1))
    tokens = torch.randint(0, model.vocab_size, (train.batch_size, train.context))
    hidden = torch.randn(train.batch_size, train.context, model.d_model, requires_grad=True)

    def timed(fn) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)

    forward = {0: timed(lambda: head.begin(tokens)), 1: timed(lambda: other(hidden))}  # with graphs, as in training
    out0, out1 = head.begin(tokens), other(hidden)
    backward0 = timed(lambda: torch.autograd.grad(out0, head.forward_parameters(), torch.ones_like(out0),
                                                  retain_graph=True))
    backward1 = timed(lambda: torch.autograd.grad(out1, [hidden, *other.parameters()], torch.ones_like(out1),
                                                  retain_graph=True))

    def loss() -> None:
        h = hidden.detach().requires_grad_()
        torch.autograd.grad(head.loss(h, tokens), [h, *head.loss_parameters()])

    return {"forward_ms": forward, "backward_factor": (backward0 / forward[0] + backward1 / forward[1]) / 2,
            "loss_factor": timed(loss) / forward[0]}


def timing_network(recipe, costs: dict, nodes: int, rate_mbps: float, latency_ms: float) -> dict:
    """The network file of `nodes` netlab hosts (module docstring), stages pinned by the planner."""
    from decentral.pipeline.launch import pinned
    from decentral.pipeline.network import parse_network
    from decentral.pipeline.recipe import shaped_network

    config = recipe.pipeline
    data = {"stages": config.stages, "skip": config.skip, "microbatches": config.microbatches,
            "activation_bytes": recipe.activation_bytes(), "backward_factor": round(costs["backward_factor"], 3),
            "loss_factor": round(costs["loss_factor"], 3),
            "nodes": [{"name": f"h{i}", "compute_ms": round(costs["forward_ms"][1], 2), "memory": config.memory,
                       "uplink_mbps": rate_mbps} for i in range(nodes)],
            "default_link": {"latency_ms": latency_ms, "bandwidth_mbps": rate_mbps}}
    allocation = pinned(shaped_network(parse_network(data, "timing network"), recipe), recipe.recipe.train.seed,
                        recipe.pipeline.effort)
    for node, entry in zip(allocation.nodes, data["nodes"]):
        entry["stage"] = node.stage
        entry["compute_ms"] = round(costs["forward_ms"][0 if node.stage == 0 else 1], 2)
    return data


def timing_bench(out: str | Path = "runs/bench-skippipe-timing", recipe: str | Path = SHIPPED_RECIPE,
                 bandwidth: str = "20mbit", latency_ms: float = 20.0, nodes: int = 8, stages: int = 4,
                 skips: tuple[float, ...] = (0.0, 0.25), microbatches: int = 8, iterations: int = 6, warmup: int = 2,
                 data=None) -> list[dict]:
    """Measured against simulated iteration time on netlab hosts (module docstring); prints the table."""
    from decentral.metrics import format_table, results_folder
    from decentral.netlab import parse_rate
    from decentral.pipeline.launch import train_run

    out = Path(out)
    for skip in skips:  # every variant plannable before the first runs
        path_length(stages, skip)
    base = yaml.safe_load(Path(recipe).read_text())
    rate_mbps = parse_rate(bandwidth) / 1e6
    with results_folder(out, "bench pipeline timing"):
        rows = []
        for skip in skips:
            folder = out / f"skip{skip:g}"
            folder.mkdir(parents=True, exist_ok=True)
            variant = {**base, "pipeline": {**base.get("pipeline", {}), "stages": stages, "skip": skip,
                                            "microbatches": microbatches, "network": "", "calibrate_at": warmup},
                       "model": {**base.get("model", {}), "n_layer": stages}, "protocol": {"name": "local"}}
            (folder / "recipe.yaml").write_text(yaml.safe_dump(variant, sort_keys=False))
            shaped = load_pipeline_recipe(folder / "recipe.yaml")
            costs = calibrate(shaped)
            network = timing_network(shaped, costs, nodes, rate_mbps, latency_ms)
            (folder / "network.in.json").write_text(json.dumps(network, indent=1) + "\n")
            result = train_run(folder / "recipe.yaml", folder, network_path=folder / "network.in.json",
                               netlab=bandwidth,
                               latency_ms=latency_ms, steps=iterations + warmup, data=data, evaluate=False)
            records = [r for r in result["metrics"] if "makespan_ms" in r][warmup:]
            uncalibrated = _file_predictions(folder / result["lead"] / "events.jsonl", folder / "network.json")
            ratios = [r["makespan_ms"] / r["predicted_ms"] for r in records]
            file_ratios = [r["makespan_ms"] / uncalibrated[r["iteration"]] for r in records]
            rows.append({"skip": skip, "simulated_s": statistics.median(r["predicted_ms"] for r in records) / 1e3,
                         "measured_s": statistics.median(r["makespan_ms"] for r in records) / 1e3,
                         "ratio": statistics.median(ratios), "ratios": ratios,
                         "file_s": statistics.median(uncalibrated[r["iteration"]] for r in records) / 1e3,
                         "file_ratio": statistics.median(file_ratios), "file_ratios": file_ratios,
                         "wall_s": statistics.median(r["wall_ms"] for r in records) / 1e3, "costs": costs,
                         "iterations": len(records)})
        table = [("skip", "measured (median)", "simulated (calibrated plan)", "measured / simulated",
                  "simulated, the file's compute", "measured / that", "wall per iteration")]
        for row in rows:
            table.append((f"{row['skip']:g}", f"{row['measured_s']:.2f} s", f"{row['simulated_s']:.2f} s",
                          f"{row['ratio']:.3f} ({' '.join(f'{r:.2f}' for r in row['ratios'])})",
                          f"{row['file_s']:.2f} s",
                          f"{row['file_ratio']:.3f} ({' '.join(f'{r:.2f}' for r in row['file_ratios'])})",
                          f"{row['wall_s']:.2f} s"))
        print(f"{nodes} netlab hosts, uplinks {bandwidth}, latency {latency_ms:g} ms, {stages} stages, "
              f"{microbatches} microbatches of {shaped.activation_bytes() / 2**10:.0f} KiB activations; "
              f"re-planned after {warmup} warm-up iterations with the compute the nodes measured")
        print(format_table(table))
        worst = max(abs(row["ratio"] - 1) for row in rows)
        print(f"target: within {TIMING_TARGET:.0%} of the plan's prediction: worst {worst:.1%}, "
              f"{'met' if worst <= TIMING_TARGET else 'MISSED'}")
        _write(out, {"settings": {"recipe": str(recipe), "bandwidth": bandwidth, "latency_ms": latency_ms,
                                  "nodes": nodes,
                                  "stages": stages, "microbatches": microbatches, "iterations": iterations,
                                  "warmup": warmup, **_machine()}, "rows": rows, "target": TIMING_TARGET})
        print(f"wrote {out / 'results.json'}")
        return rows


def _file_predictions(events_path: Path, network_path: Path) -> dict[int, float]:
    """Per iteration, the simulated makespan of its routes (the lead's event log) on the network file's
    compute, as an uncalibrated plan would predict it."""
    from decentral.pipeline.network import load_network
    from decentral.pipeline.planner import simulated_ms

    network = load_network(network_path)
    events = [json.loads(line) for line in events_path.read_text().splitlines()]
    return {e["iteration"]: simulated_ms(network, [[network.index(n) for n in route] for route in e["routes"]])
            for e in events if e["event"] == "begin"}


def _machine() -> dict:
    return {"machine": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}


def _write(out: Path, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(record, indent=1) + "\n")


def _plot_convergence(rows: list[dict], drop: float, out_png: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="constrained")
    curves, bars = fig.subplots(1, 2, width_ratios=(2, 1))
    for row in rows:
        losses = torch.tensor(row["losses"])
        window = min(20, len(losses))
        smooth = losses.unfold(0, window, 1).mean(1) if window > 1 else losses
        curves.plot(range(window, len(losses) + 1), smooth, label=f"skip {row['skip']:g}")
    curves.set_xlabel("iteration")
    curves.set_ylabel("training loss (moving mean of 20)")
    curves.legend()
    curves.grid(alpha=0.3)
    width = 0.35
    for k, (key, label) in enumerate((("full_ppl", "whole model"), ("dropped_ppl", f"{drop:.0%} of stages dropped"))):
        bars.bar([i + (k - 0.5) * width for i in range(len(rows))], [row[key] for row in rows], width, label=label)
    bars.set_xticks(range(len(rows)), [f"trained with skip {row['skip']:g}" for row in rows], fontsize=8)
    bars.set_ylabel("validation perplexity")
    bars.legend(fontsize="small")
    bars.grid(axis="y", alpha=0.3)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
