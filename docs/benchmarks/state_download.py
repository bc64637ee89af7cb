"""A state download: the peak memory of a donor serving its outer state and of the newcomers downloading
it, and how long it takes (issues #10, #12).

    python docs/benchmarks/state_download.py [--values 50000000] [--newcomers 2] [--rate MBIT --timeout S]

Starts a donor (a real swarm peer on loopback offering `slow` and `momentum`, `--values` float32 each) and
`--newcomers` processes that download that state at the same time, then prints, per process, how much its
peak resident memory rose above what it held before (the state itself, for the donor) and how long the
download took. A process's peak (getrusage's ru_maxrss) is read when its part is done. `--rate`: our
streams paced to that many Mb/s (netlab's loopback mode); `--timeout`: the swarm's timeout.
"""

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

from decentral.swarm.transport import SwarmTransport


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.1)


def donor(folder: str, values: int, newcomers: int, timeout: float) -> None:
    t = SwarmTransport("state-download", timeout=timeout)
    t.offer_state({"protocol": "diloco", "round": 3, "step": 150},
                  {"slow": torch.randn(values), "momentum": torch.randn(values)})
    t.set_progress(150, 3)
    held = rss_mib()
    with open(f"{folder}/maddr.tmp", "w") as f:
        f.write(t.multiaddrs()[0])
    os.rename(f"{folder}/maddr.tmp", f"{folder}/maddr")
    for i in range(newcomers):
        wait_for(f"{folder}/done{i}")
    print(f"donor\t{held:.0f}\t{peak_mib() - held:+.0f}\t", flush=True)
    t.close()


def newcomer(folder: str, index: int, timeout: float) -> None:
    wait_for(f"{folder}/maddr")
    with open(f"{folder}/maddr") as f:
        t = SwarmTransport("state-download", [f.read()], timeout=timeout)
    while not t.progress():
        time.sleep(0.1)
    held, start = rss_mib(), time.monotonic()
    _, (_, tensors) = t.fetch_state()
    took = time.monotonic() - start
    assert sorted(tensors) == ["momentum", "slow"]
    print(f"newcomer {index}\t{held:.0f}\t{peak_mib() - held:+.0f}\t{took:.1f}", flush=True)
    open(f"{folder}/done{index}", "w").close()
    t.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--values", type=int, default=50_000_000, help="float32 values in each of the two tensors")
    parser.add_argument("--newcomers", type=int, default=2)
    parser.add_argument("--rate", type=float, help="Mb/s our streams are paced to (default: not paced)")
    parser.add_argument("--timeout", type=float, default=60.0, help="the swarm's timeout (s)")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "donor":
        return donor(args.folder, args.values, args.newcomers, args.timeout)
    if args.role == "newcomer":
        return newcomer(args.folder, args.index, args.timeout)
    link = f"{args.rate:g} Mb/s" if args.rate else "not paced"
    print(f"state: 2 x {args.values} float32 = {2 * args.values * 4 / 2**20:.0f} MiB; {args.newcomers} newcomer(s); "
          f"link {link}; timeout {args.timeout:g} s")
    print("process\tRSS before (MiB)\tpeak above it (MiB)\tdownload (s)")
    with tempfile.TemporaryDirectory() as folder:
        me = [sys.executable, __file__, "--folder", folder, "--values", str(args.values),
              "--newcomers", str(args.newcomers), "--timeout", str(args.timeout)]
        env = dict(os.environ, **({"DECENTRAL_NETLAB_MODE": "loopback", "DECENTRAL_LINK_RATE_BPS": str(args.rate * 1e6)}
                                  if args.rate else {}))
        newcomers = [subprocess.Popen(me + ["--role", "newcomer", "--index", str(i)], env=env, stderr=subprocess.PIPE,
                                      text=True) for i in range(args.newcomers)]
        serving = subprocess.Popen(me + ["--role", "donor"], env=env, stderr=subprocess.DEVNULL)
        errors = [p.communicate()[1] for p in newcomers]
        failed = [err.strip().splitlines()[-1] for p, err in zip(newcomers, errors) if p.returncode]
        if failed:
            serving.kill()
            sys.exit("a newcomer failed: " + "; ".join(failed))
        if serving.wait():
            sys.exit("the donor failed (run it with --role donor to see why)")


if __name__ == "__main__":
    main()
