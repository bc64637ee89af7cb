"""`decentral bench`: methods side by side on the same hosts, links, model, data, seed and token budget.

Each method runs as one worker process per emulated host (decentral.netlab), all at once; then the
next method runs on the same lab. First comes `local` (no communication), the compute reference:
compute utilisation = a method's inner steps per second ÷ the reference's, so CPU that background
machinery steals from training counts against the method; a second table says where each worker's
CPU went while it trained (its training thread, its other threads, its DHT node and libp2p daemon).
Bytes are what each host's interface sent (netns mode; in loopback mode, what the workers counted on
their own streams).
Writes OUT/results.json (`summarize_method`, `compare`) and OUT/bench.png, and prints the tables.
OUT/results.json is rewritten as each method finishes: `--report OUT` tables an interrupted run's
(and names the methods it did not run).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from decentral.cli import stop_processes
from decentral.config import RecipeError, default_recipe_path, load_recipe, parse_recipe
from decentral.data import load_corpus
from decentral.members import joining, train_command, wait_for_addresses
from decentral.metrics import cell, format_table, human_bytes, read_metrics, results_folder, summarize
from decentral.models import build_model
from decentral.netlab import (BANDWIDTHS_HELP, MAX_HOSTS, Host, LabSettingsError, NetLab, add_mode_argument,
                              bandwidths_argument, describe_rates, mode_note, parse_rates)
from decentral.ranks import free_port

METHODS = ("ddp", "diloco", "noloco", "co2", "streaming", "hivemind")
REFERENCE = "local"
UNPACED_IN_LOOPBACK = ("ddp", "hivemind")  # their traffic is torch.distributed's and hivemind's, not our paced streams
RUN_DEFAULTS = {"hosts": 4, "bandwidth": "20mbit", "protocols": ",".join(METHODS), "steps": 300, "mode": "auto",
                "data": None, "method_timeout": 1200.0, "out": "runs/bench",
                "recipes": str(default_recipe_path("diloco").parent)}  # what a run takes and `--report` does not
PROGRESS_S = 30.0  # how often a running method says how far its workers are
ISLAND_PORT = 29512


def split_method(method: str) -> tuple[str, str | None]:
    """`diloco+int4` → ("diloco", "int4"): a method of METHODS, and the codec that replaces its recipe's
    (an `@STEPS` suffix ignored: `method_steps`)."""
    name, _, codec = method.partition("@")[0].partition("+")
    return name, codec or None


def method_steps(method: str, steps: int) -> int:
    """`ddp@1500` → 1500: a method's own number of inner steps, else the bench's `steps`."""
    _, at, own = method.partition("@")
    if not at:
        return steps
    if not own.isdigit() or int(own) < 1:
        raise ValueError(f"{method}: the steps after @ must be a positive integer")
    return int(own)


def recipe_file(name: str, recipes: Path) -> Path:
    """RECIPES/NAME.yaml; hivemind's is hivemind.yaml where the folder has one (a DiLoCo recipe, so that
    hivemind can keep its own H beside a DiLoCo tuned otherwise), else it borrows diloco.yaml."""
    if name == "hivemind" and not (recipes / "hivemind.yaml").is_file():
        name = "diloco"
    return recipes / f"{name}.yaml"


def _recipe_for(method: str, recipes: Path, steps: int, run: str) -> dict:
    """The method's recipe with the token budget (`steps`, or its own for `method@steps`) and its codec
    (for `method+codec`)."""
    name, codec = split_method(method)
    recipe = load_recipe(recipe_file(name, recipes))
    recipe.train.steps = method_steps(method, steps)
    every = recipe.round_length()
    if every is not None and recipe.train.steps < every:
        raise RecipeError(f"{method}: {recipe.train.steps} steps are less than one of its rounds (every {every} "
                          f"steps): it would average nothing and compare as {REFERENCE} does; give --steps {every} or "
                          f"more, or {method.partition('@')[0]}@{every}")
    recipe.swarm.run = run
    if codec:
        recipe.swarm.codec = codec
    return parse_recipe(recipe.to_dict(), f"{method}'s recipe").to_dict()  # the codec checked against the protocol


def island_port(lab: NetLab, offset: int = 0) -> int:
    """Where an island's ranks meet on its first host: a fixed port in netns mode (each host has its own), a free one
    on loopback, which every lab of the machine shares (two benches at once collided on the fixed one)."""
    return ISLAND_PORT + offset if lab.mode == "netns" else free_port()


def _command(method: str, recipe: Path, out: Path, index: int, hosts: int, addr: str, addr0: str,
             bootstrap: list[str], data: list[str], port: int = ISLAND_PORT) -> list[str]:
    method = split_method(method)[0]
    module = "decentral.baselines.hivemind_optimizer" if method == "hivemind" else "decentral"
    cmd = train_command(recipe, out, index, hosts, module=module) + [a for path in data for a in ("--data", path)]
    if method == REFERENCE:
        return cmd
    if method == "ddp":
        return cmd + ["--island", f"tcp://{addr0}:{port}", "--rank", str(index), "--world-size", str(hosts)]
    return cmd + ["--host", addr, *joining(index, min_peers=hosts, addresses_file=out / "bootstrap.maddrs",
                                           join=bootstrap)]


def _tx_bytes(lab: NetLab) -> list[int | None]:
    if lab.mode != "netns":
        return [None] * len(lab.hosts)
    return [int(h.run(["cat", "/sys/class/net/eth0/statistics/tx_bytes"]).stdout) for h in lab.hosts]


@dataclass
class Launch:
    """One process of a benchmark run: `cmd` on `host`, its output in OUT/NAME.log, `env` added."""
    host: Host
    name: str
    cmd: list[str]
    env: dict[str, str] | None = None


def progress(out: Path, steps: int | None = None) -> str | None:
    """How far the workers writing metrics under OUT/*/ are: the slowest one's step (of `steps`) and the last
    validation loss any of them wrote; None before any record."""
    records = read_metrics(sorted(out.glob("*/**/metrics.jsonl")))
    last: dict[str, int] = {}
    for r in records:
        last[r["worker"]] = r["step"]
    if not last:
        return None
    vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    return (f"slowest worker at step {min(last.values())}" + (f" of {steps}" if steps else "")
            + (f", last val {vals[-1]:.3f}" if vals else ""))


def run_launches(lab: NetLab, out: Path, label: str, first: list[Launch],
                 rest: Callable[[list[str]], list[Launch]], *, timeout: float, bootstrap: Path | None = None,
                 bootstrap_timeout: float = 180.0, steps: int | None = None,
                 timeout_option: str = "--method-timeout") -> dict:
    """Start `first`; once `bootstrap` (a multiaddr file the first write) exists, `rest(its multiaddrs)`
    (at once with [] when no bootstrap is given); wait up to `timeout` for them all (the command's
    `timeout_option`, which the message names), killing them all if one hangs, and say every PROGRESS_S how
    far they are (`progress`, of `steps`). Returns the raw outcome: exit codes, the metrics records under
    OUT/*/ (ranks' included) and what each host's interface sent meanwhile (None in loopback mode)."""
    logs = {}
    before = _tx_bytes(lab)
    procs: list[subprocess.Popen] = []
    launched: list[Launch] = []

    def start(launches: list[Launch]) -> None:
        for launch in launches:
            logs[launch.name] = open(out / f"{launch.name}.log", "w")
            launched.append(launch)
            procs.append(launch.host.popen(launch.cmd, env=launch.env, stdout=logs[launch.name], stderr=subprocess.STDOUT))

    try:
        start(first)
        start(rest(wait_for_addresses(bootstrap, procs, bootstrap_timeout) if bootstrap else []))
        began = time.monotonic()
        while True:  # a progress line every PROGRESS_S until they all ended
            until = min(began + timeout, time.monotonic() + PROGRESS_S)
            try:
                codes = [p.wait(timeout=max(0.0, until - time.monotonic())) for p in procs]
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= began + timeout:
                    raise
                if (far := progress(out, steps)) is not None:
                    print(f"bench: {label}: {time.monotonic() - began:.0f}s, {far}", flush=True)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        stop_processes(procs, signal.SIGKILL)
        codes = [p.returncode for p in procs]
        why = (f"still running after {timeout:g} s ({timeout_option}), killed"
               if isinstance(e, subprocess.TimeoutExpired) else str(e))
        print(f"bench: {label} failed: {why}", file=sys.stderr)
    finally:
        for f in logs.values():
            f.close()
    for launch, code in zip(launched, codes):
        if code != 0:  # what the process said last: why the run failed, without opening its log
            tail = (out / f"{launch.name}.log").read_text(errors="replace").splitlines()[-12:]
            print(f"bench: {label} {launch.name} exited with {code}; its log ends:", *("  " + line for line in tail),
                  sep="\n", file=sys.stderr)
    after = _tx_bytes(lab)
    paths = sorted(out.glob("*/**/metrics.jsonl"))
    return {"codes": codes, "records": read_metrics(paths) if paths else [],
            "tx_bytes": [None if b is None else a - b for a, b in zip(after, before)]}


def run_method(lab: NetLab, method: str, recipe: dict, out: Path, timeout: float, data: list[str]) -> dict:
    """Run one method on every host of `lab`; returns its raw outcome (records, bytes, exit codes)."""
    out.mkdir(parents=True, exist_ok=True)
    recipe_file = out / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe, sort_keys=False))
    hosts, addr0, port = len(lab.hosts), lab.hosts[0].address, island_port(lab)

    def launch(host, bootstrap) -> Launch:
        cmd = _command(method, recipe_file, out, host.index, hosts, host.address, addr0, bootstrap, data, port)
        env = {"GLOO_SOCKET_IFNAME": "eth0"} if lab.mode == "netns" else None  # gloo: use the capped link
        return Launch(host, f"w{host.index}", cmd, env)

    needs_bootstrap = split_method(method)[0] not in (REFERENCE, "ddp")
    return run_launches(lab, out, method, [launch(lab.hosts[0], [])],
                        lambda bootstrap: [launch(host, bootstrap) for host in lab.hosts[1:]], timeout=timeout,
                        bootstrap=out / "bootstrap.maddrs" if needs_bootstrap else None, steps=recipe["train"]["steps"])


def summarize_method(raw: dict, *, tokens_per_step: int, steps: int, workers: int | None = None) -> dict:
    """One method's entry in results.json, from its workers' records: ok, exit_codes, wall_s (slowest
    worker), steps_per_s and final_val_loss (means over workers), tokens_per_s, best_val_loss,
    bytes_sent_per_worker (interface counters in netns mode) and per step, stream_bytes_sent_per_worker
    (what the workers counted on their own streams: averages and state, no DHT), peak_stream_bytes_per_s
    (the median over workers of the most each one's streams sent in a second, `peak_rate`: a donor's state
    uploads to newcomers would make the maximum its own), stream_bytes_per_round (the median over workers
    of each one's median of what its streams sent from one round boundary to the next, `round_bytes`: one
    outer step's traffic, without the state a newcomer downloaded in some round), blocked_fraction (the
    mean over workers of the share of their wall time spent waiting on the network: what overlapping the
    average removes), and the validation curves ({worker: [(wall_s, step, val_loss), ...]}). Where the CPU
    went while a worker trained (means over workers, from its first record to its last; `cpu_record`,
    `children_record`): training_thread_cpu_s, other_threads_cpu_s (its averaging loop, heartbeat, ...)
    and child_processes_cpu_s (its DHT node and libp2p daemon; hivemind's averager); peak_rss_mib, the most
    memory a worker process held (the largest over workers; None where its records do not say). averaged:
    whether any round had two or more members (a run shorter than the first average trained as local does).
    held_up_most: [worker, seconds] of the worker that held the averages up longest (`metrics.summarize`'s
    `held_up_s`: a straggler's uplink shows here), None where no average was timed.
    `compare` adds the cross-method numbers.
    `workers`: how many workers must have trained for the method to be ok (default: one per process; an
    island's process runs several)."""
    by_worker: dict[str, list[dict]] = {}
    for r in raw["records"]:
        by_worker.setdefault(r["worker"], []).append(r)
    walls, rates, finals, blocked, curves = [], [], [], [], {}
    for worker, records in by_worker.items():
        trained = [r for r in records if "loss" in r]
        if not trained:
            continue
        wall = max(r["wall_s"] for r in records)
        walls.append(wall)
        rates.append((trained[-1]["step"] - records[0]["step"]) / wall if wall > 0 else None)  # a joiner skips steps
        waits = [r["wait_s"] for r in records if r.get("wait_s") is not None]
        if wall > 0 and waits:  # what it waited before training began (joining) is not in its wall time
            blocked.append((max(waits) - min(waits)) / wall)
        vals = [(r["wall_s"], r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
        curves[worker] = vals
        finals.append(vals[-1][2])

    def spent(key: str) -> list[float]:
        """Per worker, how much of the cumulative `key` it used from its first record to its last."""
        return [c[-1][key] - c[0][key] for recs in by_worker.values() if len(c := [r for r in recs if key in r]) > 1]

    streams = [max(sent) for recs in by_worker.values()  # (hivemind's baseline counts none)
               if (sent := [r["bytes_sent"] for r in recs if r.get("bytes_sent") is not None])]
    counted = [b for b in raw["tx_bytes"] if b is not None] or streams  # loopback mode: the streams' counts
    ok = all(c == 0 for c in raw["codes"]) and len(walls) == (workers or len(raw["codes"]))
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {
        "ok": ok,
        "exit_codes": raw["codes"],
        "wall_s": max(walls) if walls else None,
        "steps_per_s": mean([r for r in rates if r]),
        "tokens_per_s": (tokens_per_step * steps * len(walls) / max(walls)) if walls else None,
        "final_val_loss": mean(finals),
        "blocked_fraction": mean(blocked),
        "best_val_loss": min((v for c in curves.values() for _, _, v in c), default=None),
        "bytes_sent_per_worker": mean(counted),
        "bytes_sent_per_worker_per_step": (mean(counted) / steps) if counted else None,
        "stream_bytes_sent_per_worker": mean(streams),
        "peak_stream_bytes_per_s": median_or_none([rate for recs in by_worker.values()
                                                   if (rate := peak_rate(recs)) is not None]),
        "stream_bytes_per_round": median_or_none([b for recs in by_worker.values() if (b := round_bytes(recs))]),
        "training_thread_cpu_s": mean(spent("thread_cpu_s")),
        "other_threads_cpu_s": mean([max(process - thread, 0.0)  # the two clocks are read a moment apart
                                     for process, thread in zip(spent("cpu_s"), spent("thread_cpu_s"))]),
        "child_processes_cpu_s": mean(spent("children_cpu_s")),
        "peak_rss_mib": max((r["peak_rss_mib"] for r in raw["records"] if "peak_rss_mib" in r), default=None),
        "averaged": any((r.get("group_size") or 0) >= 2 for r in raw["records"]),
        "held_up_most": max(([w, s["held_up_s"]] for w, s in summarize(raw["records"]).items()
                             if s["held_up_s"] is not None), key=lambda held: held[1], default=None),
        "curves": curves,
    }


def round_bytes(records: list[dict]) -> float | None:
    """The median, over a worker's rounds after its first boundary, of the bytes its streams sent from one
    boundary to the next (None with fewer than two boundaries)."""
    at_boundary = {}
    for r in records:
        if "loss" in r and r.get("bytes_sent") is not None:
            at_boundary.setdefault(r.get("round", 0), r["bytes_sent"])  # the first record of each round
    rounds = sorted(at_boundary)[1:]  # the round it started in may have begun before its first record
    deltas = [at_boundary[b] - at_boundary[a] for a, b in zip(rounds, rounds[1:]) if b == a + 1]
    return statistics.median(deltas) if deltas else None


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def peak_rate(records: list[dict], window_s: float = 1.0) -> float | None:
    """The most bytes per second a worker's streams sent over any span of its step records at least
    `window_s` long (records are the worker's own, one per step, with cumulative `bytes_sent`): what a
    link must carry for the worker's bursts, where the total over the run says nothing of bursts. None
    when the records span less than `window_s` (a run that short has no rate to tell)."""
    points = sorted((r["wall_s"], r.get("bytes_sent") or 0) for r in records)
    best, j = None, 0
    for t, sent in points:
        j = max(j, bisect.bisect_left(points, (t + window_s, -1)))
        if j == len(points):
            break
        rate = (points[j][1] - sent) / (points[j][0] - t)
        best = rate if best is None else max(best, rate)
    return best


def time_to_loss(curves: dict[str, list], target: float) -> float | None:
    """Seconds until every worker's validation loss reached `target` (None if one never did).

    Evaluations are tens of seconds apart, so a worker's crossing time is interpolated linearly
    between its last evaluation above the target and its first at or below it.
    """
    times = []
    for points in curves.values():
        crossing = points[0][0] if points and points[0][2] <= target else None
        for (t0, _, v0), (t1, _, v1) in zip(points, points[1:]):
            if crossing is None and v1 <= target < v0:
                crossing = t0 + (t1 - t0) * (v0 - target) / (v0 - v1)
        if crossing is None:
            return None
        times.append(crossing)
    return max(times) if times else None


def compare(results: dict, target_loss: float | None = None) -> None:
    """Add the cross-method numbers to `results` in place, from what each method recorded.

    compute_utilisation: steps/s ÷ the no-communication reference's. time_to_target_s: time to the
    target loss (`target_loss` when given, else DDP's final loss). ddp_time_to_final_s and speedup_vs_ddp: how long
    DDP took to reach this method's final loss, and that time ÷ this method's wall time (speed-up at
    equal quality; None when DDP never got there, when DDP's links were not capped (`paced` False: loopback
    mode), or when the method never averaged: it ran as local does).
    """
    reference = results["methods"].get(REFERENCE, {}).get("steps_per_s")
    ddp = next((res for method, res in results["methods"].items() if split_method(method)[0] == "ddp"), None)
    target = target_loss or (ddp or {}).get("final_val_loss")
    ddp = ddp if ddp is not None and ddp.get("paced", True) else None  # (its times are not those of capped links)
    results["config"]["target_loss"] = target
    for res in results["methods"].values():
        res["compute_utilisation"] = res["steps_per_s"] / reference if res["steps_per_s"] and reference else None
        res["time_to_target_s"] = time_to_loss(res["curves"], target) if target else None
        ddp_time = time_to_loss(ddp["curves"], res["final_val_loss"]) if ddp and res["final_val_loss"] else None
        res["ddp_time_to_final_s"] = ddp_time
        averaged = res.get("averaged") is not False  # (runs before the key was recorded: taken as averaged)
        res["speedup_vs_ddp"] = ddp_time / res["wall_s"] if ddp_time and res["wall_s"] and averaged else None


def plot_bench(results: dict, out_png: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=110)
    ax = fig.add_subplot()
    plot_curves(ax, results)
    fig.tight_layout()
    fig.savefig(out_png)
    return out_png


def plot_curves(ax, results: dict) -> None:
    """Every method's validation curves (one colour per method) against wall time on `ax`."""
    for m, (method, res) in enumerate(results["methods"].items()):
        color = f"C{m % 10}"
        for i, points in enumerate(res["curves"].values()):
            if points:
                ax.plot([t for t, _, _ in points], [v for _, _, v in points], color=color, alpha=0.8,
                        marker=".", label=method if i == 0 else None)
    later = [v for res in results["methods"].values() for c in res["curves"].values() for _, _, v in c[1:]]
    if len(set(later)) > 1:  # the untrained start sits far above everything else: zoom on training, start off the top
        ax.set_ylim(min(later) - 0.02 * (max(later) - min(later)), max(later) + 0.05 * (max(later) - min(later)))
    cfg = results["config"]
    ax.set(xlabel="wall time (s)", ylabel="validation loss",
           title=f"{cfg['hosts']} hosts, {_uplinks(cfg)} uplinks ({cfg['mode']}), {cfg['steps']} steps")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no curve at all where every method failed
        ax.legend()


def format_results(results: dict) -> str:
    rows = [("method", "wall_s", "steps/s", "util", "blocked", "final", "best", "t_target", "ddp_t_final", "speedup",
             "sent/worker", "sent/step", "streams/worker", "sent/round", "peak/s")]
    for method, r in results["methods"].items():
        label = (method + ("" if r["ok"] else " (FAILED)") + (" (never averaged)" if _never_averaged(method, r) else "")
                 + ("" if r.get("paced", True) else " (uncapped)"))
        # (DDP's rounds are its membership epochs: their bytes are every step's gradients, not an outer step's)
        per_round = None if split_method(method)[0] == "ddp" else r.get("stream_bytes_per_round")
        rows.append((label, cell(r["wall_s"], ".0f"), cell(r["steps_per_s"], ".2f"),
                     cell(r.get("compute_utilisation"), ".0%"), cell(r.get("blocked_fraction"), ".1%"),
                     cell(r["final_val_loss"], ".3f"), cell(r["best_val_loss"], ".3f"),
                     cell(r.get("time_to_target_s"), ".0f"), cell(r.get("ddp_time_to_final_s"), ".0f"),
                     cell(r.get("speedup_vs_ddp"), ".1f") + ("" if r.get("speedup_vs_ddp") is None else "x"),
                     human_bytes(r["bytes_sent_per_worker"]),
                     human_bytes(r["bytes_sent_per_worker_per_step"]),
                     human_bytes(r.get("stream_bytes_sent_per_worker")),
                     human_bytes(per_round),
                     human_bytes(r.get("peak_stream_bytes_per_s"))))
    return format_table(rows, numeric=False)


def _uplinks(config: dict) -> str:
    """The hosts' uplinks as a run's config says them: "20 Mbit/s", or "h0-h2 20 Mbit/s, h3 5 Mbit/s"."""
    return describe_rates(parse_rates(config.get("bandwidth"), config.get("hosts") or 1))


def _paced(method: str, mode: str, bandwidth: str | None) -> bool:
    """Whether `method`'s traffic kept to the lab's --bandwidth: in loopback mode only our own streams are paced
    (the swarm's averages and state), not DDP's torch.distributed traffic nor hivemind's."""
    return not (mode == "loopback" and bandwidth is not None and split_method(method)[0] in UNPACED_IN_LOOPBACK)


def _never_averaged(method: str, result: dict) -> bool:
    """Whether a method that averages ran without any round of two or more members: as local does."""
    return method != REFERENCE and result.get("averaged") is False


def format_cpu(results: dict) -> str:
    """Where each worker's CPU went (seconds, means over workers; `summarize_method`), and the share of it
    not spent on the training thread: on hosts whose cores the workers share, that is what utilisation loses.
    And the most memory a worker held (the largest over workers)."""
    rows = [("method", "training thread", "other threads", "child processes", "not training", "peak memory")]
    for method, r in results["methods"].items():
        parts = [r.get(k) for k in ("training_thread_cpu_s", "other_threads_cpu_s", "child_processes_cpu_s")]
        known = [p for p in parts if p is not None]
        share = sum(known[1:]) / sum(known) if parts[0] is not None and sum(known) > 0 else None
        peak = r.get("peak_rss_mib")
        rows.append((method, *("-" if p is None else f"{p:.1f}s" for p in parts),
                     "-" if share is None else f"{share:.1%}", "-" if peak is None else f"{peak:.0f} MiB"))
    return format_table(rows, numeric=False)


def run_bench(args: argparse.Namespace) -> int:
    methods = [m.strip() for m in args.protocols.split(",") if m.strip() and m.strip() != REFERENCE]
    if not methods:
        print("bench: --protocols names no method besides local, the reference, which runs with any",
              file=sys.stderr)
        return 2
    twice = sorted({m for m in methods if methods.count(m) > 1})
    if twice:
        print(f"bench: --protocols names {', '.join(twice)} more than once", file=sys.stderr)
        return 2
    if args.hosts > MAX_HOSTS:
        print(f"bench: --hosts {args.hosts}: a lab has at most {MAX_HOSTS}", file=sys.stderr)
        return 2
    try:
        parse_rates(args.bandwidth, args.hosts)
    except LabSettingsError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    unknown = sorted(m for m in methods if split_method(m)[0] not in METHODS or m.endswith(("+", "@"))
                     or (split_method(m)[1] and split_method(m)[0] in ("ddp", "hivemind")))
    if unknown:
        print(f"bench: unknown method(s) {unknown}; choose from {list(METHODS)}, those of the swarm optionally "
              "with +CODEC (e.g. diloco+float16), any with @STEPS (e.g. ddp@1500)", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        _refuse_an_earlier_run(out, methods)
    except RecipeError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    recipes = Path(args.recipes)
    base = load_recipe(recipe_file(REFERENCE, recipes))  # (the model and data every method shares, checked below)
    tokens_per_step = base.train.batch_size * base.train.context
    parameters = build_model(base.model_source, base.model, base.train.context).num_parameters()
    results = {
        "config": {"hosts": args.hosts, "bandwidth": args.bandwidth, "steps": args.steps, "methods": methods,
                   "parameters": parameters, "tokens_per_step": tokens_per_step,
                   "date": dt.date.today().isoformat(), "machine": f"{platform.node()} {platform.machine()}, "
                   f"{os.cpu_count()} cores", "python": platform.python_version()},
        "methods": {},
    }
    try:
        run_recipes = {m: _recipe_for(m, recipes, args.steps, f"bench-{uuid.uuid4().hex[:6]}")
                       for m in [REFERENCE, *methods]}
        load_corpus(args.data)  # what every worker reads: a bad --data fails here, not in every worker
    except (RecipeError, ValueError) as e:  # (DataError is a ValueError)
        print(f"bench: {e}", file=sys.stderr)
        return 2
    for method, recipe in run_recipes.items():
        for section in ("model", "train"):
            if {**recipe[section], "steps": None} != {**run_recipes[REFERENCE][section], "steps": None}:
                print(f"bench: {method}'s recipe has a different {section} section than local.yaml; "
                      "methods must train the same model on the same data", file=sys.stderr)
                return 2
    if args.hosts == 1:  # (once every refusal has passed: a refusal comes alone)
        print("bench: note: one host: each method's worker averages with nobody (its cost alone is compared)",
              file=sys.stderr)
    try:
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(results_folder(out, "bench", refuse=lambda folder: _refuse_an_earlier_run(
                    folder, methods)))
            except RecipeError as e:  # (a bench given this --out began meanwhile)
                print(f"bench: {e}", file=sys.stderr)
                return 2
            with NetLab(args.hosts, args.bandwidth, mode=args.mode, name="bench") as lab:
                results["config"]["mode"] = lab.mode
                for method, recipe in run_recipes.items():
                    print(f"bench: {method} on {args.hosts} host{'s' if args.hosts > 1 else ''} ...", flush=True)
                    started = time.monotonic()
                    method_out = out / method
                    raw = run_method(lab, method, recipe, method_out, args.method_timeout, args.data or [])
                    res = summarize_method(raw, tokens_per_step=tokens_per_step, steps=recipe["train"]["steps"])
                    res["paced"] = _paced(method, lab.mode, args.bandwidth)
                    results["methods"][method] = res
                    (out / "results.json").write_text(json.dumps(results, indent=1))  # an interrupted bench keeps these
                    print(f"bench: {method} done in {time.monotonic() - started:.0f}s "
                          f"({'ok' if res['ok'] else 'FAILED: see ' + str(method_out) + '/w*.log'})", flush=True)
    except KeyboardInterrupt:
        rest = [m for m in methods if m not in results["methods"]]
        if not rest and REFERENCE in results["methods"]:  # (as the lab closed: only the report was left to do)
            print("bench: interrupted as the lab closed, after every method had run", file=sys.stderr, flush=True)
            report(results, out, args.target_loss)
            return 130
        cut = "" if REFERENCE in results["methods"] else f"{REFERENCE} (the reference, cut off), "
        print(f"bench: interrupted; not run: {cut}{','.join(rest)}" + (
            f"; the finished ones are in {out / 'results.json'} (`decentral bench --report {out}` tables them)"
            if results["methods"] else "") + f"; run the rest with --protocols {','.join(rest)} and another --out",
              file=sys.stderr, flush=True)
        return 130
    return report(results, out, args.target_loss)


def _refuse_an_earlier_run(out: Path, methods: list[str]) -> None:
    """RecipeError when `out` is no folder for this bench: it holds a previous bench's results, or a folder a method
    would write (a run of the user's, `train --out runs/diloco`, beside a `bench --out runs`)."""
    if (out / "results.json").is_file():
        raise RecipeError(f"--out {out} holds a previous bench (results.json): give another --out, or redraw its "
                          f"results with --report {out}")
    taken = [m for m in [REFERENCE, *methods] if (out / m).exists()]
    if taken:
        raise RecipeError(f"--out {out} holds {', '.join(taken)}: the bench writes a folder of that name for each "
                          "method, and keeps what is there; give another --out")


def report(results: dict, out: Path, target_loss: float | None = None) -> int:
    """Compare the methods, write OUT/results.json and OUT/bench.png, print the table; 0 if every method of the
    run (`config.methods` and the reference) ran and succeeded."""
    compare(results, target_loss)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot_bench(results, out / "bench.png")
    config = results["config"]
    hosts = config.get("hosts")
    print(f"bench: {hosts} host{'' if hosts == 1 else 's'}, {_uplinks(config)} links, "
          f"{mode_note(config.get('mode'))}")
    print(format_results(results))
    print(format_cpu(results))
    held = [f"{m} {r['held_up_most'][0]} {r['held_up_most'][1]:.1f}s" for m, r in results["methods"].items()
            if r.get("held_up_most")]
    if held:
        print(f"bench: the worker that held the averages up longest (held_up_s, as `decentral report` shows each): "
              f"{', '.join(held)}")
    target = results["config"]["target_loss"]
    print(f"bench: target loss {'none (no DDP run finished, none given)' if target is None else target}; results in "
          f"{out / 'results.json'}, plot {out / 'bench.png'}")
    faster = [m for m, r in results["methods"].items() if (r.get("compute_utilisation") or 0) > 1.05]
    if faster:  # (a ratio to one run of the reference, which noise on a shared machine slows or speeds)
        print(f"bench: note: {', '.join(faster)} stepped faster than {REFERENCE}, the reference (utilisation above "
              f"100%): the machine was busier while {REFERENCE} ran; utilisation moves by about 10 points between "
              "runs on shared cores, repeat the bench to compare", file=sys.stderr)
    uncapped = [m for m, r in results["methods"].items() if not r.get("paced", True)]
    if uncapped:
        print(f"bench: note: {', '.join(uncapped)} ran uncapped: in loopback mode only the swarm's own streams are "
              f"paced to --bandwidth, not {' or '.join(UNPACED_IN_LOOPBACK)}'s traffic, so their times are not those "
              "of capped links and nothing is compared with DDP's; netns mode (as root) caps every byte",
              file=sys.stderr)
    alone = [m for m, r in results["methods"].items() if r["ok"] and _never_averaged(m, r)]
    if alone:
        print(f"bench: {', '.join(alone)} never averaged (no round had two members: the run ended before the first "
              "average) and ran as local does; give more --steps", file=sys.stderr)
    missing = [m for m in [REFERENCE, *results["config"]["methods"]] if m not in results["methods"]]
    if missing:  # an interrupted run's
        print(f"bench: not run (the bench was interrupted): {', '.join(missing)}", file=sys.stderr)
    return 0 if all(r["ok"] for r in results["methods"].values()) and not missing else 1


def main(args: argparse.Namespace) -> int:
    """`decentral bench`: run the methods, or with --report DIR only redo the comparison of a past run."""
    if args.report:
        ignored = [f"--{key.replace('_', '-')}" for key, value in RUN_DEFAULTS.items() if getattr(args, key) != value]
        if ignored:
            print(f"bench: note: --report runs nothing and writes into its own folder: {', '.join(ignored)} ignored",
                  file=sys.stderr)
        out = Path(args.report)
        if out.name == "results.json" and out.is_file():  # the run's file named instead of its folder
            out = out.parent
        try:
            results = json.loads((out / "results.json").read_text())
        except (OSError, ValueError) as e:
            print(f"bench: cannot read {out / 'results.json'}: {e}", file=sys.stderr)
            return 2
        try:  # the run's own target (a --target-loss it was given), unless another is given now
            return report(results, out, args.target_loss or results["config"].get("target_loss"))
        except (KeyError, TypeError, AttributeError) as e:
            print(f"bench: {out / 'results.json'} is not a `decentral bench` run's results ({type(e).__name__}: {e}); "
                  f"`decentral report {out}` tables any run's folder", file=sys.stderr)
            return 2
    return run_bench(args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from decentral.cli import number_type

    parser.set_defaults(**RUN_DEFAULTS)
    parser.add_argument("--hosts", type=number_type(int, 1), help=f"hosts, 1 to {MAX_HOSTS} (default: %(default)s)")
    parser.add_argument("--bandwidth", type=bandwidths_argument, help=BANDWIDTHS_HELP)
    parser.add_argument("--protocols",
                        help=f"comma-separated, from {','.join(METHODS)} (local, the reference, always runs first); "
                             "METHOD+CODEC runs a method with another "
                             "swarm.codec (e.g. diloco+topk, diloco+float16); METHOD@STEPS gives a method its own "
                             "number of steps (e.g. ddp@1500: DDP's final loss at 1500 steps is the target) "
                             "(default: all of them)")
    parser.add_argument("--steps", type=number_type(int, 1),
                        help="inner steps per worker (the same for every method without @STEPS; default: "
                             "%(default)s)")
    parser.add_argument("--out", help="the run's folder (default: %(default)s)")
    add_mode_argument(parser)
    parser.add_argument("--recipes", help="folder with local.yaml and one recipe per method (hivemind: "
                        "hivemind.yaml, a DiLoCo recipe, else diloco.yaml)")
    parser.add_argument("--data", action="append", metavar="PATH", help="text for every method (default: Python's stdlib)")
    parser.add_argument("--target-loss", type=number_type(float, 0, strict=True),
                        help="the validation loss each method is timed to (default: DDP's final loss; with --report: "
                        "the run's)")
    parser.add_argument("--method-timeout", type=number_type(float, 0, strict=True),
                        help="seconds before a method is killed (default: %(default)g)")
    parser.add_argument("--report", metavar="DIR", help="run nothing: recompute the comparison (to the run's target "
                        "loss, or --target-loss), table and plot from DIR/results.json of an earlier run (DIR or that "
                        "file), and write them there")
