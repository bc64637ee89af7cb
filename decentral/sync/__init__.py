"""Outer sync protocols, one file each, all behind `SyncProtocol` (decentral.sync.base)."""

from decentral.sync.base import DivergedError, SyncProtocol, SyncReport
from decentral.sync.co2 import CO2
from decentral.sync.ddp import DDP
from decentral.sync.diloco import DiLoCo
from decentral.sync.local import Local
from decentral.sync.noloco import NoLoCo
from decentral.sync.streaming import StreamingDiLoCo

PROTOCOLS: dict[str, type[SyncProtocol]] = {
    "co2": CO2, "ddp": DDP, "diloco": DiLoCo, "local": Local, "noloco": NoLoCo, "streaming": StreamingDiLoCo,
}

__all__ = ["CO2", "DDP", "DiLoCo", "DivergedError", "Local", "NoLoCo", "PROTOCOLS", "StreamingDiLoCo", "SyncProtocol",
           "SyncReport"]
