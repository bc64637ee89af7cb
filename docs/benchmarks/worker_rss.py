"""The resident memory of each `decentral train` worker under a command, sampled from /proc (issue #12).

    python docs/benchmarks/worker_rss.py decentral demo --protocol diloco --workers 4 ...

Runs the command and reads every 0.1 s the RSS of each `decentral train` process it starts (a worker, not
the DHT and libp2p processes below it); then prints, per worker, its peak and the median of its RSS over
the run's second half (the samples from 50% to 95% of its life): what it holds between outer steps.
"""

import os
import subprocess
import sys
import time


def trainers() -> dict[str, int]:
    """pid -> parent pid of every process whose command line runs `decentral ... train`."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                argv = f.read().split("\0")
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if "train" in argv and any("decentral" in a for a in argv):
            found[pid] = parent
    return found


def rss_mib(pid: str) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
    except (OSError, StopIteration):
        return None


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    command = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    series: dict[str, list[float]] = {}
    while command.poll() is None:
        found = trainers()
        for pid, parent in found.items():
            if str(parent) in found:  # a worker's DHT node (a fork of it), not a worker
                continue
            rss = rss_mib(pid)
            if rss is not None:
                series.setdefault(pid, []).append(rss)
        time.sleep(0.1)
    print("worker pid\tpeak (MiB)\tmedian over the second half (MiB)")
    for pid, samples in series.items():
        half = sorted(samples[len(samples) // 2:int(len(samples) * 0.95)] or samples)
        print(f"{pid}\t{max(samples):.0f}\t{half[len(half) // 2]:.0f}")
    sys.exit(command.returncode)


if __name__ == "__main__":
    main()
