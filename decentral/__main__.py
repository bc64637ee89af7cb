"""`python -m decentral` (and `torchrun -m decentral`): the `decentral` command line."""

import sys

from decentral.cli import main

sys.exit(main())
