"""Hand a peer's current outer state (slow weights, momentum, round) to a newcomer.

The donor serves an immutable snapshot that its protocol replaces after every outer step, so serving
never waits on training or averaging (the blocking that hivemind issue #445 describes). Newcomers
pick a random donor among the most advanced peers, not always the same one (hivemind issue #169).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import Callable

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from decentral.swarm.peer import SwarmPeer
from decentral.swarm.wire import read_frame, read_message, write_frame, write_message

log = logging.getLogger(__name__)

Snapshot = tuple[dict, dict[str, torch.Tensor]]


class StateExchange:
    """Serve our snapshot on the `state` stream and download others'."""

    def __init__(self, peer: SwarmPeer):
        self.peer = peer
        self._snapshot: Snapshot | None = None
        peer.add_handler("state", self._on_request)

    def offer(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Make (meta, tensors) what we hand out; the tensors must not be modified afterwards."""
        self._snapshot = (dict(meta), tensors)

    async def _on_request(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frame(reader, self.peer.stats)
        snapshot = self._snapshot
        if snapshot is None:
            await write_message(writer, {"ok": False}, b"", self.peer.stats)
            return
        meta, tensors = snapshot
        payload = await asyncio.get_running_loop().run_in_executor(None, save_tensors, tensors)
        await write_message(writer, {"ok": True, "meta": meta}, payload, self.peer.stats)

    async def _download(self, donor: str) -> Snapshot | None:
        reader, writer = await self.peer.open_stream(donor, "state")
        try:
            await write_frame(writer, json.dumps({}).encode(), self.peer.stats)
            header, payload = await read_message(reader, self.peer.stats)
        finally:
            writer.close()
        if not header.get("ok"):
            return None
        return dict(header["meta"]), load_tensors(payload)

    def fetch(self, candidates: dict[str, dict], timeout: float) -> tuple[str, Snapshot] | None:
        """Download a snapshot from one of `candidates` ({peer: {"round": r}}), most advanced first.

        Returns (donor, snapshot), or None when no candidate could serve one within `timeout` each.
        """
        order = [p for p in candidates if p != self.peer.peer_id]
        random.shuffle(order)
        order.sort(key=lambda p: -int(candidates[p].get("round", 0)))
        for donor in order:
            try:
                got = self.peer.call(asyncio.wait_for(self._download(donor), timeout)).result()
            except Exception as e:
                log.warning("state download from %s failed: %r", donor[-8:], e)
                continue
            if got is not None:
                return donor, got
        return None
