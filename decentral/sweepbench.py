"""`decentral bench sweep`: one protocol's settings against each other, on validation loss.

Every point of the grid (`--set KEY=V1,V2,...` once for each setting swept; the points are their product)
trains the same model on the same data shards for the same `--steps`, with `--workers` workers in one
process joined by a `LoopbackHub` (decentral.loopback: exact float32 averages, no network). Only loss
is compared: the workers share this machine's cores, so the wall time of a sweep says nothing about a
method's speed (that is `decentral bench`'s job), and loss at equal steps does not depend on timing,
so a sweep gives the same numbers on a busy machine. `--with-local` adds the same workers without any
communication, so a sweep also says whether syncing helps at all.

KEY is a protocol setting (`outer_lr`) or `train.NAME` (`train.lr`); values are YAML (`0.7`, `true`).
Writes OUT/results.json (rewritten after each point) and OUT/sweep.png (each point's validation curve,
the mean over its workers), and prints a table sorted by final loss; an OUT that holds an earlier sweep is
refused.
Ctrl-C stops the point in training at its workers' next step (exit code 130; the finished points stay in
OUT/results.json).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import math
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

from decentral.config import (RecipeError, parse_recipe, read_yaml, recipe_path, setting_value, split_setting,
                              with_settings)
from decentral.data import DataError, load_corpus
from decentral.loopback import LoopbackHub
from decentral.metrics import format_table, read_metrics, results_folder
from decentral.worker import WorkerOptions, run_worker


def parse_grid(settings: list[str]) -> dict[str, list]:
    """{KEY: [values]} from `--set KEY=V1,V2` arguments; RecipeError on a malformed one."""
    grid: dict[str, list] = {}
    for item in settings:
        key, values = split_setting(item, "KEY=VALUE[,VALUE...], e.g. outer_lr=0.7,1.0")
        if key.count(".") > 1 or (key.count(".") == 1 and not key.startswith("train.")):
            raise RecipeError(f"--set {item!r}: KEY is a protocol setting (outer_lr) or train.NAME (train.lr)")
        if key == "train.steps":
            raise RecipeError(f"--set {item!r}: a sweep's points all train --steps steps; sweep other settings")
        if key in grid:
            raise RecipeError(f"--set {item!r}: {key} is given twice; give all its values in one --set ({key}=V1,V2)")
        texts = [v.strip() for v in values.split(",")]
        if not all(texts):
            raise RecipeError(f"--set {item!r}: an empty value; give VALUE[,VALUE...] (values hold no commas)")
        grid[key] = [setting_value(text) for text in texts]
    return grid


def check_fresh_out(out: Path) -> None:
    """RecipeError when `out` holds an earlier sweep (its results.json, or a point's folder): its points'
    checkpoints would refuse this sweep's workers after its results were overwritten."""
    earlier = [p.name for p in (out / "results.json", *sorted(out.glob("point*"))) if p.exists()] if out.is_dir() else []
    if earlier:
        raise RecipeError(f"--out {out} holds an earlier sweep ({', '.join(earlier[:3])}): give another --out, "
                          "or remove it to sweep again")


def train_point(recipe: dict, steps: int, workers: int, out: Path, data: list[str] | None, label: str) -> dict:
    """Train `workers` workers of one recipe in threads of this process, joined by one LoopbackHub (none
    for `local`); their final validation losses, the curve of their mean (as the table ranks the points:
    worker 0's alone made `local`, whose workers differ, look unlike its row), the wall time, and the error
    if one raised (a diverged point is a result, not a crash)."""
    recipe = with_settings(recipe, {"train.steps": steps})
    parsed = parse_recipe(recipe, label)  # RecipeError names the point
    hub = None if parsed.protocol == "local" else LoopbackHub(timeout_s=max(60.0, parsed.swarm.timeout))
    results: dict[int, dict] = {}
    errors: dict[int, str] = {}
    stop = threading.Event()  # Ctrl-C reaches this thread alone: the workers stop at their next step
    ended = [threading.Event() for _ in range(workers)]  # (a Thread.join that Ctrl-C interrupted may return early
    # on a thread that runs on: Python 3.11's, here, once in four)

    def work(i: int) -> None:
        def show(line: str) -> None:
            if i == 0:
                print(f"sweep: {label}: {line}", flush=True)

        opts = WorkerOptions(out=out / f"w{i}", data=data, worker_index=i, num_workers=workers, name=f"w{i}",
                             min_peers=workers if hub else 1, print_fn=show,
                             transport=hub.transport() if hub else None, stop=stop)
        try:
            results[i] = run_worker(parsed, opts)
        except KeyboardInterrupt:  # stopped: the main thread raises it again
            pass
        except Exception as e:  # noqa: BLE001 (reported per point: a diverged setting is an outcome)
            errors[i] = f"{type(e).__name__}: {e}"
        finally:
            ended[i].set()

    started = time.monotonic()
    threads = [threading.Thread(target=work, args=(i,), name=f"sweep-w{i}") for i in range(workers)]
    for t in threads:
        t.start()
    try:
        for done in ended:
            done.wait()
    except KeyboardInterrupt:
        stop.set()
        for done in ended:
            done.wait()
        raise
    finally:
        for t in threads:
            t.join()  # (returning, each has ended its run)
    by_step: dict[int, list[float]] = {}  # the workers' validation losses at each evaluated step
    for i in range(workers):
        metrics = out / f"w{i}" / "metrics.jsonl"
        evaluated = {r["step"]: r["val_loss"] for r in (read_metrics(metrics) if metrics.exists() else [])
                     if r.get("val_loss") is not None}  # (the last at a step: the final record's at the end)
        for step, val in evaluated.items():
            by_step.setdefault(step, []).append(val)
    curve = [(step, statistics.mean(vals)) for step, vals in sorted(by_step.items()) if len(vals) == workers]
    finals = [r["val_loss"] for r in results.values() if r.get("val_loss") is not None]
    if not errors and not all(math.isfinite(v) for v in finals):  # diverged between the protocol's checks
        errors[0] = "diverged: a final validation loss is not finite"
    return {"final_val_loss": statistics.mean(finals) if len(finals) == workers and not errors else None,
            "worker_final_val_loss": finals, "curve": curve, "wall_s": time.monotonic() - started,
            "error": next(iter(errors.values()), None)}


def format_sweep(results: dict) -> str:
    """The points by final loss, each named by its label (its settings; `--with-local`'s row by what it is)."""
    rows = [("point", "final val", "vs best", "status")]
    done = [p for p in results["points"] if p["final_val_loss"] is not None]
    best = min((p["final_val_loss"] for p in done), default=None)
    for p in sorted(results["points"], key=lambda p: (p["final_val_loss"] is None, p["final_val_loss"] or 0)):
        final = p["final_val_loss"]
        rows.append((p["label"],
                     "-" if final is None else f"{final:.3f}",
                     "-" if final is None else f"{final / best - 1:+.1%}",
                     "ok" if p["error"] is None else p["error"][:60]))
    return format_table(rows, numeric=False)


def plot_sweep(results: dict, out_png: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=110)
    ax = fig.add_subplot()
    for p in results["points"]:
        if p["curve"]:
            ax.plot(*zip(*p["curve"][1:] or p["curve"]), marker=".", label=p["label"])
    cfg = results["config"]
    ax.set(xlabel="inner step", ylabel="validation loss (mean over workers)",
           title=f"{cfg['protocol']}: {cfg['workers']} workers, {cfg['steps']} steps (loopback, exact averages)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out_png)
    return out_png


def run_sweep(args: argparse.Namespace) -> int:
    """Every argument, every point's recipe and the --data corpus are checked before any point trains: a
    problem is one line on stderr and exit code 2."""
    path = recipe_path(args.protocol)
    if args.workers < 1 or args.steps < 1:
        print("bench sweep: --workers and --steps must be >= 1", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        check_fresh_out(out)
        base = read_yaml(path) or {}
        if not isinstance(base, dict):
            raise RecipeError(f"{path}: expected a mapping at the top level")
        grid = parse_grid(args.set)
        points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
        labelled = [(", ".join(f"{k}={v}" for k, v in s.items()) or "as the recipe", s, base) for s in points]
        if args.with_local:
            local = {"protocol": {"name": "local"}, **{k: v for k, v in base.items() if k != "protocol"}}
            labelled.append(("local (no communication)", {}, local))
        for label, settings, recipe in labelled:  # every point is a valid recipe before anything trains
            every = parse_recipe(with_settings(recipe, {**settings, "train.steps": args.steps}),
                                 f"{path} ({label})").round_length()
            if every is not None and args.steps < every:
                raise RecipeError(f"{label}: --steps {args.steps} is less than one of its rounds (every {every} "
                                  f"steps): it would average nothing; give --steps {every} or more")
        load_corpus(args.data)  # what every point's workers read
    except (RecipeError, DataError) as e:
        print(f"bench sweep: {e}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as held:
        try:  # (a second sweep given this --out stops here; its workers would find theirs held)
            held.enter_context(results_folder(out, "bench sweep", refuse=check_fresh_out))
        except RecipeError as e:  # (a sweep given this --out ended meanwhile)
            print(f"bench sweep: {e}", file=sys.stderr)
            return 2
        return _sweep(args, out, grid, labelled)


def _sweep(args: argparse.Namespace, out: Path, grid: dict[str, list], labelled: list[tuple[str, dict, dict]]) -> int:
    results = {"config": {"protocol": args.protocol, "steps": args.steps, "workers": args.workers, "grid": grid,
                          "date": dt.date.today().isoformat(), "machine": f"{platform.node()} {platform.machine()}"},
               "points": []}
    for k, (label, settings, recipe) in enumerate(labelled, 1):
        print(f"sweep: [{k}/{len(labelled)}] {label} ...", flush=True)
        try:
            point = train_point(with_settings(recipe, settings), args.steps, args.workers, out / f"point{k}",
                                args.data, label)
        except KeyboardInterrupt:
            print(f"sweep: interrupted in point {k} ({label}); not run: {len(labelled) - k + 1} of {len(labelled)} "
                  "points" + (f"; the finished ones are in {out / 'results.json'}" if k > 1 else ""),
                  file=sys.stderr, flush=True)
            return 130
        results["points"].append({"label": label, "settings": settings, **point})
        (out / "results.json").write_text(json.dumps(results, indent=1))
        final = point["final_val_loss"]
        print(f"sweep: [{k}/{len(labelled)}] {label}: " + (f"final val {final:.3f}" if final is not None else
              f"FAILED ({point['error']})") + f" in {point['wall_s']:.0f}s", flush=True)
    plot_sweep(results, out / "sweep.png")
    print(format_sweep(results))
    print(f"bench sweep: results in {out / 'results.json'}, plot {out / 'sweep.png'}")
    return 0 if all(p["error"] is None for p in results["points"]) else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--protocol", default="diloco", help="a recipe file or name (default: diloco)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2",
                        help="a setting and the values to try (repeat for a grid): outer_lr=0.7,1.0 or train.lr=1e-3")
    parser.add_argument("--steps", type=int, default=400, help="inner steps per worker (the schedule's length)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--with-local", action="store_true", help="also train the workers without communication")
    parser.add_argument("--data", action="append", metavar="PATH",
                        help="text for every point (default: Python's stdlib)")
    parser.add_argument("--out", default="runs/sweep")
    parser.set_defaults(func=run_sweep)
