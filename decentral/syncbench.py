"""`decentral syncbench`: the time of one outer synchronisation alone, DiLoCo vs NoLoCo, as hosts grow.

For each host count, a lab of that many hosts (decentral.netlab) runs one peer per host; the peers
sync a fixed-size tensor `rounds` times: DiLoCo's group average over all members, then NoLoCo's
pair exchange (slow weights and outer gradient: twice the tensor). Reported: the median time of a
round (the first, which waits for every peer to arrive, is dropped). Writes OUT/syncbench.json and
OUT/syncbench.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

from decentral.config import SwarmConfig
from decentral.metrics import results_folder
from decentral.netlab import BANDWIDTH_HELP, MAX_HOSTS, NetLab, add_mode_argument, bandwidth_argument, mode_note

METHODS = ("diloco", "noloco")


def peer_main(argv: list[str]) -> int:
    """One peer: join, wait for everyone, time `rounds` syncs; write their durations as JSON."""
    from decentral.swarm import SwarmTransport
    from decentral.sync.pairing import group_of, round_groups

    p = argparse.ArgumentParser()
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--numel", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--run", required=True)
    p.add_argument("--join", action="append", default=[])
    p.add_argument("--maddr-file")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    transport = SwarmTransport(a.run, a.join, host=a.host, timeout=300.0, heartbeat_s=SwarmConfig().heartbeat_s)
    try:
        if a.maddr_file:
            Path(a.maddr_file + ".tmp").write_text("\n".join(transport.multiaddrs()))
            Path(a.maddr_file + ".tmp").replace(a.maddr_file)
        transport.join_rounds(0)
        deadline = time.monotonic() + 300
        while len(transport.members(0)) < a.hosts:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(transport.members(0))} of {a.hosts} peers joined")
            time.sleep(0.5)  # peers announce themselves through the DHT
        size = a.numel * (2 if a.method == "noloco" else 1)  # NoLoCo sends φ and Δ
        tensor = torch.randn(size)
        times, groups = [], []
        for r in range(a.rounds):
            members = transport.members(r)
            group = members if a.method == "diloco" else group_of(transport.peer_id, round_groups(members, 0, r))
            transport.join_rounds(r + 1)
            start = time.perf_counter()
            result = transport.average(tensor, group, f"{a.method}/{r}")
            times.append(time.perf_counter() - start)
            groups.append(len(result.group) if result.complete else -len(result.group))
        Path(a.out).write_text(json.dumps({"times": times, "groups": groups, "bytes_sent": transport.bytes_sent}))
    finally:
        transport.close()
    return 0


class PointFailed(RuntimeError):
    """A point's peer did not start or exited with an error; the message names its log."""


def _run_sweep_point(lab: NetLab, method: str, numel: int, rounds: int, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    run = f"sync-{uuid.uuid4().hex[:6]}"
    maddr_file = out / "bootstrap.maddrs"
    for earlier in (maddr_file, *out.glob("h*.json")):  # of an earlier syncbench into this OUT: a dead address
        earlier.unlink(missing_ok=True)
    procs = []

    def launch(host, extra):
        cmd = [sys.executable, "-m", "decentral.syncbench", "_peer", "--method", method, "--numel", str(numel),
               "--rounds", str(rounds), "--hosts", str(len(lab.hosts)), "--host", host.address, "--run", run,
               "--out", str(out / f"h{host.index}.json"), *extra]
        log = open(out / f"h{host.index}.log", "w")
        procs.append(host.popen(cmd, stdout=log, stderr=subprocess.STDOUT))

    try:
        launch(lab.hosts[0], ["--maddr-file", str(maddr_file)])
        deadline = time.monotonic() + 120
        while not maddr_file.exists():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise PointFailed(f"the first peer did not start; see {out}/h0.log")
            time.sleep(0.2)  # polling a file another process writes
        join = [a for m in maddr_file.read_text().split() for a in ("--join", m)]
        for host in lab.hosts[1:]:
            launch(host, join)
        _wait_for_peers(procs, out)
    finally:
        for proc in procs:  # the others of a peer that failed would wait for it
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    peers = [json.loads((out / f"h{h.index}.json").read_text()) for h in lab.hosts]
    per_round = [max(p["times"][r] for p in peers) for r in range(1, rounds)]  # a round ends for the slowest
    return {"median_s": statistics.median(per_round), "rounds_s": per_round,
            "incomplete": sum(g < 0 for p in peers for g in p["groups"]),
            "bytes_sent_per_peer_per_round": statistics.mean(p["bytes_sent"] for p in peers) / rounds}


def _wait_for_peers(procs: list[subprocess.Popen], out: Path, timeout_s: float = 1800) -> None:
    """Until every peer exited; PointFailed as soon as one exits with an error, or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        failed = [i for i, p in enumerate(procs) if p.poll()]
        if failed:
            i = failed[0]
            raise PointFailed(f"peer h{i} exited with {procs[i].returncode}; see {out}/h{i}.log")
        if all(p.returncode is not None for p in procs):
            return
        if time.monotonic() > deadline:
            raise PointFailed(f"the peers did not end within {timeout_s:.0f}s; see {out}/h*.log")
        time.sleep(0.2)  # polling processes that run on their own


def run_syncbench(args: argparse.Namespace) -> int:
    out = Path(args.out)
    with results_folder(out, "syncbench", "syncbench.json"):
        results = {"config": {"hosts": args.hosts, "bandwidth": args.bandwidth, "numel": args.numel,
                              "rounds": args.rounds},
                   "points": []}
        for count in args.hosts:
            with NetLab(count, args.bandwidth, mode=args.mode, name="sync") as lab:
                results["config"]["mode"] = lab.mode
                for method in METHODS:
                    print(f"syncbench: {method}, {count} hosts ...", flush=True)
                    try:
                        point = _run_sweep_point(lab, method, args.numel, args.rounds, out / f"{method}-{count}")
                    except PointFailed as e:
                        print(f"syncbench: {method}, {count} hosts failed: {e}", file=sys.stderr, flush=True)
                        return 1
                    except KeyboardInterrupt:
                        print(f"syncbench: interrupted at {method}, {count} hosts; "
                              f"{len(results['points'])} point(s) done before it, said above", file=sys.stderr,
                              flush=True)
                        return 130
                    results["points"].append({"method": method, "hosts": count, **point})
                    print(f"syncbench: {method}, {count} hosts: median {point['median_s']:.2f}s per sync, "
                          f"{point['bytes_sent_per_peer_per_round'] / 2**20:.1f} MiB sent per peer per sync",
                          flush=True)
        (out / "syncbench.json").write_text(json.dumps(results, indent=1))
        _plot(results, out / "syncbench.png")
        print(f"{'hosts':>5}  " + "  ".join(f"{m:>14}" for m in METHODS))
        for count in args.hosts:
            cells = [next(p for p in results["points"] if p["method"] == m and p["hosts"] == count) for m in METHODS]
            print(f"{count:>5}  " + "  ".join(f"{c['median_s']:>13.2f}s" for c in cells))
        print(f"syncbench: median seconds per sync, {args.bandwidth or 'uncapped'} links, "
              f"{mode_note(results['config']['mode'])}; results in {out / 'syncbench.json'}, plot "
              f"{out / 'syncbench.png'}")
        return 0


def _plot(results: dict, out_png: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=110)
    ax = fig.add_subplot()
    for method in METHODS:
        points = [p for p in results["points"] if p["method"] == method]
        ax.plot([p["hosts"] for p in points], [p["median_s"] for p in points], marker="o", label=method)
    cfg = results["config"]
    ax.set(xlabel="hosts", ylabel="seconds per sync (median)",
           title=f"one sync of {cfg['numel']:,} floats, {cfg['bandwidth'] or 'uncapped'} uplinks")
    ax.set_xticks(cfg["hosts"])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)


def _rounds(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value}: at least 2 (the first sync warms up and is not counted)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from decentral.cli import int_list_type, positive_int

    parser.add_argument("--hosts", type=int_list_type(2, "every point needs at least 2 hosts to sync", MAX_HOSTS),
                        default="2,4,8", help="comma-separated host counts (default: %(default)s)")
    parser.add_argument("--bandwidth", type=bandwidth_argument, default="20mbit",
                        help=BANDWIDTH_HELP)
    parser.add_argument("--numel", type=positive_int, default=1_000_000,
                        help="model size (floats) being synced (default: %(default)s)")
    parser.add_argument("--rounds", type=_rounds, default=4, help="syncs per point, at least 2: the first warms "
                        "up and is not counted (default: %(default)s)")
    add_mode_argument(parser)
    parser.add_argument("--out", default="runs/syncbench",
                        help="where syncbench.json and the plot go (default: %(default)s)")


if __name__ == "__main__" and sys.argv[1:2] == ["_peer"]:
    sys.exit(peer_main(sys.argv[2:]))
