"""`python -m decentral` (and `torchrun -m decentral`), and the `decentral` command: decentral.cli's `main`."""

import sys


def run() -> int:
    """decentral.cli's `main`; exit code 130 when Ctrl-C comes while its imports (torch's) still load."""
    try:
        from decentral.cli import main
    except KeyboardInterrupt:
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(run())
