"""`decentral bench fetch`: an expert fetched from 1, 2, ... `--publishers` publishers, each behind an uplink
of `--bandwidth` (one rate for all, or one per publisher in the order they start: "8mbit,1mbit").

A netlab of `--publishers` + 1 hosts (decentral.netlab: a network namespace per host behind a `tc tbf` uplink
where root can, else loopback, where each process paces its own streams and the DHT's traffic goes unpaced).
Host 0 fetches (behind the fastest of the publishers' uplinks); hosts 1, 2, ... each run a `decentral experts
publish` process (publishers p1, p2, ...), started one after another: after each joins, a fetcher process on host 0
fetches the expert `--repeats` times (each into an empty registry, hash checked) and says how long each took.
One publisher is also how every fetch went before files came in pieces
from all publishers at once (decentral.experts.sharing): from one publisher at a time, however many published.
Writes OUT/results.json and OUT/fetch.png and prints the table: seconds per fetch (median of the repeats),
MiB/s, the speed-up over one publisher, and the time the publishers' uplinks need for the expert's bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
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

from decentral.metrics import format_table, results_folder

NAME = "bench"
D_MODEL = 256
FETCH_TIMEOUT_S = 1800.0  # a fetcher's whole run (its repeats): past this it is killed
OPEN_SWARM = {"DECENTRAL_SWARM_KEY": ""}  # (the bench's swarm is open, of its own, whatever the environment says)


def make_expert(registry: Path, size_mib: float):
    """An expert `NAME` in `registry`: a reference GPT of width D_MODEL, with as many layers as come closest to
    `size_mib` MiB of weights (one at least)."""
    import torch

    from decentral.experts.registry import Expert, model_bytes, write_expert
    from decentral.models.gpt import GPT, GPTConfig

    def weights(layers: int) -> dict:
        torch.manual_seed(0)
        return GPT(GPTConfig(n_layer=layers, n_head=4, d_model=D_MODEL)).state_dict()

    one, two = (len(model_bytes(weights(layers))) for layers in (1, 2))
    config = GPTConfig(n_layer=max(1, round(1 + (size_mib * 2**20 - one) / (two - one))), n_head=4, d_model=D_MODEL)
    state = weights(config.n_layer)
    meta = Expert(name=NAME, sha256="", size=0, model=dataclasses.asdict(config), domain="bench")
    return write_expert(registry / NAME, lambda path: path.write_bytes(model_bytes(state)), meta)


def start_publisher(host, registry: Path, run: str, join: str | None, log: Path) -> tuple[subprocess.Popen, str]:
    """`decentral experts publish NAME` from `registry` on lab host `host`; returns the process and the multiaddr
    it prints for fetchers."""
    from decentral.swarm import SwarmError

    argv = [sys.executable, "-m", "decentral", "experts", "publish", NAME, "--registry", str(registry), "--run", run,
            "--host", host.address] + (["--join", join] if join else [])
    with open(log, "w") as err:
        process = host.popen(argv, env=OPEN_SWARM, stdout=subprocess.PIPE, stderr=err, text=True)
    for line in process.stdout:  # "  decentral experts fetch NAME --join MADDR --run RUN"
        if "--join " in line:
            return process, line.split("--join ")[1].split()[0]
    process.wait()
    raise SwarmError(f"a publisher ended before it published (exit {process.returncode}): "
                     f"{_last_line(log.read_text())} (its log: {log})")


def _last_line(text: str) -> str:
    """What a process said last (as it ended: its error)."""
    return (text.strip().splitlines() or ["nothing"])[-1]


def fetch_times(host, run: str, join: str, publishers: int, repeats: int, registry: Path) -> list[float]:
    """Seconds each of `repeats` fetches took on lab host `host`, once `publishers` publishers are seen (`_fetch`,
    in a process of its own there)."""
    from decentral.swarm import SwarmError

    argv = [sys.executable, "-m", "decentral.fetchbench", "_fetch", run, join, str(publishers), str(repeats),
            str(registry)]
    done = host.run(argv, timeout=FETCH_TIMEOUT_S, env=OPEN_SWARM)
    if done.returncode != 0:
        raise SwarmError(f"the fetcher failed (exit {done.returncode}): {_last_line(done.stderr)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def publishers_seen(sharing) -> int:
    versions = sharing.available().get(NAME, [])
    return len(versions[0].peers) if versions else 0


def _fetch(run: str, join: str, publishers: int, repeats: int, registry: Path) -> list[float]:
    """(On the fetcher's host) wait until `publishers` publish NAME, then fetch it `repeats` times into
    `registry`, each time into an empty one (hash checked), and say how long each took."""
    from decentral.experts.registry import Registry
    from decentral.experts.sharing import ExpertSharing
    from decentral.swarm import SwarmError, SwarmPeer

    sharing = ExpertSharing(SwarmPeer(run, [join], host=os.environ.get("DECENTRAL_HOST_ADDR", "127.0.0.1")),
                            Registry(registry))
    try:
        deadline = time.monotonic() + 60
        while publishers_seen(sharing) < publishers:
            if time.monotonic() > deadline:
                raise SwarmError(f"the {publishers} publishers' records were not all seen within 60 s")
            time.sleep(0.2)  # their records on their first trip through the DHT
        seconds = []
        for _ in range(repeats):
            published = sharing.find(NAME)
            start = time.monotonic()
            sharing.download(published)
            seconds.append(time.monotonic() - start)
            shutil.rmtree(sharing.registry.folder(NAME))
        return seconds
    finally:
        sharing.close()
        sharing.peer.shutdown()


def measure(args: argparse.Namespace, out: Path, lab) -> tuple[dict, list[dict]]:
    """Start the publishers one by one, on hosts 1, 2, ..., and time the fetches on host 0 after each: ({"bytes"},
    one row per count)."""
    from decentral.cli import stop_processes

    expert = make_expert(out / "source", args.size_mib)
    run, publishers, rows, first = f"fetchbench-{uuid.uuid4().hex[:6]}", [], [], None
    try:
        for count in range(1, args.publishers + 1):
            registry = out / f"publisher-{count}"
            shutil.copytree(expert.folder, registry / NAME)
            publisher, maddr = start_publisher(lab.hosts[count], registry, run, first, out / f"publisher-{count}.log")
            publishers.append(publisher)
            first = first or maddr
            print(f"bench fetch: {expert.size / 2**20:.1f} MiB from {count} publisher(s), {args.repeats} fetches ...",
                  flush=True)
            seconds = fetch_times(lab.hosts[0], run, first, count, args.repeats, out / "fetched")
            rows.append({"publishers": count, "seconds": seconds, "median_s": statistics.median(seconds)})
    finally:
        stop_processes(publishers, grace_s=30.0)
    for row in rows:
        row["mib_per_s"] = expert.size / 2**20 / row["median_s"]
        row["speedup"] = rows[0]["median_s"] / row["median_s"]
        rates = [host.rate_bps for host in lab.hosts[1:row["publishers"] + 1]]
        row["link_bound_s"] = None if None in rates else expert.size * 8 / sum(rates)
    return {"bytes": expert.size}, rows


def plot_results(results: dict, out_png: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=110)
    ax = fig.subplots()
    rows = results["rows"]
    counts = [r["publishers"] for r in rows]
    ax.plot(counts, [r["median_s"] for r in rows], marker="o", label="measured (median)")
    if rows[0]["link_bound_s"] is not None:
        ax.plot(counts, [r["link_bound_s"] for r in rows], linestyle="--", label="the uplinks' time for its bytes")
    ax.set(xlabel="publishers", ylabel="seconds per fetch", xticks=counts,
           title=f"{results['bytes'] / 2**20:.1f} MiB expert, publishers' uplinks "
                 f"{results['config']['uplinks']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    return out_png


def format_results(results: dict) -> str:
    rows = [("publishers", "s per fetch", "MiB/s", "speed-up", "uplinks' time (s)")]
    rows += [(str(r["publishers"]), f"{r['median_s']:.2f}", f"{r['mib_per_s']:.2f}", f"{r['speedup']:.2f}x",
              "-" if r["link_bound_s"] is None else f"{r['link_bound_s']:.2f}") for r in results["rows"]]
    return format_table(rows)


def run_fetchbench(args: argparse.Namespace) -> int:
    from decentral.netlab import NetLab, describe_rates, mode_note, parse_rates

    out = Path(args.out)
    rates = parse_rates(args.bandwidth, args.publishers, "publishers")  # (refused before any work)
    fetcher = None if None in rates else max(rates)
    lab_rates = ",".join("none" if rate is None else f"{rate}bit" for rate in [fetcher, *rates])
    with results_folder(out, "bench fetch"):
        with NetLab(args.publishers + 1, lab_rates, mode=args.mode, name=args.lab_name) as lab:
            size, rows = measure(args, out, lab)
            mode = lab.mode
        results = {"config": {"publishers": args.publishers, "bandwidth": args.bandwidth,
                              "uplinks": describe_rates(rates, "p", 1), "size_mib": args.size_mib,
                              "repeats": args.repeats, "mode": mode, "date": dt.date.today().isoformat(),
                              "machine": f"{platform.node()} {platform.machine()}"},
                   **size, "rows": rows}
        (out / "results.json").write_text(json.dumps(results, indent=1))
        plot_results(results, out / "fetch.png")
        print(format_results(results))
        print(f"({mode_note(mode)})")
        print(f"bench fetch: results in {out / 'results.json'}, plot {out / 'fetch.png'}")
        return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from decentral.cli import number_type, positive_int
    from decentral.netlab import add_mode_argument, bandwidths_argument

    parser.add_argument("--publishers", type=positive_int, default=4,
                        help="publishers at most; the fetch is timed with 1, 2, ... of them (default: %(default)s)")
    parser.add_argument("--bandwidth", type=bandwidths_argument, default="8mbit",
                        help="each publisher's uplink, in bits per second: one rate for all (8mbit, 512kbit, 'none' "
                        "for uncapped), or one per publisher in the order they start, comma-separated: 8mbit,1mbit "
                        "(default: %(default)s)")
    parser.add_argument("--size-mib", type=number_type(float, 0, strict=True), default=8.0,
                        help="the expert's size, to within one layer of 3 MiB (default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="fetches timed per number of publishers (default: %(default)s)")
    add_mode_argument(parser)
    parser.add_argument("--lab-name", default="fetch", help="prefix of the lab's namespaces and links (default: "
                        "%(default)s); a lab's leftovers are removed when one of that name opens")
    parser.add_argument("--out", default="runs/bench-fetch", help="(default: %(default)s)")
    parser.set_defaults(func=run_fetchbench)


if __name__ == "__main__" and sys.argv[1:2] == ["_fetch"]:
    run, join, publishers, repeats, registry = sys.argv[2:]
    print(json.dumps(_fetch(run, join, int(publishers), int(repeats), Path(registry))))
