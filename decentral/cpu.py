"""Where CPU goes: this process, its training thread, and the processes below it (a worker's DHT node
and libp2p daemon). `decentral bench` reports the split; on hosts whose cores the workers share, CPU
spent beside the training thread is what compute utilisation loses. And the most memory this process
has held: an outer step's model-sized buffers come on top of training's."""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (Linux /proc; empty elsewhere)."""
    found, todo = set(), [pid]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = {int(k) for k in children.read_text().split()}
            except OSError:  # the process ended while we looked
                continue
            todo += sorted(kids - found)
            found |= kids
    return found


def children_cpu_s(pid: int | None = None) -> float | None:
    """CPU seconds (user + system) so far of the live processes below `pid` (default: this one); None
    without Linux's /proc. A process that already ended is not counted."""
    if not Path("/proc/self/stat").exists():
        return None
    total = 0
    for child in descendants(os.getpid() if pid is None else pid):
        try:
            fields = Path(f"/proc/{child}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime: the 14th and 15th fields of stat
    return total / _TICKS_PER_S


def peak_rss_mib() -> float:
    """The most resident memory this process has held so far, in MiB (its children not counted)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def cpu_record() -> dict:
    """CPU seconds so far of this process (all its threads: training, averaging, heartbeat) and of the
    calling thread, the training thread, and the process's peak memory: for every step's record."""
    return dict(cpu_s=time.process_time(), thread_cpu_s=time.thread_time(), peak_rss_mib=round(peak_rss_mib(), 1))


def children_record() -> dict:
    """CPU seconds so far of the processes below this one (`children_cpu_s`; empty without /proc): a few
    /proc reads, for the records of evaluation steps, not every step."""
    below = children_cpu_s()
    return {} if below is None else dict(children_cpu_s=below)
