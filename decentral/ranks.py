"""Starting the ranks of a fast island: as torchrun does, or by `decentral train --island-size N`.

torchrun (`torchrun --nproc-per-node N -m decentral train ...`) starts every rank with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its environment, and the ranks meet at MASTER_ADDR:MASTER_PORT
(torch.distributed's env:// rendezvous). `spawn_ranks` does the same on one machine: it runs the
command once per rank with that environment and waits for them all. Either way each rank sees the
same environment, so there is one code path for both.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
PR_SET_PDEATHSIG = 1  # prctl(2)


class LaunchError(ValueError):
    """The environment describes no valid rank (a half-set torchrun environment, a rank out of range)."""


@dataclass
class Rank:
    rank: int
    world_size: int
    local_rank: int  # which GPU of this machine (LOCAL_RANK; the rank when it is not set)
    local_world_size: int  # ranks of the island on this machine (LOCAL_WORLD_SIZE; WORLD_SIZE when not set)


def rank_from_env(environ: Mapping[str, str] = os.environ) -> Rank | None:
    """This process's rank when a launcher (torchrun, `spawn_ranks`) set one, else None."""
    if not any(name in environ for name in ENV):
        return None
    missing = [name for name in ENV if name not in environ]
    if missing:
        raise LaunchError(f"the environment sets {[n for n in ENV if n in environ]} but not {missing}: start the "
                          "ranks with torchrun (or decentral train --island-size N), which sets them all")
    try:
        rank, world_size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local_rank = int(environ.get("LOCAL_RANK", rank))
        local_world_size = int(environ.get("LOCAL_WORLD_SIZE", world_size))
    except ValueError as e:
        raise LaunchError(f"RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be integers: {e}") from None
    if not 0 <= rank < world_size:
        raise LaunchError(f"RANK {rank} is not in [0, WORLD_SIZE={world_size})")
    return Rank(rank, world_size, local_rank, local_world_size)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _terminate_with_parent() -> None:
    """(in a rank, before it runs) Ask Linux to send us SIGTERM when our launcher dies, even by SIGKILL:
    the rank then saves its checkpoint and exits, as on Ctrl-C, instead of training on as an orphan."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn_ranks(argv: Sequence[str], size: int, print_fn=print) -> int:
    """Run `python -m decentral ARGV` as ranks 0..size-1 of one island on this machine, each with torchrun's
    environment; wait for them all. SIGTERM is passed on to every rank, and a rank gets SIGTERM when
    this process dies, however it dies. Returns 0 when every rank
    succeeded, else the first failed rank's exit code (128 + N for a rank signal N ended, as a shell says it:
    returned as -N, it became exit status 256 - N)."""
    port = free_port()
    print_fn(f"island: starting {size} ranks (rendezvous at 127.0.0.1:{port})")
    procs = []
    for rank in range(size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "decentral", *argv], env=env,
                                      preexec_fn=_terminate_with_parent))

    def forward(signum, _frame):
        for p in procs:
            p.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        codes = []
        for p in procs:
            try:
                codes.append(p.wait())
            except KeyboardInterrupt:  # Ctrl-C reached every rank too (one process group): they save and exit
                codes.append(p.wait())
    finally:
        signal.signal(signal.SIGTERM, previous)
    failed = [(rank, code) for rank, code in enumerate(codes) if code != 0]
    if failed:
        print_fn(f"island: ranks {[r for r, _ in failed]} exited with codes {[c for _, c in failed]}")
        code = failed[0][1]
        return code if code > 0 else 128 - code
    return 0
