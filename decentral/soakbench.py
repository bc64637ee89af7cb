"""`decentral bench soak`: a swarm under churn against the same swarm without it.

Two runs on the same netlab hosts (one `decentral train` process per host, a swarm key, the same
recipe, seed and `--steps`):
- steady: every worker trains from start to end;
- churn: every `--kill-every` seconds one worker is SIGKILLed (chosen at random, seeded, among all but
  the first `--keep`, which are never killed) and restarted at once on its host with the same output
  folder (so the same peer id), joining through w0 as a stranger would: it downloads the swarm's state
  and continues its step (the records of the life the kill ended are kept as wN/lifeK.metrics.jsonl).
  Killing stops after `--minutes`, or once a worker has finished or w0 is in the swarm's last round (a
  restart takes about a round to come up, and would find the swarm ended: it then stops with exit code 2,
  as a newcomer of an ended swarm does); the run ends when every worker has reached `--steps` (the
  swarm's total).

What it reports (issue #10's targets):
- waiting: each never-killed worker's `wait_s` over its training wall time;
- stalls: syncs of a never-killed worker that waited longer than one round (the median time of a
  round of inner steps, sync included, of that worker in the steady run);
- rejoin: for each restart, seconds from the restart until the worker logs a trained step again,
  against one round;
- replicas (DiLoCo, DDP): for every round that two or more workers recorded, whether their state
  digests agree; and the repairs made;
- loss: the mean final validation loss over workers, churn ÷ steady; and how many workers end on one
  model (the same final validation loss: replicas that end identical score alike).
Writes OUT/results.json and OUT/soak.png and prints the tables.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from decentral.cli import stop_processes
from decentral.config import Recipe, load_recipe, protocol_params, recipe_path
from decentral.members import joining, train_command, wait_for_addresses
from decentral.metrics import cell, format_table, read_metrics, results_folder
from decentral.netlab import (BANDWIDTHS_HELP, LabSettingsError, NetLab, add_mode_argument, bandwidths_argument,
                              describe_rates, mode_note, parse_rates)
from decentral.swarm.admission import SwarmKey

POLL_S = 0.5  # how often the harness looks at its workers


class SoakFailed(RuntimeError):
    """A run of the soak could not go on: its first worker never came up, or it outran --timeout."""


@dataclass
class Restart:
    worker: int
    killed_at: float  # seconds since the run started
    restarted_at: float
    steps_before: int  # trained-step records it had logged before the kill
    trained_at: float | None = None  # when the restarted worker logged its first trained step again
    killed_again: bool = False  # it was killed again before it trained: no rejoin time

    @property
    def rejoin_s(self) -> float | None:
        return None if self.trained_at is None else self.trained_at - self.restarted_at


@dataclass
class Run:
    """What one run did: its workers' records (in file order) and its restarts."""

    name: str
    wall_s: float
    codes: dict[int, int]
    records: dict[int, list[dict]]
    restarts: list[Restart] = field(default_factory=list)


class Swarm:
    """The workers of one run on the lab's hosts."""

    def __init__(self, lab: NetLab, recipe_file: Path, out: Path, steps: int, last_round_steps: int):
        self.lab, self.recipe_file, self.out, self.steps = lab, recipe_file, out, steps
        self.last_round_steps = last_round_steps
        self.procs: dict[int, subprocess.Popen] = {}
        self.bootstrap: list[str] = []
        self._logs: list = []

    def start(self, index: int, initial: bool) -> None:
        host = self.lab.hosts[index]
        if not initial:  # a restart is a fresh peer that catches up from the swarm, not a --resume of its checkpoint
            folder = self.out / f"w{index}"
            shutil.rmtree(folder / "checkpoint", ignore_errors=True)
            if (folder / "metrics.jsonl").exists():  # kept: a run without a checkpoint replaces its records
                (folder / "metrics.jsonl").rename(folder / f"life{len(life_files(folder))}.metrics.jsonl")
        cmd = train_command(self.recipe_file, self.out, index, len(self.lab.hosts), verbose=True)
        cmd += ["--steps", str(self.steps), "--host", host.address]
        cmd += joining(index, min_peers=len(self.lab.hosts) if initial else 1,
                       addresses_file=self.out / "bootstrap.maddrs", join=self.bootstrap)
        log = open(self.out / f"w{index}.log", "a")
        self._logs.append(log)
        self.procs[index] = host.popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def wait_for_bootstrap(self, timeout: float) -> None:
        try:
            self.bootstrap = wait_for_addresses(self.out / "bootstrap.maddrs", [self.procs[0]], timeout)
        except RuntimeError as e:
            raise SoakFailed(f"{e}; see {self.out / 'w0.log'}") from None

    def trained_steps(self, index: int) -> int:
        """How many trained-step records worker `index` has logged so far in its life now."""
        path = self.out / f"w{index}" / "metrics.jsonl"
        return path.read_text().count('"loss"') if path.exists() else 0

    def ending(self) -> bool:
        """Nobody left to rejoin through once a restart is up: a worker has ended, or w0 (restarts join through
        it) is in the swarm's last round."""
        return (any(p.poll() is not None for p in self.procs.values())
                or self.trained_steps(0) >= self.steps - self.last_round_steps)

    def close(self) -> None:
        stop_processes(self.procs.values(), signal.SIGKILL)
        for log in self._logs:
            log.close()


def round_steps(recipe: Recipe) -> int:
    """Inner steps per round of `recipe`'s protocol (DDP: per membership epoch, when it reads the members again)."""
    membership = {**protocol_params(recipe.protocol), **recipe.protocol_args}.get("membership_every")
    return recipe.round_length() or membership or 0


def run_swarm(lab: NetLab, recipe: Recipe, out: Path, *, steps: int, timeout: float, kill_every: float | None = None,
              minutes: float = 0.0, keep: int = 2, seed: int = 0) -> Run:
    """Train one swarm to `steps`; with `kill_every`, kill and restart a worker that often for `minutes`.
    SoakFailed (its workers killed) when w0 never comes up or the run outlasts `timeout` seconds."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    recipe_file = out / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    swarm = Swarm(lab, recipe_file, out, steps, round_steps(recipe))
    rng = random.Random(seed)
    restarts: list[Restart] = []
    started = time.monotonic()
    try:
        swarm.start(0, initial=True)
        swarm.wait_for_bootstrap(180)
        for index in range(1, len(lab.hosts)):
            swarm.start(index, initial=True)
        next_kill = started + kill_every if kill_every else float("inf")
        churn_ends = started + 60 * minutes
        killable = list(range(keep, len(lab.hosts)))
        while any(p.poll() is None for i, p in swarm.procs.items() if i < keep):
            now = time.monotonic()
            if now - started > timeout:
                raise SoakFailed(f"still running after {timeout:g} s (--timeout), killed")
            for r in restarts:
                if r.trained_at is None and not r.killed_again and swarm.trained_steps(r.worker) > 0:
                    r.trained_at = now - started
            if now >= next_kill and now < churn_ends and not swarm.ending():
                running = [i for i in killable if swarm.procs[i].poll() is None]
                if running:
                    victim = rng.choice(running)
                    for r in restarts:
                        r.killed_again |= r.worker == victim and r.trained_at is None
                    swarm.procs[victim].kill()
                    swarm.procs[victim].wait()
                    killed_at = time.monotonic() - started
                    steps_before = swarm.trained_steps(victim)
                    swarm.start(victim, initial=False)
                    restarts.append(Restart(victim, killed_at, time.monotonic() - started, steps_before))
                    print(f"soak: killed and restarted w{victim} at {killed_at:.0f}s", flush=True)
                next_kill += kill_every
            time.sleep(POLL_S)  # a harness watching processes and files, not a test's synchronisation
        deadline = time.monotonic() + 300
        try:
            codes = {i: p.wait(timeout=max(1.0, deadline - time.monotonic())) for i, p in swarm.procs.items()}
        except subprocess.TimeoutExpired:
            raise SoakFailed(f"the never-killed workers ended, others were still running 300 s later; see "
                             f"{out}/w*.log") from None
    finally:
        swarm.close()
    wall = time.monotonic() - started
    records = {index: read_metrics(life_files(out / f"w{index}")) for index in range(len(lab.hosts))}
    return Run(out.name, wall, codes, records, restarts)


def life_files(folder: Path) -> list[Path]:
    """A worker's metrics files, one per life, in order: lifeN.metrics.jsonl of the lives a kill ended (moved
    there at each restart), then metrics.jsonl."""
    lives = sorted(folder.glob("life*.metrics.jsonl"), key=lambda p: int(p.name[4:].split(".")[0]))
    return lives + [p for p in [folder / "metrics.jsonl"] if p.exists()]


def round_seconds(records: list[dict]) -> float | None:
    """Median wall time between consecutive syncs of one life of a worker (inner steps and sync)."""
    syncs = [r["wall_s"] for r in records if "group_size" in r]
    gaps = [b - a for a, b in zip(syncs, syncs[1:]) if b > a]
    return statistics.median(gaps) if gaps else None


def sync_waits(records: list[dict]) -> list[float]:
    """Seconds each sync of a worker waited (cumulative wait_s between consecutive records, one life)."""
    waits, before = [], 0.0
    for r in records:
        if "loss" not in r:
            before = r.get("wait_s", 0.0)  # a life's first record: its joining wait, counted separately
            continue
        if "group_size" in r:
            waits.append(r["wait_s"] - before)
        before = r["wait_s"]
    return waits


def final_loss(records: list[dict]) -> float | None:
    finals = [r["val_loss"] for r in records if r.get("final")]
    return finals[-1] if finals else None


def digest_agreement(run: Run) -> tuple[int, int, int]:
    """(rounds where every worker that recorded a digest agrees, rounds with 2+ digests, repairs)."""
    by_round: dict[int, set[str]] = {}
    counts: dict[int, int] = {}
    for records in run.records.values():
        for r in records:
            if "digest" in r:
                by_round.setdefault(r["round"], set()).add(r["digest"])
                counts[r["round"]] = counts.get(r["round"], 0) + 1
    compared = [r for r in by_round if counts[r] >= 2]
    repairs = sum(1 for records in run.records.values() for r in records if r.get("repaired"))
    return sum(len(by_round[r]) == 1 for r in compared), len(compared), repairs


def summarize(steady: Run, churn: Run, keep: int) -> dict:
    """The numbers of the module docstring, per never-killed worker and for the whole run."""
    kept = {}
    for i in range(keep):
        one_round = round_seconds(steady.records[i])
        records = churn.records[i]
        last = records[-1] if records else {}
        waits = sync_waits(records)
        kept[f"w{i}"] = {
            "wall_s": last.get("wall_s"), "wait_s": last.get("wait_s"),
            "wait_fraction": last["wait_s"] / last["wall_s"] if last.get("wall_s") else None,
            "round_s": one_round, "longest_sync_wait_s": max(waits, default=None),
            "stalls": sum(w > one_round for w in waits) if one_round else None,
            "steady_wait_fraction": steady.records[i][-1]["wait_s"] / steady.records[i][-1]["wall_s"]
            if steady.records[i] and steady.records[i][-1].get("wall_s") else None,
        }
    one_round = statistics.median([k["round_s"] for k in kept.values() if k["round_s"]] or [float("nan")])
    agree, compared, repairs = digest_agreement(churn)
    steady_agree, steady_compared, _ = digest_agreement(steady)
    finals = {name: [v for v in map(final_loss, run.records.values()) if v is not None]
              for name, run in (("steady", steady), ("churn", churn))}
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    loss = {name: mean(values) for name, values in finals.items()}
    return {
        "kept": kept,
        "round_s": one_round,
        "restarts": [{**asdict(r), "rejoin_s": r.rejoin_s} for r in churn.restarts],
        "rejoined_within_a_round": sum(1 for r in churn.restarts if r.rejoin_s is not None and r.rejoin_s <= one_round),
        "digests": {"churn": {"agree": agree, "rounds": compared, "repairs": repairs},
                    "steady": {"agree": steady_agree, "rounds": steady_compared}},
        "final_val_loss": loss,
        "loss_ratio": loss["churn"] / loss["steady"] if loss["churn"] and loss["steady"] else None,
        "final_models": {name: {"agree": max(Counter(values).values(), default=0), "workers": len(values)}
                         for name, values in finals.items()},  # workers on the final loss most of them end on
        "wall_s": {"steady": steady.wall_s, "churn": churn.wall_s},
        "exit_codes": {"steady": steady.codes, "churn": churn.codes},
    }


def format_summary(summary: dict) -> str:
    rows = [("never killed", "wall_s", "wait_s", "waiting", "steady waiting", "longest sync wait", "one round", "stalls")]
    for name, k in summary["kept"].items():
        rows.append((name, cell(k["wall_s"], ".0f"), cell(k["wait_s"], ".1f"), cell(k["wait_fraction"], ".1%"),
                     cell(k["steady_wait_fraction"], ".1%"), cell(k["longest_sync_wait_s"], ".1f") + " s",
                     cell(k["round_s"], ".1f") + " s", cell(k["stalls"], "d")))
    lines = [format_table(rows, numeric=False), ""]
    rejoins = [r["rejoin_s"] for r in summary["restarts"] if not r["killed_again"]]
    known = [r for r in rejoins if r is not None]
    lines.append(f"restarts: {len(summary['restarts'])} ({len(summary['restarts']) - len(rejoins)} killed again before "
                 f"they trained); trained again within one round ({summary['round_s']:.1f} s): "
                 f"{summary['rejoined_within_a_round']} of {len(rejoins)}; rejoin time median "
                 f"{cell(statistics.median(known) if known else None, '.1f')} s, "
                 f"max {cell(max(known, default=None), '.1f')} s")
    d = summary["digests"]
    lines.append(f"replica digests agree in {d['churn']['agree']} of {d['churn']['rounds']} rounds under churn "
                 f"({d['churn']['repairs']} repairs), {d['steady']['agree']} of {d['steady']['rounds']} steady")
    loss = summary["final_val_loss"]
    lines.append(f"final validation loss: steady {cell(loss['steady'], '.4f')}, churn {cell(loss['churn'], '.4f')} "
                 f"(ratio {cell(summary['loss_ratio'], '.4f')})")
    ends = summary["final_models"]
    lines.append(f"workers ending on one model (equal final loss): {ends['churn']['agree']} of {ends['churn']['workers']} "
                 f"under churn, {ends['steady']['agree']} of {ends['steady']['workers']} steady")
    return "\n".join(lines)


def plot_soak(steady: Run, churn: Run, keep: int, out_png: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), dpi=110)
    loss_ax, wait_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for run, style in ((steady, "--"), (churn, "-")):
        for i, records in run.records.items():
            vals = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None and r["step"] > 0]
            loss_ax.plot([s for s, _ in vals], [v for _, v in vals], style, color=f"C{i}", alpha=0.7,
                         label=f"{run.name} w{i}" if i < keep or run is churn else None)
    loss_ax.set(xlabel="inner step", ylabel="validation loss", title="validation loss (dashed: steady)")
    loss_ax.legend(fontsize=7)
    for i in range(keep):
        for run, style in ((steady, "--"), (churn, "-")):
            pts = [(r["wall_s"], r["wait_s"]) for r in run.records[i] if "wait_s" in r]
            wait_ax.plot([t for t, _ in pts], [w for _, w in pts], style, color=f"C{i}", label=f"{run.name} w{i}")
    for r in churn.restarts:
        wait_ax.axvline(r.killed_at, color="grey", alpha=0.3, lw=0.8)
    wait_ax.set(xlabel="wall time (s)", ylabel="cumulative wait (s)", title="never-killed workers' waiting (grey: kills)")
    wait_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png)
    return out_png


def run_soak(args: argparse.Namespace) -> int:
    if not 1 <= args.keep < args.hosts:
        print(f"bench soak: --keep {args.keep} with --hosts {args.hosts}: at least one worker is kept and one killed, "
              "so --hosts must be at least 2 and --keep in 1..HOSTS-1"
              + (f" (e.g. --keep {args.hosts - 1})" if args.hosts >= 2 else ""), file=sys.stderr)
        return 2
    try:
        parse_rates(args.bandwidth, args.hosts)
    except LabSettingsError as e:
        print(f"bench soak: {e}", file=sys.stderr)
        return 2
    recipe = load_recipe(recipe_path(args.protocol))
    if recipe.protocol == "local":
        print(f"bench soak: --protocol {args.protocol} trains without a swarm: there is nothing to join again after a "
              "kill; give a protocol of the swarm (diloco, noloco, co2, streaming, ddp)", file=sys.stderr)
        return 2
    recipe.train.steps = args.steps
    out = Path(args.out)
    with results_folder(out, "bench soak"):  # (before the key is written: a soak running there uses it)
        return _soak(args, recipe, out)


def _soak(args: argparse.Namespace, recipe: Recipe, out: Path) -> int:
    key_file = out / "swarm.key"
    key_file.unlink(missing_ok=True)
    SwarmKey.generate(key_file)
    recipe.swarm.key_file = str(key_file.resolve())
    config = {"hosts": args.hosts, "bandwidth": args.bandwidth, "protocol": recipe.protocol, "steps": args.steps,
              "kill_every_s": args.kill_every, "minutes": args.minutes, "keep": args.keep, "seed": args.seed,
              "date": dt.date.today().isoformat(),
              "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores"}
    runs = {}
    with NetLab(args.hosts, args.bandwidth, mode=args.mode, name="soak") as lab:
        config["mode"] = lab.mode
        for name, churn in (("steady", False), ("churn", True)):
            recipe.swarm.run = f"soak-{name}-{uuid.uuid4().hex[:6]}"
            print(f"soak: {name} run of {args.hosts} workers, {args.steps} steps ...", flush=True)
            kept = "".join(f"; the {done} run's records are in {out / done} (`decentral report {out / done}` tables "
                           "them)" for done in runs)
            try:
                runs[name] = run_swarm(lab, recipe, out / name, steps=args.steps, timeout=args.timeout,
                                       kill_every=args.kill_every if churn else None, minutes=args.minutes,
                                       keep=args.keep, seed=args.seed)
            except SoakFailed as e:
                print(f"bench soak: the {name} run failed: {e}{kept}", file=sys.stderr)
                return 1
            except KeyboardInterrupt:
                print(f"bench soak: interrupted in the {name} run{kept}", file=sys.stderr, flush=True)
                return 130
            print(f"soak: {name} run done in {runs[name].wall_s:.0f}s, exit codes {runs[name].codes}", flush=True)
    summary = summarize(runs["steady"], runs["churn"], args.keep)
    (out / "results.json").write_text(json.dumps({"config": config, **summary}, indent=1))
    plot_soak(runs["steady"], runs["churn"], args.keep, out / "soak.png")
    print(format_summary(summary))
    print(f"soak: {args.hosts} hosts, {describe_rates(parse_rates(args.bandwidth, args.hosts))} links, "
          f"{mode_note(config['mode'])}; results in {out / 'results.json'}, plot {out / 'soak.png'}")
    failed = failures(runs.values(), out)
    if not runs["churn"].restarts:  # (then the soak compared two steady runs)
        failed.append(f"bench soak: nobody was killed: the churn run ended before its first kill (--kill-every "
                      f"{args.kill_every:g} s); give more --steps or a shorter --kill-every")
    for line in failed:
        print(line, file=sys.stderr)
    return 1 if failed else 0


def failures(runs, out: Path) -> list[str]:
    """A line for each worker of `runs` that exited with another code than 0: which, its code and its log's last
    line (a restart that found the swarm ended exits 2: the module docstring)."""
    said = []
    for run in runs:
        for index, code in run.codes.items():
            if code != 0:
                log = out / run.name / f"w{index}.log"
                lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] \
                    if log.exists() else []
                said.append(f"soak: the {run.name} run's w{index} exited with {code}"
                            + (f": {lines[-1]}" if lines else "") + f" (see {log})")
    return said


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from decentral.cli import number_type, positive_int

    parser.add_argument("--hosts", type=int, default=6, help="one worker each (default: %(default)s)")
    parser.add_argument("--bandwidth", type=bandwidths_argument, default="20mbit", help=BANDWIDTHS_HELP)
    parser.add_argument("--protocol", default="diloco", help="a recipe file or name (default: diloco)")
    parser.add_argument("--steps", type=positive_int, default=3000,
                        help="the swarm's inner steps (default: ~20 min on 2 cores)")
    parser.add_argument("--kill-every", type=number_type(float, 0, strict=True), default=60.0,
                        help="seconds between kills (default: %(default)s)")
    parser.add_argument("--minutes", type=number_type(float, 0, strict=True), default=20.0,
                        help="how long the kills go on (default: %(default)s)")
    parser.add_argument("--keep", type=int, default=2, help="w0..w(keep-1) are never killed (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="which workers get killed (default: %(default)s)")
    parser.add_argument("--timeout", type=number_type(float, 0, strict=True), default=3600.0,
                        help="seconds before a run is given up (default: %(default)s)")
    add_mode_argument(parser)
    parser.add_argument("--out", default="runs/soak", help="(default: %(default)s)")
    parser.set_defaults(func=run_soak)
