"""`python -m decentral` (and `torchrun -m decentral`), and the `decentral` command: decentral.cli's `main`."""

import gc
import sys


def run() -> int:
    """decentral.cli's `main`; exit code 130 when Ctrl-C comes while its imports (torch's) still load.

    Whatever it ends with, every object is frozen out of the garbage collector's reach first (`gc.freeze`):
    the interpreter's shutdown then skips collections that walk all the objects torch and hivemind made
    (0.7 of the 0.8 CPU seconds a `decentral train` process took to exit here); shutdown still closes what
    is open, modules' objects are still torn down."""
    try:
        from decentral.cli import main
    except KeyboardInterrupt:
        return 130
    try:
        return main()
    finally:
        gc.freeze()


if __name__ == "__main__":
    sys.exit(run())
