"""`python -m decentral` (and `torchrun -m decentral`), and the `decentral` command: decentral.cli's `main`."""

import gc
import sys


def run() -> int:
    """decentral.cli's `main`; exit code 130 when Ctrl-C comes while its imports (torch's) still load.

    What lives as long as the process is kept out of the garbage collector's walks (`gc.freeze`): the objects
    the imports made (the collector off while they run), then, whatever the command ends with, every object
    before the interpreter exits. Collections walked all the objects torch and hivemind made: 0.1 CPU seconds
    of each start, and 0.7 of the 0.8 a `decentral train` process took to exit here. Shutdown still closes
    what is open and tears down modules' objects."""
    gc.disable()
    try:
        from decentral.cli import main
    except KeyboardInterrupt:
        return 130
    finally:
        gc.freeze()
        gc.enable()
    try:
        return main()
    finally:
        gc.freeze()


if __name__ == "__main__":
    sys.exit(run())
