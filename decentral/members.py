"""The members of a swarm started on one machine or one netlab (`demo`, `bench`, `bench soak`, `bench islands`):
each member's `decentral train` command line, and the wait for the first member's addresses, through which the
others join."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def train_command(recipe: Path, out: Path, index: int, workers: int, *, module: str = "decentral",
                  verbose: bool = False) -> list[str]:
    """Member `index` of `workers` training `recipe` into OUT/w{index}, logging the swarm's internals with `verbose`
    (`module`: another entry point taking the same arguments, e.g. hivemind's baseline, which has no subcommand)."""
    cmd = [sys.executable, "-m", module] + (["-v"] if verbose else []) + (["train"] if module == "decentral" else [])
    return cmd + ["--protocol", str(recipe), "--out", str(out / f"w{index}"), "--name", f"w{index}",
                  "--worker-index", str(index), "--num-workers", str(workers)]


def joining(index: int, *, min_peers: int, addresses_file: Path, join: list[str]) -> list[str]:
    """How member `index` enters the swarm: the first starts it and writes its addresses to `addresses_file`, every
    other joins through `join` (those addresses); each waits for `min_peers` members before it trains."""
    first = ["--maddr-file", str(addresses_file)] if index == 0 else [a for m in join for a in ("--join", m)]
    return ["--min-peers", str(min_peers), *first]


def wait_for_addresses(path: Path, procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """The multiaddrs the first member wrote to `path` (`--maddr-file`); RuntimeError when one of `procs` (the
    members started so far) exits first, or when `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().split()
        if ended := [p for p in procs if p.poll() is not None]:
            raise RuntimeError(f"a member exited (code {ended[0].returncode}) before the first wrote its address "
                               f"to {path}")
        time.sleep(0.2)  # polling a file another process writes; not standing in for a handshake
    raise RuntimeError(f"the first member wrote no address to {path} within {timeout:.0f}s")
