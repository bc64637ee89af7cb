"""A DiLoCo member the others averaged a round without: what taking their state costs it.

Three swarm peers in one process, our streams paced to 20 Mb/s each (netlab's loopback mode), int8 on the
wire, a state of φ and momentum of a 19M-parameter model (147 MiB). Round 0: all three average. Round 1:
member 0's lookup of the round's members misses member 2 (as when a newcomer's announcement reaches the
others and not it), so the two others average without it and it takes their state at that boundary. Printed:
the seconds member 0's boundary took, the MiB it received in it, and whether it ended bit-identical to them.

    PYTHONPATH=<the code to measure> python docs/benchmarks/left_out_repair.py --label NAME --out runs/left-out

Each run adds its row to OUT/results.json (run it once per version of the code, side by side), prints every
row so far and plots them (OUT/left_out_repair.png).
"""

import argparse
import json
import os
import threading
import time
from pathlib import Path

os.environ["DECENTRAL_NETLAB_MODE"] = "loopback"
os.environ["DECENTRAL_LINK_RATE_BPS"] = "20000000"

import torch  # noqa: E402

from decentral.swarm import SwarmTransport  # noqa: E402
from decentral.sync import DiLoCo  # noqa: E402

WIDTH = 3072  # two 3072x3072 linear layers: 18.9M parameters


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))


def boundary(protocols: list[DiLoCo], gen: torch.Generator) -> list[float]:
    """Each member's fast weights its φ plus noise, then its outer step, all at once; each one's seconds."""
    seconds = [0.0] * len(protocols)

    def outer(i: int, p: DiLoCo) -> None:
        fast = p.slow + 1e-3 * torch.randn(p.slow.numel(), generator=gen)
        torch.nn.utils.vector_to_parameters(fast, p.model.parameters())
        p.step = p._round_start + p.every
        start = time.perf_counter()
        p.after_step()
        seconds[i] = time.perf_counter() - start

    threads = [threading.Thread(target=outer, args=(i, p)) for i, p in enumerate(protocols)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="this row's name (the code measured)")
    parser.add_argument("--out", type=Path, default=Path("runs/left-out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run = f"left-out-{time.monotonic_ns()}"
    first = SwarmTransport(run, codec="int8", timeout=60.0, heartbeat_s=2.0)
    transports = [first, *(SwarmTransport(run, first.multiaddrs(), codec="int8", timeout=60.0, heartbeat_s=2.0)
                           for _ in range(2))]
    try:
        ids = sorted(t.peer_id for t in transports)
        while not all(set(ids) <= set(t.progress()) for t in transports):
            time.sleep(0.1)  # every peer seeing every heartbeat
        protocols = []
        for t in transports:
            m = model()
            p = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), t, every=10, outer_lr=0.7, outer_momentum=0.9)
            p.start()
            protocols.append(p)
        while not all(set(ids) <= set(p.transport.members(p.round)) for p in protocols):
            time.sleep(0.1)  # every member seeing every announcement
        gen = torch.Generator().manual_seed(1)
        boundary(protocols, gen)
        left_out = protocols[0]
        seen = sorted(p.transport.peer_id for p in protocols[:2])
        members = left_out._members
        left_out._members = lambda round: seen if round == 1 else members(round)
        before = transports[0].bytes_received
        seconds = boundary(protocols, gen)
        row = {"label": args.label, "boundary_s": round(seconds[0], 2), "others_s": round(max(seconds[1:]), 2),
               "received_mib": round((transports[0].bytes_received - before) / 2**20, 1),
               "state_mib": round(8 * left_out.slow.numel() / 2**20, 1),
               "identical": all(torch.equal(left_out.slow, p.slow) and torch.equal(left_out.momentum, p.momentum)
                                for p in protocols[1:])}
    finally:
        for t in transports:
            t.close()
    results = args.out / "results.json"
    rows = [r for r in (json.loads(results.read_text()) if results.exists() else []) if r["label"] != args.label]
    rows.append(row)
    results.write_text(json.dumps(rows, indent=1))
    print(f"{'code':<16} {'its boundary (s)':>17} {'the others (s)':>15} {'received (MiB)':>15} {'state (MiB)':>12}"
          " identical")
    for r in rows:
        print(f"{r['label']:<16} {r['boundary_s']:>17} {r['others_s']:>15} {r['received_mib']:>15} "
              f"{r['state_mib']:>12} {r['identical']}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    labels = [r["label"] for r in rows]
    axes[0].bar(labels, [r["boundary_s"] for r in rows])
    axes[0].set_ylabel("the left-out member's boundary (s)")
    axes[1].bar(labels, [r["received_mib"] for r in rows])
    axes[1].set_ylabel("MiB it received in it")
    fig.suptitle("a member left out of a round, 19M parameters, 20 Mb/s, int8")
    fig.tight_layout()
    fig.savefig(args.out / "left_out_repair.png", dpi=100)


if __name__ == "__main__":
    main()
