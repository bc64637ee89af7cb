"""The hivemind layer: peers and membership, group averaging, state transfer."""

from decentral.swarm.admission import AdmissionError, SwarmKey
from decentral.swarm.averaging import check_part
from decentral.swarm.peer import SwarmError, SwarmPeer
from decentral.swarm.transport import SwarmTransport

__all__ = ["AdmissionError", "SwarmKey", "SwarmError", "SwarmPeer", "SwarmTransport", "check_part"]
