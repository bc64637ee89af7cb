"""`decentral bench dht`: what the swarm's own records cost on the wire (heartbeats, announcements, lookups).

Starts `--peers` SwarmTransports in this process, joined on loopback (each with its hivemind DHT child and
libp2p daemon), and counts the bytes that cross the loopback interface (/proc/net/dev `lo`, every
packet with its headers, each byte once):
- per call: `--calls` heartbeat writes, lookups of the `peers` records, round announcements and lookups
  of a round's announcements, made one after another by one peer (regular heartbeats off);
- idle: for each heartbeat period of `--heartbeats`, a fresh swarm doing nothing but beat for
  `--seconds`, in bytes per second per peer.
Loopback carries whatever else this machine sends to itself: run it on a quiet machine, or in a network
namespace of its own (`decentral netlab --hosts 1 --bandwidth none -- decentral bench dht ...`, as root).
Writes OUT/results.json and OUT/dht.png and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import platform
import time
import uuid
from pathlib import Path

from decentral.metrics import format_table, results_folder

OFF = 1e6  # a heartbeat period that never comes in a measurement
SETTLE_S = 0.5


def loopback_bytes() -> int:
    """Bytes the loopback interface has received (= sent) since boot."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[0])
    raise RuntimeError("no loopback interface in /proc/net/dev")


@contextlib.contextmanager
def swarm(peers: int, heartbeat_s: float):
    """`peers` SwarmTransports of a new run, every one seeing every heartbeat; closed on exit."""
    from decentral.swarm import SwarmTransport

    run = f"dhtbench-{uuid.uuid4().hex[:6]}"
    made = [SwarmTransport(run, heartbeat_s=heartbeat_s)]
    try:
        while len(made) < peers:
            made.append(SwarmTransport(run, made[0].multiaddrs(), heartbeat_s=heartbeat_s))
        deadline = time.monotonic() + 60
        while any(len(t.membership.alive()) < peers for t in made):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {peers} peers did not all see each other within 60 s")
            time.sleep(0.2)  # heartbeats on their first trip through the DHT
        yield made
    finally:
        for t in made:
            t.close()


def per_call(peers: int, calls: int) -> dict[str, float]:
    """Bytes on the wire per call of each kind, made by one peer of a quiet swarm."""
    with swarm(peers, OFF) as made:
        for t in made:
            t.membership.announce(0)
        me = made[1 % peers].membership
        kinds = {"heartbeat write": me._beat,
                 "peers lookup": me.alive,
                 "round announcement": lambda: me.announce(7),
                 "round lookup": lambda: me.peer.lookup("round/0")}
        costs = {}
        for kind, call in kinds.items():
            before = loopback_bytes()
            for _ in range(calls):
                call()
            time.sleep(SETTLE_S)  # the last call's trailing packets (acknowledgements) counted here, not in the next kind
            costs[kind] = (loopback_bytes() - before) / calls
        return costs


def idle_rate(peers: int, heartbeat_s: float, seconds: float) -> float:
    """Bytes per second per peer of a swarm that only beats, every `heartbeat_s`."""
    with swarm(peers, heartbeat_s):
        before, start = loopback_bytes(), time.monotonic()
        time.sleep(seconds)  # the measurement window: the heartbeat threads run meanwhile
        return (loopback_bytes() - before) / (time.monotonic() - start) / peers


def plot_results(results: dict, out_png: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4), dpi=110)
    calls, idle = fig.subplots(1, 2)
    kinds = list(results["per_call"])
    calls.barh(kinds, [results["per_call"][k] / 1024 for k in kinds])
    calls.set(xlabel="KiB on the wire per call", title=f"one call, {results['config']['peers']} peers")
    beats = results["idle"]
    idle.plot([b["heartbeat_s"] for b in beats], [b["bytes_per_s"] / 1024 for b in beats], marker="o")
    idle.set(xlabel="heartbeat period (s)", ylabel="KiB/s per peer", title="a swarm doing nothing")
    for ax in (calls, idle):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png)
    return out_png


def format_results(results: dict) -> str:
    rows = [("DHT call", "KiB per call")]
    rows += [(kind, f"{cost / 1024:.1f}") for kind, cost in results["per_call"].items()]
    rows += [("idle, heartbeat every", "KiB/s per peer")]
    rows += [(f"{b['heartbeat_s']:g} s", f"{b['bytes_per_s'] / 1024:.1f}") for b in results["idle"]]
    return format_table(rows)


def run_dhtbench(args: argparse.Namespace) -> int:
    out = Path(args.out)
    with results_folder(out, "bench dht"):
        results = {"config": {"peers": args.peers, "calls": args.calls, "seconds": args.seconds,
                              "date": dt.date.today().isoformat(),
                              "machine": f"{platform.node()} {platform.machine()}"}}
        print(f"bench dht: {args.calls} calls of each kind among {args.peers} peers ...", flush=True)
        results["per_call"] = per_call(args.peers, args.calls)
        results["idle"] = []
        for beat in args.heartbeats:
            print(f"bench dht: idle for {args.seconds:g} s with a heartbeat every {beat:g} s ...", flush=True)
            results["idle"].append({"heartbeat_s": beat, "bytes_per_s": idle_rate(args.peers, beat, args.seconds)})
        (out / "results.json").write_text(json.dumps(results, indent=1))
        plot_results(results, out / "dht.png")
        print(format_results(results))
        print(f"bench dht: results in {out / 'results.json'}, plot {out / 'dht.png'}")
        return 0


def _heartbeats(text: str) -> list[float]:
    """argparse type of --heartbeats: comma-separated periods in seconds, each above 0."""
    from decentral.cli import number_type

    return [number_type(float, 0, strict=True)(beat) for beat in text.split(",")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from decentral.cli import number_type, positive_int

    parser.add_argument("--peers", type=number_type(int, 2), default=4, help="DHT peers (default: %(default)s)")
    parser.add_argument("--calls", type=positive_int, default=10,
                        help="calls of each kind, one after another (default: %(default)s)")
    parser.add_argument("--heartbeats", type=_heartbeats, default="2,6,10",
                        help="heartbeat periods (s) to measure idle (default: %(default)s)")
    parser.add_argument("--seconds", type=number_type(float, 0, strict=True), default=30.0,
                        help="how long each idle swarm is measured (default: %(default)ss)")
    parser.add_argument("--out", default="runs/bench-dht", help="(default: %(default)s)")
    parser.set_defaults(func=run_dhtbench)
