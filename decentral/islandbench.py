"""`decentral bench islands`: fast islands inside a slow swarm, on emulated hosts (decentral.netlab).

(A) Utilisation, hierarchical vs flat, the same processes. A lab of 2 hosts, each behind an uplink
capped at --bandwidth, runs 2 training processes per host of the shipped DiLoCo recipe (the same
inner steps, so the same tokens, per process), three ways:
  local         no communication: the compute reference (local.yaml, DiLoCo's model and training);
  flat          every process a swarm member: 4 members, 2 behind each uplink;
  hierarchical  per host one island of 2 ranks (`decentral train --island-size 2`, leader mode): the
                ranks all-reduce gradients every step over the host's loopback (gloo on lo, uncapped),
                and the island is one swarm member (2 members); its leader averages over the uplink.
Per method: inner steps/s per process, utilisation (steps/s ÷ local's), final validation loss, what
each host's uplink sent (eth0's tx_bytes inside its namespace) and wall time.

(B) Sharded vs leader sync. 2 islands of k ranks, every rank a host of its own with its own capped
uplink (the WAN); the ranks of one island also share an uncapped LAN (NetLab `lans`). Every rank runs
`python -m decentral.islandbench _peer`: an IslandTransport over the LAN (gloo on lan0) inside a
HierarchicalTransport whose swarm connections listen on the WAN address; it times `rounds` averages of
a --numel float32 tensor (default: the DiLoCo model's parameter count; on the wire in the recipe's
codec), the first round dropped. Per mode and k: the median sync time (a round ends when the island's
slowest rank holds the result), sharded ÷ leader (target ≤ 1.2/k), and the WAN bytes each rank's
uplink sent per round, sharded ranks ÷ the leader's rank 0 (target 1/k).

Writes OUT/results.json (after each part) and OUT/islands.png, and prints a table per part.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml

from decentral.bench import (REFERENCE, Launch, _command, _recipe_for, compare, island_port, plot_curves,
                             run_launches, summarize_method)
from decentral.config import default_recipe_path, load_recipe
from decentral.data import load_corpus
from decentral.hierarchy import MODES
from decentral.metrics import cell, format_table, human_bytes, results_folder
from decentral.netlab import BANDWIDTH_HELP, NetLab, add_mode_argument, bandwidth_argument

A_METHODS = (REFERENCE, "flat", "hierarchical")
A_HOSTS = 2
PER_HOST = 2  # training processes per host in part A: the island's ranks, or flat members
PEER_TIMEOUT = 300.0  # part B: rendezvous, collectives, waiting for the other island


def _load() -> float:
    """The machine's 1-minute load average: other work on a shared machine skews every rate measured here."""
    return round(os.getloadavg()[0], 2)


def _source() -> dict:
    """The commit measured, and the files of the package that differed from it."""
    def git(*cmd: str) -> str | None:
        try:
            done = subprocess.run(["git", *cmd], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.rstrip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--", ".")
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted": None if status is None else [line[3:] for line in status.splitlines()]}


# ----- part A: utilisation -----

def _a_launch(method: str, lab: NetLab, recipe_file: Path, out: Path, data: list[str], index: int,
              bootstrap: list[str]) -> Launch:
    """Process `index` of `method`: flat and local run 2 per host, hierarchical one island (2 ranks) per host; in
    loopback mode a flat member paces itself to its share of the host's uplink."""
    island = method == "hierarchical"
    per_host = 1 if island else PER_HOST
    host = lab.hosts[index // per_host]
    cmd = _command(REFERENCE if method == REFERENCE else "diloco", recipe_file, out, index, len(lab.hosts) * per_host,
                   host.address, lab.hosts[0].address, bootstrap, data)
    if island:  # the ranks meet at 127.0.0.1 (spawn_ranks); gloo must bind there too, not the capped uplink
        return Launch(host, f"w{index}", cmd + ["--island-size", str(PER_HOST), "--island-mode", "leader"],
                      {"GLOO_SOCKET_IFNAME": "lo"})
    if lab.app_shaping:  # loopback: each process paces itself; a host's share one uplink, as they average at once
        return Launch(host, f"w{index}", cmd, {"DECENTRAL_LINK_RATE_BPS": str(int(host.rate_bps // per_host))})
    return Launch(host, f"w{index}", cmd)


def run_part_a(args: argparse.Namespace, out: Path) -> dict:
    recipes = Path(args.recipes)
    base = load_recipe(recipes / "diloco.yaml")
    tokens_per_step = base.train.batch_size * base.train.context
    part = {"config": {"hosts": A_HOSTS, "processes_per_host": PER_HOST, "bandwidth": args.bandwidth, "steps": args.steps,
                       "tokens_per_step": tokens_per_step, "island_mode": "leader"}, "methods": {}}
    with NetLab(A_HOSTS, args.bandwidth, mode=args.mode, name=f"{args.lab_name}a") as lab:
        part["config"]["mode"] = lab.mode
        for method in A_METHODS:
            recipe = _recipe_for(REFERENCE if method == REFERENCE else "diloco", recipes, args.steps,
                                 f"islands-{uuid.uuid4().hex[:6]}")
            method_out = out / "a" / method
            shutil.rmtree(method_out, ignore_errors=True)
            method_out.mkdir(parents=True)
            recipe_file = method_out / "recipe.yaml"
            recipe_file.write_text(yaml.safe_dump(recipe, sort_keys=False))
            count = len(lab.hosts) * (1 if method == "hierarchical" else PER_HOST)

            def launch(index: int, bootstrap: list[str], method=method, recipe_file=recipe_file, method_out=method_out):
                return _a_launch(method, lab, recipe_file, method_out, args.data or [], index, bootstrap)

            ranks = f" (an island of {PER_HOST} ranks on each)" if method == "hierarchical" else ""
            print(f"islands: (A) {method}, {len(lab.hosts) * PER_HOST} processes on {len(lab.hosts)} hosts{ranks} ...",
                  flush=True)
            started, load = time.monotonic(), _load()
            raw = run_launches(lab, method_out, method, [launch(0, [])],
                               lambda bootstrap, launch=launch, count=count: [launch(i, bootstrap) for i in range(1, count)],
                               timeout=args.timeout, timeout_option="--timeout",
                               bootstrap=None if method == REFERENCE else method_out / "bootstrap.maddrs",
                               steps=args.steps)
            res = summarize_method(raw, tokens_per_step=tokens_per_step, steps=args.steps,
                                   workers=len(lab.hosts) * PER_HOST)
            res.update(elapsed_s=time.monotonic() - started, processes=len(lab.hosts) * PER_HOST, load=[load, _load()],
                       members={REFERENCE: 0, "flat": len(lab.hosts) * PER_HOST, "hierarchical": len(lab.hosts)}[method],
                       uplink_bytes_per_host=res["bytes_sent_per_worker"] if lab.mode == "netns" else None)
            part["methods"][method] = res
            print(f"islands: (A) {method} done in {res['elapsed_s']:.0f}s "
                  f"({'ok' if res['ok'] else 'FAILED: see ' + str(method_out) + '/w*.log'})", flush=True)
    compare(part)
    return part


def format_part_a(part: dict) -> str:
    rows = [("method", "members", "processes", "wall_s", "steps/s/proc", "util", "final_val", "uplink/host",
             "elapsed_s", "load")]
    for method, r in part["methods"].items():
        rows.append((method + ("" if r["ok"] else " (FAILED)"), str(r["members"]), str(r["processes"]),
                     cell(r["wall_s"], ".0f"), cell(r["steps_per_s"], ".2f"), cell(r.get("compute_utilisation"), ".0%"),
                     cell(r["final_val_loss"], ".3f"), human_bytes(r["uplink_bytes_per_host"]),
                     cell(r["elapsed_s"], ".0f"),
                     "{:.1f}->{:.1f}".format(*r["load"])))
    return format_table(rows, numeric=False)


# ----- part B: sharded vs leader -----

def _eth0_tx_bytes() -> int:
    """What this namespace's eth0 (its WAN uplink in a lab) has sent."""
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def peer_main(argv: list[str]) -> int:
    """One rank of one island: join the island and the swarm, wait for the other islands, time `rounds`
    averages; write their durations and WAN bytes as JSON."""
    import torch

    from decentral.hierarchy import HierarchicalTransport, shard_run
    from decentral.island import IslandTransport
    from decentral.swarm import SwarmTransport

    p = argparse.ArgumentParser(prog="python -m decentral.islandbench _peer")
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--island", required=True, help="tcp://LAN_ADDRESS_OF_RANK0:PORT")
    p.add_argument("--islands", type=int, default=2)
    p.add_argument("--host", required=True, help="WAN address the swarm connections listen on")
    p.add_argument("--run", required=True)
    p.add_argument("--join", action="append", default=[])
    p.add_argument("--maddr-file")
    p.add_argument("--numel", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--codec", default="float16")
    p.add_argument("--count", choices=("eth0", "streams"), default="eth0",
                   help="WAN bytes from eth0's counter (netns), or what the swarm streams counted (loopback)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)

    def connect(rank: int, leader_addrs: list[str]):
        return SwarmTransport(shard_run(a.run, rank), [*a.join, *leader_addrs], host=a.host, timeout=PEER_TIMEOUT,
                              codec=a.codec)

    island = IslandTransport(a.island, a.rank, a.ranks, backend="gloo", timeout=PEER_TIMEOUT)
    transport = HierarchicalTransport(island, connect, mode=a.mode, timeout_s=2 * PEER_TIMEOUT)
    sent = _eth0_tx_bytes if a.count == "eth0" else (lambda: transport.bytes_sent)
    try:
        if a.maddr_file and transport.multiaddrs():
            Path(a.maddr_file + ".tmp").write_text("\n".join(transport.multiaddrs()))
            Path(a.maddr_file + ".tmp").replace(a.maddr_file)
        transport.join_rounds(0, first=True)
        transport.wait_for_peers(a.islands, PEER_TIMEOUT, 0)
        tensor = torch.randn(a.numel, generator=torch.Generator().manual_seed(a.rank))
        times, wan, complete, groups, why = [], [], [], [], []
        for r in range(a.rounds):
            group = transport.members(r)
            transport.join_rounds(r + 1)
            before, start = sent(), time.perf_counter()
            result = transport.average(tensor, group, f"islands/{r}", r)
            times.append(time.perf_counter() - start)
            wan.append(sent() - before)
            complete.append(result.complete)
            groups.append(len(result.group))
            why.append(None if result.complete else {"contributors": result.contributors, "absent": result.absent,
                                                     "left_out": result.left_out, "disagree": result.disagree,
                                                     "rejected": result.rejected})
        Path(a.out).write_text(json.dumps({"rank": a.rank, "mode": a.mode, "times": times, "wan_bytes": wan,
                                           "complete": complete, "groups": groups, "incomplete_why": why,
                                           "connections": sum(c is not None for c in transport.connections)}))
    finally:
        transport.close()
    return 0


def run_sync_point(lab: NetLab, k: int, mode: str, *, numel: int, rounds: int, codec: str, out: Path,
                   timeout: float) -> dict:
    """2 islands of k ranks (hosts 0..k-1 and k..2k-1 of `lab`, each island on its LAN) sync `rounds` times."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    run = f"islandsync-{uuid.uuid4().hex[:6]}"
    bootstrap = out / "bootstrap.maddrs"
    ports = [island_port(lab, island) for island in range(2)]

    def launch(index: int, join: list[str]) -> Launch:
        host = lab.hosts[index]
        island, rank = divmod(index, k)
        leader = lab.hosts[island * k]
        cmd = [sys.executable, "-m", "decentral.islandbench", "_peer", "--mode", mode, "--rank", str(rank),
               "--ranks", str(k), "--island", f"tcp://{leader.lan_address}:{ports[island]}",
               "--host", host.address, "--run", run, "--numel", str(numel), "--rounds", str(rounds),
               "--codec", codec, "--count", "eth0" if lab.mode == "netns" else "streams",
               "--out", str(out / f"h{index}.json"), *[a for m in join for a in ("--join", m)]]
        if index == 0:
            cmd += ["--maddr-file", str(bootstrap)]
        return Launch(host, f"h{index}", cmd, {"GLOO_SOCKET_IFNAME": "lan0" if lab.mode == "netns" else "lo"})

    raw = run_launches(lab, out, f"{mode} k={k}", [launch(i, []) for i in range(k)],
                       lambda join: [launch(i, join) for i in range(k, 2 * k)], timeout=timeout, bootstrap=bootstrap,
                       bootstrap_timeout=PEER_TIMEOUT, timeout_option="--timeout")
    point = {"k": k, "mode": mode, "ok": not any(raw["codes"]), "exit_codes": raw["codes"]}
    if not point["ok"]:
        return point
    peers = [json.loads((out / f"h{i}.json").read_text()) for i in range(2 * k)]
    timed = range(1, rounds)  # the first round waits for everyone to arrive
    per_round = [max(p["times"][r] for p in peers) for r in timed]  # a round ends for the slowest rank
    wan = [statistics.mean(p["wan_bytes"][r] for r in timed) for p in peers]  # per rank, per round
    point.update(sync_s=statistics.median(per_round), rounds_s=per_round,
                 rank_sync_s=[statistics.median(p["times"][r] for r in timed) for p in peers],
                 wan_bytes_per_round=wan, rank0_wan_bytes=statistics.mean(wan[0::k]),
                 mean_rank_wan_bytes=statistics.mean(wan), max_rank_wan_bytes=max(wan),
                 incomplete=sum(not c for p in peers for c in p["complete"][1:]),
                 connections=peers[0]["connections"])
    return point


def compare_sync(points: list[dict]) -> None:
    """Add to each sharded point its ratios to the leader point of the same k: sync time (target ≤ 1.2/k)
    and WAN bytes per rank against the leader's rank 0 (target 1/k)."""
    leaders = {p["k"]: p for p in points if p["mode"] == "leader" and p["ok"]}
    for p in points:
        leader = leaders.get(p["k"])
        if p["mode"] != "sharded" or not p["ok"] or leader is None:
            continue
        p["sync_ratio"] = p["sync_s"] / leader["sync_s"]
        p["sync_target"] = 1.2 / p["k"]
        p["wan_ratio"] = p["mean_rank_wan_bytes"] / leader["rank0_wan_bytes"] if leader["rank0_wan_bytes"] else None
        p["max_wan_ratio"] = p["max_rank_wan_bytes"] / leader["rank0_wan_bytes"] if leader["rank0_wan_bytes"] else None
        p["wan_target"] = 1 / p["k"]


def run_part_b(args: argparse.Namespace, out: Path) -> dict:
    base = load_recipe(Path(args.recipes) / "diloco.yaml")
    if args.numel is None:
        from decentral.models import build_model

        numel = build_model(base.model_source, base.model, base.train.context).num_parameters()
    else:
        numel = args.numel
    part = {"config": {"ks": args.ks, "islands": 2, "bandwidth": args.bandwidth, "numel": numel, "rounds": args.rounds,
                       "codec": base.swarm.codec, "lan": "uncapped"}, "points": []}
    for k in args.ks:
        lans = [list(range(k)), list(range(k, 2 * k))]
        with NetLab(2 * k, args.bandwidth, mode=args.mode, name=f"{args.lab_name}b", lans=lans) as lab:
            part["config"]["mode"] = lab.mode
            for mode in MODES:
                print(f"islands: (B) {mode}, 2 islands of {k} ranks ...", flush=True)
                started, load = time.monotonic(), _load()
                point = run_sync_point(lab, k, mode, numel=numel, rounds=args.rounds, codec=base.swarm.codec,
                                       out=out / "b" / f"{mode}-k{k}", timeout=args.timeout)
                point.update(elapsed_s=time.monotonic() - started, load=[load, _load()])
                part["points"].append(point)
                print(f"islands: (B) {mode}, k={k}: " + (f"median {point['sync_s']:.2f}s per sync, rank 0 sent "
                      f"{human_bytes(point['rank0_wan_bytes'])} per round" if point["ok"] else
                      f"FAILED (exit codes {point['exit_codes']}; see {out / 'b' / f'{mode}-k{k}'}/h*.log)"), flush=True)
    compare_sync(part["points"])
    return part


def format_part_b(part: dict) -> str:
    rows = [("k", "mode", "sync_s", "vs_leader", "target", "wan/rank/round", "rank0", "max_rank", "wan_vs_leader_r0",
             "target", "incomplete", "load")]
    for p in part["points"]:
        if not p["ok"]:
            rows.append((str(p["k"]), p["mode"] + " (FAILED)", *["-"] * 10))
            continue
        rows.append((str(p["k"]), p["mode"], cell(p["sync_s"], ".3f"), cell(p.get("sync_ratio"), ".2f"),
                     "-" if p.get("sync_target") is None else f"<={p['sync_target']:.2f}", human_bytes(p["mean_rank_wan_bytes"]),
                     human_bytes(p["rank0_wan_bytes"]), human_bytes(p["max_rank_wan_bytes"]),
                     cell(p.get("wan_ratio"), ".2f"), cell(p.get("wan_target"), ".2f"), str(p["incomplete"]),
                     "{:.1f}->{:.1f}".format(*p["load"])))
    return format_table(rows, numeric=False)


# ----- the suite -----

def plot_islands(results: dict, out_png: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4.8), dpi=110)
    curves, times, wan = fig.subplots(1, 3)
    a, b = results.get("a"), results.get("b")
    if a:
        plot_curves(curves, a)
        curves.set_title(f"(A) {a['config']['hosts']} hosts x {PER_HOST} processes, "
                         f"{a['config']['bandwidth'] or 'uncapped'} uplinks, {a['config']['steps']} steps")
    if b:
        ks = b["config"]["ks"]
        for mode, marker in zip(MODES, "os"):
            points = [p for p in b["points"] if p["mode"] == mode and p["ok"]]
            times.plot([p["k"] for p in points], [p["sync_s"] for p in points], marker=marker, label=mode)
            values = [p["rank0_wan_bytes" if mode == "leader" else "mean_rank_wan_bytes"] / 2**20 for p in points]
            wan.plot([p["k"] for p in points], values, marker=marker,
                     label="leader: rank 0" if mode == "leader" else "sharded: mean rank")
        leaders = {p["k"]: p for p in b["points"] if p["mode"] == "leader" and p["ok"]}
        if leaders:
            times.plot(list(leaders), [1.2 / k * p["sync_s"] for k, p in leaders.items()], "k--", alpha=0.5,
                       label="target: leader x 1.2/k")
            wan.plot(list(leaders), [p["rank0_wan_bytes"] / k / 2**20 for k, p in leaders.items()], "k--", alpha=0.5,
                     label="target: leader rank 0 / k")
        cfg = b["config"]
        what = f"{cfg['numel']:,} floats ({cfg['codec']}), {cfg['bandwidth'] or 'uncapped'} WAN per rank"
        times.set(xlabel="ranks per island (k)", ylabel="seconds per sync (median)", title=f"(B) sync: {what}")
        wan.set(xlabel="ranks per island (k)", ylabel="MiB per round on a rank's uplink", title="(B) WAN bytes per rank")
        for ax in (times, wan):
            ax.set_xticks(ks)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend()
    for ax, shown in ((curves, a), (times, b), (wan, b)):
        if not shown:
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(out_png)
    return out_png


def run_islands(args: argparse.Namespace) -> int:
    parts = set(args.parts.replace(",", "").lower())
    if not parts or parts - {"a", "b"}:
        print(f"islands: --parts takes a, b or a,b; got {args.parts!r}", file=sys.stderr)
        return 2
    if "a" in parts:
        load_corpus(args.data)  # what part A's workers read: a bad --data fails here (DataError), not in each worker
        every = load_recipe(Path(args.recipes) / "diloco.yaml").round_length()
        if every and args.steps < every:  # hierarchical and flat would average nothing, and be compared as if
            print(f"islands: --steps {args.steps} is less than one DiLoCo round (every {every} steps): give --steps "
                  f"{every} or more", file=sys.stderr)
            return 2
    out = Path(args.out)
    with results_folder(out, "bench islands"):
        results = {"config": {"parts": sorted(parts), "bandwidth": args.bandwidth, "date": dt.date.today().isoformat(),
                              "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
                              "python": platform.python_version(), **_source()}}
        started = time.monotonic()
        if "a" in parts:
            results["a"] = run_part_a(args, out)
            (out / "results.json").write_text(json.dumps(results, indent=1))  # an interrupted suite keeps part A
        if "b" in parts:
            results["b"] = run_part_b(args, out)
        results["config"]["wall_s"] = time.monotonic() - started
        (out / "results.json").write_text(json.dumps(results, indent=1))
        plot_islands(results, out / "islands.png")
        if "a" in results:
            print(f"(A) utilisation, {A_HOSTS} hosts x {PER_HOST} processes, {args.bandwidth or 'uncapped'} uplinks "
                  f"({results['a']['config']['mode']}), {args.steps} steps per process:")
            print(format_part_a(results["a"]))
        if "b" in results:
            cfg = results["b"]["config"]
            print(f"(B) sync of {cfg['numel']:,} floats ({cfg['codec']}), 2 islands of k ranks, "
                  f"{args.bandwidth or 'uncapped'} WAN per rank, uncapped LAN ({cfg['mode']}), median of "
                  f"{args.rounds - 1} rounds:")
            print(format_part_b(results["b"]))
        print(f"islands: {results['config']['wall_s']:.0f}s; results in {out / 'results.json'}, "
              f"plot {out / 'islands.png'}")
        ok = all(r["ok"] for r in results.get("a", {}).get("methods", {}).values())
        return 0 if ok and all(p["ok"] for p in results.get("b", {}).get("points", [])) else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from decentral.cli import int_list_type, number_type, positive_int
    from decentral.syncbench import _rounds

    parser.add_argument("--parts", default="a,b", help="a (utilisation, hierarchical vs flat), b (sharded vs leader "
                        "sync) or a,b")
    parser.add_argument("--bandwidth", type=bandwidth_argument, default="20mbit",
                        help=BANDWIDTH_HELP)
    parser.add_argument("--steps", type=positive_int, default=200, help="(A) inner steps per process")
    parser.add_argument("--rounds", type=_rounds, default=8,
                        help="(B) averages timed per point, at least 2 (the first is dropped)")
    parser.add_argument("--ks", type=int_list_type(1, "an island has at least 1 rank"), default="2,4", help="(B) comma-separated ranks per island")
    parser.add_argument("--numel", type=positive_int, help="(B) floats averaged (default: the DiLoCo recipe's parameter count)")
    parser.add_argument("--recipes", default=str(default_recipe_path("diloco").parent),
                        help="folder with diloco.yaml and local.yaml")
    parser.add_argument("--data", action="append", metavar="PATH", help="(A) text to train on (default: Python's stdlib)")
    parser.add_argument("--timeout", type=number_type(float, 0, strict=True), default=900.0,
                        help="seconds before one run (a method, a point) is killed")
    add_mode_argument(parser)
    parser.add_argument("--lab-name", default="isl", help="prefix of the labs' namespaces and links (part A's "
                        "lab is NAMEa, part B's NAMEb); a lab's leftovers are removed when one of that name opens")
    parser.add_argument("--out", default="runs/islands")
    parser.set_defaults(func=run_islands)


if __name__ == "__main__" and sys.argv[1:2] == ["_peer"]:
    sys.exit(peer_main(sys.argv[2:]))

