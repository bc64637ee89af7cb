"""A process that imports what `decentral train` imports, once, then forks one worker per request.

A worker forked here is a process of its own that runs `decentral.__main__.run()` from its first line, as
`python -m decentral ARGV` does, but without the 4-5 CPU seconds a fresh interpreter spends importing
torch and hivemind, and the 1-2 more that torch._dynamo's import takes at the first optimizer step:
most of a swarm test's start-up on a 2-core machine. (Our workers already fork after
these imports: hivemind's DHT runs in a forked process.)

Lines on stdin, one JSON object each: {"argv": [...], "cwd": DIR, "env": {...}, "log": FILE, "err": FILE}
(stdout goes to "log", and stderr to "err", or to "log" too when "err" is absent); on stdout:
"started PID" for each, then "exited PID CODE" when that worker ends (CODE as subprocess reports it:
-SIGNUM for a signal). The server ends when its stdin closes; the workers it started go on.
"""

import json
import os
import selectors
import sys

import hivemind  # noqa: F401  (imported for the workers)
import torch  # noqa: F401
import torch._dynamo  # noqa: F401  (what a worker's first optimizer step imports: 1-2 CPU seconds each)
from hivemind.utils.mpfuture import MPFuture

import decentral.pipeline.serve  # noqa: F401
import decentral.worker  # noqa: F401
import decentral.cli  # noqa: F401
from decentral.__main__ import run
from decentral.swarm import wire


def reap() -> None:
    """Report every worker that ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        print(f"exited {pid} {os.waitstatus_to_exitcode(status)}", flush=True)


def become_worker(request: dict, selector: selectors.BaseSelector) -> None:
    """In the forked child: the request's output, folder and environment, then `decentral` itself; the
    interpreter exits as a `python -m decentral` process does (atexit handlers, threads joined)."""
    selector.close()
    for fd, path in ((1, request["log"]), (2, request.get("err", request["log"]))):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(opened, fd)
        os.close(opened)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    wire.LINK = wire.LinkShaper.from_env()  # the one setting our imports read from the environment
    MPFuture.reset_backend()  # hivemind's process-shared locks, made at its import: this worker's own, as in a
    # fresh interpreter (shared with every worker forked here, one that died holding one blocked all later ones)
    sys.argv = ["decentral", *request["argv"]]
    sys.exit(run())


def serve() -> None:
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    pending = b""
    while True:
        if selector.select(timeout=0.05):
            data = os.read(0, 1 << 16)
            if not data:
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    become_worker(request, selector)  # never returns
                print(f"started {pid}", flush=True)
        reap()


if __name__ == "__main__":
    serve()
