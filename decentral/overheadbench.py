"""`decentral bench overhead`: what the library adds to each inner step of a plain torch loop.

Trains the reference GPT (the recipes' model and train settings) on CPU in one process, as:
- plain: forward, backward, clip, AdamW step, zero_grad (and the recipe's LR schedule), nothing else;
- one loop per protocol (`--protocols`): the same loop with the protocol hooked into the optimizer over
  a `SoloTransport` (no network, no threads), plus the worker's own per-step bookkeeping
  (`decentral.worker.step_record`, the swarm monitor's `StatusCard.update`, then `MetricsLog.write` of
  the record to OUT/<protocol>/metrics.jsonl).
Each loop has its own model (same seed) and optimizer; batches are built before timing and the same
for all, so data loading is not measured; validation and checkpoints (every `eval_every` steps in the
worker) are not part of a step and not measured. DDP is left out: it averages every step, so it has
no inner step without sync work.

The loops take turns of `--turn` steps each, their order rotating, so the machine's noise hits all
alike (by default they alternate every step). A step is an *outer* step when the protocol did sync
work in it (waited on the transport or closed a round: `wait_s` or `round` moved); the others are inner
steps. Overhead per block of `--block` steps (default the largest `every`: one outer step per block),
against the plain loop's steps of the same block, which ran interleaved with them:
- inner steps only: median step time ÷ the plain loop's median − 1 (the hooks and metrics);
- all steps: total time ÷ the plain loop's total − 1 (plus the outer step's local arithmetic: with a
  SoloTransport nothing is sent, so that is the copies, the outer optimizer and the state digest);
- direct: the library's own phases, timed inside each step (the protocol's optimizer hooks, less what
  the hook calls cost the plain loop; building the record; the card; writing) ÷ the plain loop's median step,
  over inner steps (medians) and over all steps (means; "outer step": the median of the phases on an
  outer step). Wall-time ratios on a busy machine carry its noise; these do not, but they miss
  indirect costs (caches), which the ratios would show.
Reported: the medians of the per-block ratios and their interquartile ranges, and the
per-step profile. Writes OUT/results.json and OUT/overhead.png and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from decentral.config import Recipe, RecipeError, load_recipe, protocol_params, recipe_path
from decentral.data.batches import train_batches
from decentral.data.corpus import load_corpus
from decentral.metrics import MetricsLog, format_table, results_folder
from decentral.models import GPT
from decentral.swarm.monitor import StatusCard
from decentral.sync import PROTOCOLS, SyncProtocol
from decentral.transport import SoloTransport
from decentral.worker import inner_lr, step_record

TARGET = 0.02  # issue #14: the library's per-inner-step overhead at most 2% of a plain loop's step
# the phases of one step, in order; the hooks' include torch's own step wrapper, which the plain loop has too
PHASES = ("compute", "pre_hooks", "adamw", "post_hooks", "zero_grad", "record", "card", "write")
DEFAULT_BLOCK = 50  # steps per overhead ratio when no protocol has an `every`


@dataclass
class Loop:
    """One training loop under test: its model, optimizer, protocol (None: the plain loop), and per step
    the seconds of each of PHASES and whether it did sync work."""

    name: str
    recipe: Recipe
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    protocol: SyncProtocol | None = None
    log: MetricsLog | None = None
    card: StatusCard | None = None
    done: int = 0
    phases: list[list[float]] = field(default_factory=list)
    synced: list[bool] = field(default_factory=list)
    _marks: list[float] = field(default_factory=lambda: [0.0, 0.0])  # after the pre hooks, after AdamW's math

    def hook(self, stack: contextlib.ExitStack) -> None:
        """Hook the protocol (in `stack`) between two timing hooks of our own: torch runs step hooks in the
        order they were registered, so ours mark the end of the protocol's pre hook and the start of its post hook."""
        self.optimizer.register_step_post_hook(lambda *_: self._mark(1))
        if self.protocol is not None:
            stack.enter_context(self.protocol)
            stack.callback(self.log.close)
        self.optimizer.register_step_pre_hook(lambda *_: self._mark(0))

    def _mark(self, which: int) -> None:
        self._marks[which] = time.perf_counter()

    def step(self, x: torch.Tensor, y: torch.Tensor, start: float) -> None:
        """One inner step as the worker does it; `start`: when training began (the record's wall_s)."""
        protocol = self.protocol
        before = (protocol.wait_s, protocol.round) if protocol is not None else None
        t0 = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = inner_lr(self.done, self.recipe)
        self.model.train()
        _, loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.train.grad_clip)
        t1 = time.perf_counter()
        self.optimizer.step()  # the protocol's hooks run here
        t2 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = t4 = t5 = t6 = time.perf_counter()
        if protocol is not None:
            record, _ = step_record(self.name, protocol, protocol.transport, loss, t3 - start, {})
            t4 = time.perf_counter()
            self.card.update(record["loss"], record["wall_s"])
            t5 = time.perf_counter()
            self.log.write(**record)
            t6 = time.perf_counter()
        pre, post = self._marks
        self.phases.append([t1 - t0, pre - t1, post - pre, t2 - post, t3 - t2, t4 - t3, t5 - t4, t6 - t5])
        self.synced.append(before is not None and before != (protocol.wait_s, protocol.round))
        self.done += 1


def make_loop(name: str, recipe: Recipe, out: Path | None) -> Loop:
    """A fresh model and AdamW as the worker builds them; with `recipe`'s protocol over a SoloTransport,
    logging to OUT/NAME/metrics.jsonl, unless `out` is None (the plain loop)."""
    t = recipe.train
    torch.manual_seed(t.seed)
    model = GPT(recipe.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    if out is None:
        return Loop(name, recipe, model, optimizer)
    transport = SoloTransport()
    protocol = PROTOCOLS[recipe.protocol](model, optimizer, transport, **recipe.protocol_args)
    metrics = out / name / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    return Loop(name, recipe, model, optimizer, protocol, MetricsLog(metrics),
                StatusCard(transport, name, t.batch_size * t.context))


def load_recipes(protocols: list[str]) -> list[Recipe]:
    """The recipes of `--protocols` (names or files); RecipeError for none, DDP, a repeated protocol, one
    that syncs every step, or recipes whose model or train settings differ (the loops must train the same
    model alike)."""
    if not protocols:
        raise RecipeError("--protocols names no protocol")
    recipes = [load_recipe(recipe_path(p)) for p in protocols]
    names = [r.protocol for r in recipes]
    if "ddp" in names:
        raise RecipeError("ddp averages every step: it has no inner step without sync work to measure")
    if len(set(names)) < len(names):
        raise RecipeError(f"each protocol once, got {names}")
    for r, p in zip(recipes, protocols):
        if (r.model, r.train) != (recipes[0].model, recipes[0].train):
            raise RecipeError(f"{p}: its model or train settings differ from {protocols[0]}'s")
        if (sync_every(r) or 2) < 2:
            raise RecipeError(f"{p}: every 1 syncs at every step: it has no inner step to measure")
    return recipes


def sync_every(recipe: Recipe) -> int | None:
    """The recipe's `every` (inner steps per outer step), None for a protocol without one (local)."""
    return {**protocol_params(recipe.protocol), **recipe.protocol_args}.get("every")


def measure(recipes: list[Recipe], *, steps: int, warmup: int, turn: int, out: Path, data: list[str] | None
            ) -> list[Loop]:
    """Run the plain loop and one loop per recipe for `warmup + steps` steps each, in turns of `turn`
    steps with a rotating order; the first `warmup` steps of each are dropped from what is returned."""
    t = recipes[0].train
    total = warmup + steps
    batches = train_batches(load_corpus(data).train, batch_size=t.batch_size, context=t.context, seed=t.seed)
    pool = [next(batches) for _ in range(min(total, 64))]
    loops = [make_loop("plain", recipes[0], None)] + [make_loop(r.protocol, r, out) for r in recipes]
    with contextlib.ExitStack() as stack:
        for loop in loops:
            loop.hook(stack)
        start = time.perf_counter()
        turns = range(0, total, turn)
        for k, first in enumerate(turns):
            for loop in loops[k % len(loops):] + loops[:k % len(loops)]:
                for i in range(first, min(first + turn, total)):
                    loop.step(*pool[i % len(pool)], start)
            if (k + 1) % max(1, len(turns) // 10) == 0:
                print(f"bench overhead: {min(first + turn, total)}/{total} steps of each of {len(loops)} loops "
                      f"in {time.perf_counter() - start:.0f}s", flush=True)
    for loop in loops:
        loop.phases, loop.synced = loop.phases[warmup:], loop.synced[warmup:]
    return loops


def quartiles(values: list[float]) -> dict:
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    return {"median": float(median), "q1": float(q1), "q3": float(q3)}


def summarize(loops: list[Loop], block: int) -> dict:
    """Per loop: step times, the per-block overhead ratios against the plain loop, the per-step profile
    (medians of each phase over inner steps) and the direct overheads; see the module docstring."""
    plain_phases = np.array(loops[0].phases)
    plain_times = plain_phases.sum(axis=1)
    plain_median = float(np.median(plain_times))
    hooks = [PHASES.index("pre_hooks"), PHASES.index("post_hooks")]
    plain_hooks = float(np.median(plain_phases[:, hooks].sum(axis=1)))
    summary = {}
    for loop in loops:
        phases = np.array(loop.phases)
        times = phases.sum(axis=1)
        inner = ~np.array(loop.synced)
        entry = {"steps": len(times), "outer_steps": int((~inner).sum()),
                 "median_step_s": float(np.median(times)), "median_inner_step_s": float(np.median(times[inner])),
                 "mean_step_s": float(times.mean()),
                 "profile_inner_s": {p: float(np.median(phases[inner, i])) for i, p in enumerate(PHASES)}}
        if loop.protocol is not None:
            blocks = [slice(a, a + block) for a in range(0, len(times) - block + 1, block)]
            per_block_inner = [float(np.median(times[s][inner[s]]) / np.median(plain_times[s]) - 1) for s in blocks]
            per_block_all = [float(times[s].sum() / plain_times[s].sum() - 1) for s in blocks]
            ours = phases[:, hooks].sum(axis=1) - plain_hooks  # the protocol's hooks, per step
            ours += phases[:, [PHASES.index(p) for p in ("record", "card", "write")]].sum(axis=1)
            library = dict(hooks=float(np.median(phases[inner][:, hooks].sum(axis=1))) - plain_hooks,
                           **{p: entry["profile_inner_s"][p] for p in ("record", "card", "write")})
            entry.update(
                overhead_inner=quartiles(per_block_inner), overhead_all=quartiles(per_block_all),
                block_overhead_inner=per_block_inner, block_overhead_all=per_block_all,
                library_inner_s=library,
                overhead_direct_inner=sum(library.values()) / plain_median,
                overhead_direct_all=float(ours.mean()) / plain_median,
                outer_step_hooks_s=float(np.median(ours[~inner])) if (~inner).any() else None,
                protocol_step=loop.protocol.step, protocol_round=loop.protocol.round)
            entry["meets_target"] = entry["overhead_inner"]["median"] <= TARGET
        summary[loop.name] = entry
    return summary


def format_results(results: dict) -> str:
    rows = [("loop", "median step", "mean step", "inner steps [IQR]", "all steps [IQR]", "hooks", "record",
             "card", "write", "direct inner", "direct all", "outer step", f"≤ {TARGET:.0%}")]
    for name, v in results["loops"].items():
        if name == "plain":
            rows.append((name, _ms(v["median_step_s"]), _ms(v["mean_step_s"]), *["-"] * 10))
            continue
        lib = v["library_inner_s"]
        rows.append((name, _ms(v["median_inner_step_s"]), _ms(v["mean_step_s"]), _ratio(v["overhead_inner"]),
                     _ratio(v["overhead_all"]), *(f"{lib[k] * 1e6:.0f} µs" for k in ("hooks", "record", "card", "write")),
                     f"{v['overhead_direct_inner']:+.3%}", f"{v['overhead_direct_all']:+.3%}",
                     "-" if v["outer_step_hooks_s"] is None else _ms(v["outer_step_hooks_s"]),
                     "yes" if v["meets_target"] else "NO"))
    return format_table(rows)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _ratio(q: dict) -> str:
    return f"{q['median']:+.2%} [{q['q1']:+.2%}, {q['q3']:+.2%}]"


def plot_results(results: dict, out_png: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ratios, direct = fig.subplots(1, 2)
    names = [n for n in results["loops"] if n != "plain"]
    for i, name in enumerate(names):
        v = results["loops"][name]
        for offset, key, marker in ((-0.15, "block_overhead_inner", "o"), (0.15, "block_overhead_all", "x")):
            values = 100 * np.array(v[key])
            ratios.plot(np.full(len(values), i + offset), values, marker, color=f"C{i}", alpha=0.6)
            ratios.plot([i + offset - 0.1, i + offset + 0.1], [np.median(values)] * 2, color="k")
        for offset, key in ((-0.2, "overhead_direct_inner"), (0.2, "overhead_direct_all")):
            bar = direct.bar(i + offset, 100 * v[key], width=0.4, color=f"C{i}", alpha=1 if offset < 0 else 0.5)
            direct.bar_label(bar, fmt="%.2f", fontsize="small")
    ratios.set(ylabel="time over the plain loop's (%)",
               title="wall time per block: o inner steps (medians), x all steps (totals); bar: median")
    direct.set(ylabel="library time ÷ plain loop's median step (%)",
               title="timed inside the step: inner steps (solid), all steps (light)")
    for ax in (ratios, direct):
        ax.axhline(100 * TARGET, color="r", ls="--", lw=1, label=f"target {TARGET:.0%}")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(names)), names)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    cfg = results["config"]
    fig.suptitle(f"library overhead per inner step: {cfg['steps']} steps per loop in turns of {cfg['turn']}, "
                 f"{cfg['threads']} torch thread(s), {cfg['machine']}")
    fig.savefig(out_png, dpi=110)
    return out_png


def run_overhead(args: argparse.Namespace) -> int:
    try:
        recipes = load_recipes([p.strip() for p in args.protocols.split(",") if p.strip()])
    except RecipeError as e:
        print(f"bench overhead: {e}", file=sys.stderr)
        return 2
    block = args.block or max((e for e in map(sync_every, recipes) if e is not None), default=DEFAULT_BLOCK)
    if args.steps < max(block, args.turn):
        print(f"bench overhead: --steps ({args.steps}) must be at least --block ({block}) and --turn ({args.turn})",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    with results_folder(out, "bench overhead"):
        torch.set_num_threads(args.threads)
        load_before = os.getloadavg()
        started = time.monotonic()
        loops = measure(recipes, steps=args.steps, warmup=args.warmup, turn=args.turn, out=out, data=args.data)
        r0 = recipes[0]
        results = {
            "config": {"protocols": [r.protocol for r in recipes], "steps": args.steps, "warmup": args.warmup,
                       "turn": args.turn, "block": block, "threads": args.threads, "transport": "SoloTransport",
                       "model": dataclasses.asdict(r0.model), "batch_size": r0.train.batch_size,
                       "context": r0.train.context,
                       "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                       "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
                       "torch": torch.__version__, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                       "wall_s": time.monotonic() - started},
            "target": TARGET,
            "loops": summarize(loops, block),
            "step_times_s": {loop.name: np.array(loop.phases).sum(axis=1).tolist() for loop in loops},
        }
        (out / "results.json").write_text(json.dumps(results, indent=1))
        plot_results(results, out / "overhead.png")
        print(format_results(results))
        print(f"bench overhead: load average {load_before[0]:.1f} before, {results['config']['loadavg_after'][0]:.1f} "
              f"after; results in {out / 'results.json'}, plot {out / 'overhead.png'}")
        return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from decentral.cli import number_type, positive_int

    parser.add_argument("--protocols", default="diloco,noloco,co2,streaming",
                        help="comma-separated recipe names or files (not ddp); their model and train settings must agree")
    parser.add_argument("--steps", type=positive_int, default=300, help="measured inner steps per loop")
    parser.add_argument("--warmup", type=number_type(int, 0), default=10, help="steps per loop run first and not measured")
    parser.add_argument("--turn", type=positive_int, default=1, help="steps a loop runs before the next one takes its turn")
    parser.add_argument("--block", type=positive_int, help="steps per overhead ratio (default: the largest `every`)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (the worker uses 1)")
    parser.add_argument("--data", nargs="*", default=None, help="text to draw batches from (default: Python's stdlib)")
    parser.add_argument("--out", default="runs/overhead")
    parser.set_defaults(func=run_overhead)
