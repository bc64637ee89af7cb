"""Average one flat tensor within a group of peers: reduce-scatter, then all-gather, over direct streams.

Peer j of the sorted group owns chunk j. Phase 1: every peer pushes chunk j of its tensor to peer j,
which averages what arrived (weighted). Phase 2: peer j pushes its averaged chunk to everyone. Each
peer sends 2(k-1)/k of the tensor, the bandwidth optimum of an all-reduce.

Nothing received is trusted: every part is checked (size, finite values, norm bound relative to our
own part) and a bad part is dropped, never applied. A peer that is dead or late costs at most the
round's timeout; where a chunk's average did not come back, our own values stand for that chunk and
the result says it is incomplete. Phase 1 waits at most `timeout`; phase 2 ends by then too, or
`timeout / 2` after phase 1 if that is later, so one average never takes longer than 1.5 × timeout.

Peers derive the group from their own view of the swarm, and under load two views can differ. Every
push carries a fingerprint of its sender's group: a part averaged over another member list is
rejected (its chunk boundaries and owners differ from ours, even when its size matches), and a peer
that receives a push from outside its own group answers with a notice, so nobody waits for a peer
that left them out.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections import OrderedDict

import torch

from decentral.transport import AverageResult
from decentral.swarm.mailbox import Mailbox, Message
from decentral.swarm.peer import SwarmPeer
from decentral.swarm.wire import WIRE_DTYPES, WireError, read_frame, read_message, tensor_from_bytes, tensor_to_bytes, write_frame, write_message

log = logging.getLogger(__name__)

_ACK = b"\x01"
_REMEMBERED_VIEWS = 64  # recent averages whose group we still tell late outsiders about


def view_fingerprint(group: list[str]) -> str:
    """A short id of a member list; equal on every peer that derived the same list."""
    return hashlib.sha256(",".join(sorted(group)).encode()).hexdigest()[:16]


def check_part(received: torch.Tensor, reference: torch.Tensor, max_norm_ratio: float) -> str | None:
    """Why `received` may not stand in for `reference` (None when it may): size, finiteness, norm bound."""
    if received.numel() != reference.numel():
        return f"wrong size: {received.numel()} elements, expected {reference.numel()}"
    if not bool(torch.isfinite(received).all()):
        return "non-finite values"
    floor = 1e-3 * math.sqrt(max(reference.numel(), 1))
    limit = max_norm_ratio * max(float(reference.norm()), floor)
    norm = float(received.norm())
    if norm > limit:
        return f"norm {norm:.3g} exceeds the bound {limit:.3g} ({max_norm_ratio}x our own)"
    return None


def _quantize(tensor: torch.Tensor, wire_dtype: str) -> torch.Tensor:
    """Round to the wire precision, so our own contribution matches what the others receive."""
    return tensor.to(WIRE_DTYPES[wire_dtype]).to(torch.float32)


class GroupAverager:
    """Serves the `push` stream of a peer and runs group averages on its event loop."""

    def __init__(self, peer: SwarmPeer, *, wire_dtype: str = "float32", max_norm_ratio: float = 100.0):
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {sorted(WIRE_DTYPES)}, got {wire_dtype!r}")
        self.peer = peer
        self.wire_dtype = wire_dtype
        self.max_norm_ratio = max_norm_ratio
        self.mailbox: Mailbox = peer.call(_make_mailbox()).result(timeout=10)
        # tag of an average -> (its group, the loop time its pushes stop, outsiders already told)
        self._groups: OrderedDict[str, tuple[frozenset[str], float, set[str]]] = OrderedDict()
        self._notices: set[asyncio.Task] = set()  # in flight; the loop keeps only weak references to tasks
        peer.add_handler("push", self._on_push)

    async def _on_push(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        header, payload = await read_message(reader, self.peer.stats)
        try:
            tensor = tensor_from_bytes(payload, str(header.get("wire")))
            tag, value, view = str(header["tag"]), float(header["value"]), str(header.get("view", ""))
        except (WireError, KeyError, TypeError, ValueError) as e:
            log.warning("dropping a malformed push from %s: %s", sender, e)
            return
        if not math.isfinite(value) or value <= 0:
            log.warning("dropping a push from %s with weight %r", sender, value)
            return
        await self.mailbox.put(tag, Message(sender, value, tensor, view))
        await write_frame(writer, _ACK, self.peer.stats)
        self._notice_outsiders(tag.rpartition("/")[0])

    def _notice_outsiders(self, tag: str) -> None:
        """Tell every peer that pushed to average `tag` with us, but is not in our group for it, that we
        will send it nothing (it stops waiting for us)."""
        if tag not in self._groups:
            return
        group, deadline, told = self._groups[tag]
        pushed = self.mailbox.senders(f"{tag}/r") | self.mailbox.senders(f"{tag}/g")
        for outsider in pushed - group - told:
            told.add(outsider)
            task = asyncio.ensure_future(self._push(outsider, f"{tag}/x", torch.empty(0), 1.0, deadline))
            self._notices.add(task)
            task.add_done_callback(self._notices.discard)

    def _remember_group(self, tag: str, group: list[str], deadline: float) -> None:
        self._groups[tag] = (frozenset(group), deadline, set())
        while len(self._groups) > _REMEMBERED_VIEWS:
            self._groups.popitem(last=False)

    async def _push(
        self, target: str, tag: str, tensor: torch.Tensor, value: float, deadline: float, view: str = ""
    ) -> bool:
        """Deliver `tensor` with a positive scalar `value` (a weight, or a contributor count) to `target`."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(max(deadline - loop.time(), 0.001)):
                reader, writer = await self.peer.open_stream(target, "push")
                try:
                    header = {"tag": tag, "value": value, "wire": self.wire_dtype, "view": view}
                    await write_message(writer, header, tensor_to_bytes(tensor, self.wire_dtype), self.peer.stats)
                    return await read_frame(reader, self.peer.stats) == _ACK
                finally:
                    writer.close()
        except Exception as e:  # dead, unreachable or too slow: the round goes on without it
            log.info("push %s to %s failed: %r", tag, target[-8:], e)
            return False

    async def average(
        self, flat: torch.Tensor, group: list[str], tag: str, weight: float, timeout: float
    ) -> AverageResult:
        """Weighted mean of `flat` over `group` (sorted peer ids including ours). Never raises for peer failures."""
        me = self.peer.peer_id
        if me not in group:
            raise ValueError("this peer is not in the group it was asked to average with")
        group = sorted(group)
        view = view_fingerprint(group)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        own = list(torch.tensor_split(_quantize(flat.detach().float().reshape(-1).cpu(), self.wire_dtype), len(group)))
        mine = group.index(me)
        others = [p for p in group if p != me]
        rejected: dict[str, str] = {}
        self._remember_group(tag, group, loop.time() + 1.5 * timeout)
        self._notice_outsiders(tag)  # outsiders whose pushes arrived before we started

        def other_views(messages: dict[str, Message]) -> set[str]:
            """Senders that split by another member list: their parts are rejected, and they will not send
            us the parts we expect either, so we do not wait for them."""
            split = {p for p, msg in messages.items() if msg.view != view}
            for p in split:
                rejected[p] = "averages over another member list (its view of the swarm differs from ours)"
            return split

        # phase 1: reduce-scatter
        sends = [asyncio.ensure_future(self._push(p, f"{tag}/r", own[group.index(p)], weight, deadline, view))
                 for p in others]
        received = await self.mailbox.collect(f"{tag}/r", set(others), deadline, unless=f"{tag}/x")
        elsewhere = other_views(received) | self.mailbox.senders(f"{tag}/x")  # those left us out
        total, weights = own[mine] * weight, weight
        for sender, msg in received.items():
            if sender in elsewhere:
                continue
            reason = check_part(msg.tensor, own[mine], self.max_norm_ratio)
            if reason:
                rejected[sender] = reason
                continue
            total += msg.tensor * msg.value
            weights += msg.value
        my_contributors = 1 + len(received) - len(rejected)
        averaged_mine = _quantize(total / weights, self.wire_dtype)

        # phase 2: all-gather; peers that waited out a dead one in phase 1 still get time to swap results
        deadline = max(deadline, loop.time() + timeout / 2)
        sends += [asyncio.ensure_future(self._push(p, f"{tag}/g", averaged_mine, my_contributors, deadline, view))
                  for p in others if p not in elsewhere]
        gathered = await self.mailbox.collect(f"{tag}/g", set(others) - elsewhere, deadline, unless=f"{tag}/x")
        elsewhere |= other_views(gathered)
        parts, counts = list(own), [1] * len(group)
        parts[mine], counts[mine] = averaged_mine, my_contributors
        for sender, msg in gathered.items():
            if sender in elsewhere:
                continue
            j = group.index(sender)
            reason = check_part(msg.tensor, own[j], self.max_norm_ratio)
            if reason:
                rejected[sender] = reason
                continue
            parts[j], counts[j] = msg.tensor, int(msg.value)
        await asyncio.gather(*sends)
        for sender, reason in rejected.items():
            log.warning("rejected data from %s in %s: %s", sender[-8:], tag, reason)
        return AverageResult(
            tensor=torch.cat(parts) if parts else flat.float().reshape(-1),
            group=group,
            complete=min(counts) == len(group),
            contributors=min(counts),
            rejected=rejected,
        )


async def _make_mailbox() -> Mailbox:
    return Mailbox()  # created on the loop it will serve
