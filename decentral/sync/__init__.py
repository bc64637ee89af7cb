"""Outer sync protocols, one file each, all behind `SyncProtocol` (decentral.sync.base)."""

from decentral.sync.base import DivergedError, SyncProtocol, SyncReport
from decentral.sync.ddp import DDP
from decentral.sync.diloco import DiLoCo
from decentral.sync.noloco import NoLoCo

PROTOCOLS: dict[str, type[SyncProtocol]] = {"ddp": DDP, "diloco": DiLoCo, "noloco": NoLoCo}

__all__ = ["DDP", "DiLoCo", "DivergedError", "NoLoCo", "PROTOCOLS", "SyncProtocol", "SyncReport"]
