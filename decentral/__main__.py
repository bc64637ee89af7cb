"""`python -m decentral` (and `torchrun -m decentral`), and the `decentral` command: decentral.cli's `main`."""

import gc
import os
import signal
import sys


def run() -> int:
    """decentral.cli's `main`; exit code 130 and one line when Ctrl-C comes while its imports (torch's) still
    load, or before `main` handles it.

    What lives as long as the process is kept out of the garbage collector's walks (`gc.freeze`): the objects
    the imports made (the collector off while they run), then, whatever the command ends with, every object
    before the interpreter exits. Collections walked all the objects torch and hivemind made: 0.1 CPU seconds
    of each start, and 0.7 of the 0.8 a `decentral train` process took to exit here. Shutdown still closes
    what is open and tears down modules' objects."""
    gc.disable()
    try:
        from decentral.cli import main
    except KeyboardInterrupt:
        return _interrupted()
    finally:
        gc.freeze()
        gc.enable()
    try:
        return main()
    except KeyboardInterrupt:  # before `main` handles it itself: while building the parser imports the benches
        return _interrupted()
    except BrokenPipeError:  # `decentral ... | head`: the reader left, and what is left to say is nobody's
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the flush at exit would fail again)
        return 128 + signal.SIGPIPE  # as a program that SIGPIPE ended: a shell's exit code for `| head`
    finally:
        gc.freeze()


def _interrupted() -> int:
    print("decentral: interrupted", file=sys.stderr, flush=True)
    return 130


if __name__ == "__main__":
    sys.exit(run())
