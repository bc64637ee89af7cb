"""No synchronisation at all: each worker trains alone.

The compute reference of benchmarks (what the same processes do with no communication), and the
training mode of independent experts.
"""

from decentral.sync.base import SyncProtocol


class Local(SyncProtocol):
    name = "local"
    syncs_parameters = False
