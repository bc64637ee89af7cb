"""Average one flat tensor within a group of peers: reduce-scatter, then all-gather, over direct streams.

Peer j of the sorted group owns chunk j. Phase 1: every peer pushes chunk j of its tensor to peer j,
which averages what arrived. Phase 2: peer j pushes its averaged chunk to everyone. Each peer sends
2(k-1)/k of the tensor, the bandwidth optimum of an all-reduce, in the swarm's codec
(decentral.codec): each chunk is encoded on its own, every part decoded and averaged in float32,
and the owner's average encoded again, so every member holds what the owner's encoding decodes to (and,
once committed, that encoding, `AverageResult.encoded`, which a newcomer may replay: decentral.rounds).
With a codec that drops most of a tensor (`error_feedback`), the owner's re-encoding drops entries of
the average too: every member counts its part only where the result kept a value (`kept`), so what the
re-encoding dropped of a member's part stays in that member's own error feedback, and the owner counts
its own part as `fold_owner_error` says, so that it also carries the rounding of the values kept. What
the average counted of each member (`AverageResult.sent`: its part as the owner clipped it, see below)
has the result as its exact mean, and the
error feedback keeps everything the codecs lost, each member its own. Every member counts once: weights
are the protocol's to fix, not a sender's to claim. Phase 3 (commit): members swap a digest of every
chunk they hold; the average stands only if we hold every chunk averaged over the whole group and
every member that answered holds exactly our result, else it is rolled back (our input comes back
unchanged), so replicas never split on a partial round.

Nothing received is trusted:
- a push's header is read first (at most 64 KiB), and its payload only when the element count it
  announces fits what this peer averages (`max_part_numel`), and within `read_timeout`;
- pushes from a peer without a live heartbeat are refused unread, and each sender has at most 16
  tags waiting in the mailbox, so a flood from one peer never erases another's parts;
- every part is checked for size and finite values, and clipped to a norm bound relative to the
  group: `max_norm_ratio` times the lower median of the norms of that chunk's parts (ours included;
  for a pair, the smaller of the two). A part at −99× the honest update counts as one at 2× (the default), so one
  member moves a chunk's mean by at most ratio × median / k. Clipping, not rejection, because an
  honest loss spike must not get a peer excluded;
- a chunk owner's result comes with the norms of the parts it averaged; it is refused when it
  misreports our part, exceeds the bound its own norms imply, or is longer than those parts can
  make it; and the commit digests catch an owner that sends different results to different members;
- `aggregation="trimmed"` drops the largest and smallest value of every coordinate in groups of 3
  or more (a median for 3), so one member's values cannot move the result beyond the others' range;
- a member whose data is rejected (malformed, non-finite, a refused result) is excluded from every
  later average of this peer (a warning says why): its pushes are refused, and the average is redone
  without it.

A peer that is dead or late costs at most the round's timeout, and a peer whose process is gone costs
next to nothing: a push to it, or a probe (`ping`, every `probe_s` while we wait for it), finds its
address refusing the connection, and we stop waiting for it. A stream that closes unanswered is asked
again on a fresh one, at once and then after `ASK_AGAIN_AFTER_S` (a connection between two live
processes can reset, and a reset closes every connection between them, so a stream opened meanwhile may
land on one that is closing; and under load a single stream between two live processes can end
unanswered while their connection stays up: one or two of some 3,000 pushes among six workers on two
cores, p2pd's debug log showing no connection closed or dialled; the fresh dial to a dead one is
refused), and only a third closed stream counts. The same for a member that says it takes no part in
the average: a restarted process whose first round is later, one that serves no averaging yet, one more
rounds behind than its protocol lets a member in step lead (`rounds_ahead`; woken from a freeze, it trains
a round the others finished without it: they do not wait for it to train through it), one that has
finished this average already, or one that averages it over a member list without us ("left out").
A probe that merely times out proves nothing on a congested link, but a member that shows no sign of
life at all for `hang_s` (no answer to our probes, no probe of its own, no byte of a part: a frozen
process, a host powered down or cut off) is taken for gone too (a member whose new dials libp2p holds back
while its address accepts a plain connection shows one: its connection reset); the bytes of a large part are watched as
they arrive, so a part that takes long on a slow link keeps its sender alive. Parts still arriving when
the attempt's time runs out make it roll back like any missing part, with a warning that the link is too
slow for the timeout at this size (`_tell_if_too_slow`). When the average did not
commit, it is redone once without every member that was absent (gone, or silent past a phase's deadline:
a member frozen or too slow for this average), averaged over another member list or was excluded, so the
others still commit a common result; a member a probe found done with the average is not absent (it may
be redoing it too). Phase 1 waits at most `timeout`; phase 2 ends by then too, or
`timeout / 2` after phase 1 if that is later; phase 3 by then, or `timeout / 4` after phase 2. A member
silent through phase 1 leaves our chunk without its part, so the average cannot commit: phases 2 and 3
are skipped and it is redone without that member at once (a frozen member costs `hang_s`, and
`2 * probe_s` in each later average while it is still listed and still silent). So
too when we lack a member's part for any other reason (it is gone, averages over another member list,
or sent data we rejected): every member that lacks one goes straight to the redo. A member found gone
(its address refused our part, or it takes no part in the round) ends phase 1 at once, without waiting
for the others' parts, and our parts still on their way are no longer sent: every member finds it gone
the same way, and they meet in the redo (a killed member used to cost each survivor the first attempt's
exchange after the slowest member arrived, then the redo's). A push that reaches a member done with the
attempt is answered so (`_DONE`, as a probe is): its sender does not take it for absent, and they redo
together; a member the redo left out (it was absent, or late) is answered "left out" (a protocol that keeps
replicas identical then takes the others' state at once, not a round later). A member still waiting in the
first attempt when another's part of the redo reaches it stops waiting (the attempt cannot commit) and
redoes it too, without the members silent to it that the redo goes without (a redo's parts name them):
two members' views of a peer that woke as one's probe gave up on it can differ, and the one still waiting
would otherwise wait out its timeout while the other's redo waited out it; and a member merely late to it
(its part not in yet, under load) stays in, as in the redo it meets.

Peers derive the group from their own view of the swarm, and under load two views can differ. Every
push carries a fingerprint of its sender's group: a part averaged over another member list is
rejected (its chunk boundaries and owners differ from ours, even when its size matches), and a peer
that receives a push from outside its own group answers with a notice, so nobody waits for a peer
that left them out.

A committed average names the member that held it up longest (`AverageResult.held_by`, `held_up`): in each
of phases 1 and 2, the member whose message reached us last (we, when ours reached the others last) held
that phase up by the time since the one before it; a member behind a slow uplink, or one that began late,
stands out over the rounds.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable

import torch
from hivemind.p2p import P2PDaemonError

from decentral.swarm.mailbox import Mailbox, Message
from decentral.swarm.peer import DialHeldBack, NotServing, SwarmError, SwarmPeer
from decentral.swarm.wire import (
    WireError, read_frame, read_header, write_frame, write_message,
)
from decentral.codec import Codec, CodecError, Dense, fold_owner_error
from decentral.config import HANG_S
from decentral.transport import ROUNDS_AHEAD, AverageResult, EncodedAverage, all_finite, longest_hold

log = logging.getLogger(__name__)

_ACK = b"\x01"
_REFUSED = b"\x00"  # a live peer that will not take our part (it excluded us, or does not know us yet)
_NOT_IN_ROUND = b"\x02"  # this process takes no part in the push's round (an earlier process of its peer id did)
_LEFT_OUT = b"\x03"  # we average (or averaged) the push's average over a member list without the sender
_DONE = b"\x04"  # we are done with this average and send nothing more for it; alive all the same
_PUSH_ANSWERS = (_ACK, _REFUSED, _NOT_IN_ROUND, _LEFT_OUT, _DONE)
_PING_ANSWERS = (_ACK, _NOT_IN_ROUND, _DONE)
ASK_AGAIN_AFTER_S = 0.5  # the pause before a third stream: a reset's closing connections are gone by then
_REMEMBERED_VIEWS = 64  # recent averages whose group we still tell late outsiders about
OTHER_LIST = "averages over another member list (its view of the swarm differs from ours)"  # AverageResult.elsewhere
AGGREGATIONS = ("mean", "trimmed")
DEFAULT_MAX_PART_NUMEL = 1 << 28  # before this peer has averaged anything itself: 1 GiB of float32
_NOTHING = (b"", 0)  # the encoding of an empty tensor in every codec: notices and votes carry no tensor


class _Unreachable(Exception):
    """The peer's address refused the connection: its process is gone."""


class _StreamLost(Exception):
    """A stream to the peer closed without an answer. Its process may be gone, or only the connection
    between us reset (seen under load, between two live processes): a fresh stream tells which."""


def view_fingerprint(group: list[str]) -> str:
    """A short id of a member list; equal on every peer that derived the same list."""
    return hashlib.sha256(",".join(sorted(group)).encode()).hexdigest()[:16]


def check_part(received: torch.Tensor, reference: torch.Tensor) -> str | None:
    """Why `received` may not stand in for `reference` (None when it may): its size, and finite values."""
    if received.numel() != reference.numel():
        return f"wrong size: {received.numel()} elements, expected {reference.numel()}"
    if not all_finite(received):
        return "non-finite values"
    return None


def norm_bound(norms: list[float], ratio: float, numel: int) -> float:
    """`ratio` times the lower median of `norms` (the smaller of a pair), floored at 1e-3 per
    sqrt(element) so that an all-zero chunk does not bound everyone at zero."""
    return ratio * max(sorted(norms)[(len(norms) - 1) // 2], 1e-3 * math.sqrt(max(numel, 1)))


def clip(part: torch.Tensor, norm: float, bound: float) -> torch.Tensor:
    """`part`, whose norm is `norm`, scaled down to norm `bound` when it is longer."""
    return part * (bound / norm) if norm > bound else part


def check_owner_result(result: torch.Tensor, norms: object, mine: int, own_norm: float | None, ratio: float,
                       aggregation: str, members: int) -> str | None:
    """Why a chunk owner's average may not be taken (None when it may). The owner reports the norm of
    each of the `members` parts it averaged, after clipping (it sends a result only once it holds every
    member's part; a part may be all zeros: frozen weights); we check that there is one norm per member,
    that our own entry is not longer than the part we sent, that no part exceeds the clip bound those
    norms imply, and that the result is no longer than such parts can make it (a mean: the longest part;
    a trimmed mean: sqrt(n) times it)."""
    if not (isinstance(norms, list) and len(norms) == members
            and all(isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n) and n >= 0
                    for n in norms)):
        return f"its result came without the norms of the {members} parts it averaged"
    used = [float(n) for n in norms]
    slack = 1 + 1e-2  # rounding to the wire dtype may lengthen a result by its unit roundoff (bfloat16: 0.4%)
    if own_norm is not None and norms[mine] > own_norm * slack + 1e-6:
        return f"it reports our part at norm {norms[mine]:.4g}, we sent {own_norm:.4g}"
    if max(used) > norm_bound(used, ratio, result.numel()) * slack:
        return f"it reports a part at norm {max(used):.4g}, beyond the {ratio}x bound of the others"
    reach = max(used) * (math.sqrt(len(used)) if aggregation == "trimmed" else 1.0)
    if float(result.norm()) > reach * slack + 1e-6:
        return f"its result has norm {float(result.norm()):.4g}, more than its parts ({reach:.4g}) allow"
    return None


def chunk_digest(chunk: torch.Tensor, norms: list[float]) -> str:
    """What members compare after an average: a chunk's bytes and the norms its owner reported."""
    digest = hashlib.sha256(chunk.contiguous().view(torch.uint8).numpy())
    digest.update(repr([round(float(n), 6) for n in norms]).encode())
    return digest.hexdigest()[:24]


def encode_chunks(codec: Codec, flat: torch.Tensor, k: int) -> tuple[list[tuple[bytes, int]], torch.Tensor]:
    """`flat` in k chunks (chunk j goes to member j), each encoded on its own with its element count; and
    `flat` as the chunks' owners decode them, one tensor (chunk j is `torch.tensor_split(it, k)[j]`)."""
    encoded = [(codec.encode(chunk), chunk.numel()) for chunk in torch.tensor_split(flat, k)]
    decoded = torch.empty_like(flat)
    for chunk, e in zip(torch.tensor_split(decoded, k), encoded):
        chunk.copy_(codec.decode(*e))
    return encoded, decoded


def kept(result: torch.Tensor) -> torch.Tensor:
    """1 where a sparse codec's re-encoded average kept a value, 0 where it dropped one: what every
    member holds, so every member derives the same mask."""
    return (result != 0).float()


def aggregate(parts: list[torch.Tensor], how: str) -> torch.Tensor:
    """The mean of `parts`, or with "trimmed" and 3 or more, the mean of each coordinate without its
    largest and smallest value. The mean sums into one buffer: no stacked copy of all parts."""
    if how == "trimmed" and len(parts) >= 3:
        return torch.stack(parts).sort(dim=0).values[1:-1].mean(dim=0)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total.div_(len(parts))



@dataclass
class PhaseTimes:
    """When a phase of an average began for us, when each member's message of it `arrived` to us, and when ours
    was `delivered` to each member (loop times)."""

    began: float
    arrived: dict[str, float] = field(default_factory=dict)
    delivered: dict[str, float] = field(default_factory=dict)

    def last_in(self, me: str) -> tuple[str, float] | None:
        """The member whose message was the last in, and how long after the one before it (the seconds the phase
        would have been shorter without it): each other member's when it arrived, ours when the last member had
        it; none before the phase began for us (a message waiting for us held nothing up). None with fewer than
        two members timed."""
        times = {sender: max(at, self.began) for sender, at in self.arrived.items()}
        if self.delivered:
            times[me] = max(max(self.delivered.values()), self.began)
        if len(times) < 2:
            return None
        (_, before), (last, at) = sorted(times.items(), key=lambda item: item[1])[-2:]
        return last, at - before


def held_up(phases: list[PhaseTimes], me: str) -> tuple[str, float] | None:
    """The member that held an average up longest, and by how long: the sum, over its `phases` (the inputs'
    reduce-scatter, then the results' all-gather), of the seconds each was last in (`PhaseTimes.last_in`). A
    member that began late is last in phase 1; one behind a slow uplink in both, or in phase 2 only when its
    inputs went out before the others began."""
    held: dict[str, float] = {}
    for phase in phases:
        if (last := phase.last_in(me)) is not None:
            held[last[0]] = held.get(last[0], 0.0) + last[1]
    return longest_hold(held.items())


class GroupAverager:
    """Serves the `push` and `ping` streams of a peer and runs group averages on its event loop.

    `is_member(peer_id)` (blocking; run off the loop) says whether a pusher has a live heartbeat; it may
    answer from a lookup up to `member_refresh_s` old. Model-sized work (encoding, decoding, checks, the
    reduction, digests) runs in worker threads, so the loop answers probes at once whatever the model's
    size: a loop stalled for `hang_s` would be taken for a hung peer (measured, 2 peers averaging 2e8
    values in int8: the longest stall 4.1 s with that work on the loop, 0.2 s in threads).
    """

    def __init__(self, peer: SwarmPeer, *, codec: Codec = Dense("float32"), max_norm_ratio: float = 2.0,
                 aggregation: str = "mean", is_member: Callable[[str], bool] | None = None,
                 read_timeout: float = 90.0, probe_s: float = 1.0, hang_s: float = HANG_S, member_refresh_s: float = 1.0):
        if aggregation not in AGGREGATIONS:
            raise SwarmError(f"swarm.aggregation must be one of {list(AGGREGATIONS)}, got {aggregation!r}")
        if not hang_s >= 2 * probe_s:  # a live peer's last answer is about `probe_s` old when we look
            raise SwarmError(f"swarm.hang_s must be at least twice the probe interval ({2 * probe_s}s), got {hang_s}")
        self.peer = peer
        self.codec = codec
        self.max_norm_ratio = max_norm_ratio
        self.aggregation = aggregation
        self.is_member = is_member
        self.read_timeout = read_timeout
        self.probe_s = probe_s
        self.hang_s = hang_s
        self.member_refresh_s = member_refresh_s
        self.max_part_numel = DEFAULT_MAX_PART_NUMEL
        self.first_round: int | None = None  # the first round this process takes part in (see `take_part_from`)
        self.begun: int | None = None  # the latest round we began an average of (or the one before our first)
        self.rounds_ahead = ROUNDS_AHEAD  # we take part in no round more than this many past `begun` (our protocol's)
        self._turned_away: int | None = None  # the latest round whose pushes or probes we answered "not in it"
        self._sized = False  # whether max_part_numel comes from an average of our own yet
        self.banned: dict[str, str] = {}  # peer -> why it is excluded from our averages
        self._heard: dict[str, float] = {}  # peer -> loop time of its last sign of life (see `_probe`)
        self._hung: set[str] = set()  # peers we took for hung that have shown no sign of life since
        # (tag, sender) -> [bytes in, bytes, loop time of the last piece] of the latest parts that began to
        # arrive and are not complete (yet)
        self._partial: OrderedDict[tuple[str, str], list[float]] = OrderedDict()
        self.mailbox: Mailbox = peer.call(_make_mailbox()).result(timeout=10)
        # tag of an average -> (its group, the loop time its pushes stop, outsiders already told)
        self._groups: OrderedDict[str, tuple[frozenset[str], float, set[str]]] = OrderedDict()
        self._finished: OrderedDict[str, None] = OrderedDict()  # averages (tags) we take no more part in
        self._notices: set[asyncio.Task] = set()  # in flight; the loop keeps only weak references to tasks
        peer.add_handler("push", self._on_push)
        peer.add_handler("ping", self._on_ping)

    # ----- serving -----
    async def _on_ping(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A probe asks whether we are there for an average of a round: ACK; _NOT_IN_ROUND when we take no
        part in the round (see `_not_in`); _DONE when we are done with the average (we send nothing more)."""
        try:
            request = await asyncio.wait_for(read_header(reader, self.peer.stats, 1024), self.read_timeout)
        except (WireError, TimeoutError) as e:
            log.debug("a malformed or late probe from %s: %r", sender[-8:], e)
            return
        self._hear(sender)
        tag = request.get("tag")
        answer = (_NOT_IN_ROUND if self._not_in(request.get("round"))
                  else _DONE if isinstance(tag, str) and tag in self._finished else _ACK)
        await write_frame(writer, answer, self.peer.stats)

    def _not_in(self, round: object) -> bool:
        """Whether this process takes no part in `round`: one before the first it takes part in (or any, before
        it joined one): an earlier process under our peer id may have announced it; or one more than
        `rounds_ahead` past the latest we began an average of: the members went on without us (we were frozen,
        or fell behind), and we will not reach it before we take their state. Nobody should wait for us.
        A round we say so of is remembered (`take_part_from`)."""
        if not isinstance(round, int):
            return False
        behind = self.begun is not None and round > self.begun + self.rounds_ahead
        if not behind and self.first_round is not None and round >= self.first_round:
            return False
        self._turned_away = round if self._turned_away is None else max(self._turned_away, round)
        return True

    def take_part_from(self, round: int) -> int:
        """We take part in rounds from `round` on; returns the first we take part in: `round`, or the one after
        the latest we told a member we take no part in (a newcomer whose donor's step was stale can mean to
        join a round a member has already finished: it pushed to us before we joined and went on without us,
        so that round must go on without us for every member, not stall the ones that count on us)."""
        if self._turned_away is not None and round <= self._turned_away:
            log.info("round %d: a member finished it before we joined and heard that we take no part in it; we "
                     "take part from round %d on", round, self._turned_away + 1)
            round = self._turned_away + 1
        self.first_round = round
        self.begun = round - 1 if self.begun is None else max(self.begun, round - 1)
        return round

    async def _on_push(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if sender in self.banned:
            await write_frame(writer, _REFUSED, self.peer.stats)  # the sender stops waiting for us
            return
        if not await self._admits(sender):
            log.info("refusing a push from %s: no live heartbeat in the swarm", sender[-8:])
            await write_frame(writer, _REFUSED, self.peer.stats)
            return
        try:
            async with asyncio.timeout(self.read_timeout):
                header = await read_header(reader, self.peer.stats)
                tag, view, wire = str(header["tag"]), str(header.get("view", "")), str(header["wire"])
                numel = int(header["numel"])
                meta = header.get("meta", {})
                if not isinstance(meta, dict):
                    raise WireError("a push's meta is not an object")
                if not 0 <= numel <= self.max_part_numel:
                    raise WireError(f"a part of {numel} elements (at most {self.max_part_numel} here)")
                if wire != self.codec.name:
                    raise WireError(f"a part in codec {wire!r}; this swarm's is {self.codec.name!r}")
                size = self.codec.size(numel)
                arriving = self._partial[(tag, sender)] = [0, size, asyncio.get_running_loop().time()]
                while len(self._partial) > _REMEMBERED_VIEWS:
                    self._partial.popitem(last=False)

                def piece_in(done: int, total: int) -> None:
                    self._hear(sender)
                    arriving[0], arriving[2] = done, asyncio.get_running_loop().time()

                payload = await read_frame(reader, self.peer.stats, size, on_progress=piece_in)
                if self._partial.get((tag, sender)) is arriving:  # not a later push of the same part's
                    del self._partial[(tag, sender)]
                if len(payload) != size:
                    raise WireError(f"payload of {len(payload)} bytes, the header announced {size}")
        except (WireError, KeyError, TypeError, ValueError, OverflowError, TimeoutError) as e:  # (Overflow:
            log.warning("dropping a malformed or late push from %s: %r", sender[-8:], e)  # "numel": Infinity)
            return
        average = tag.rpartition("/")[0]
        latest = f"{average}/again" if f"{average}/again" in self._groups else average  # a redo's group counts
        if latest in self._groups and sender not in self._groups[latest][0]:
            await write_frame(writer, _LEFT_OUT, self.peer.stats)
            return
        if self._not_in(header.get("round")):
            await write_frame(writer, _NOT_IN_ROUND, self.peer.stats)
            return
        if average in self._finished:
            await write_frame(writer, _DONE, self.peer.stats)
            return
        try:
            part = await asyncio.to_thread(self.codec.decode, payload, numel)
        except CodecError as e:
            log.warning("dropping a malformed push from %s: %r", sender[-8:], e)
            return
        kept = payload if tag.endswith("/g") else None  # an owner's result: a committed average's encoding
        await self.mailbox.put(tag, Message(sender, part, view, meta, kept))
        await write_frame(writer, _ACK, self.peer.stats)

    async def _admits(self, sender: str) -> bool:
        """Whether a push from `sender` may be read: it is in the group of an average we run, or it has a
        live heartbeat. A newcomer's first heartbeat can reach our lookups a moment after its first push,
        so a sender we do not list gets a second look once `is_member` may look again."""
        if self.is_member is None or any(sender in group for group, _, _ in self._groups.values()):
            return True
        loop = asyncio.get_running_loop()
        if await loop.run_in_executor(None, self.is_member, sender):
            return True
        await asyncio.sleep(self.member_refresh_s)
        return await loop.run_in_executor(None, self.is_member, sender)

    def _notice_outsiders(self, tag: str) -> None:
        """Tell every peer that pushed to average `tag` before we began it, but is not in our group for it,
        that we average without it (it stops waiting for us). Later pushes are answered so at once."""
        if tag not in self._groups:
            return
        group, deadline, told = self._groups[tag]
        pushed = self.mailbox.senders(f"{tag}/r") | self.mailbox.senders(f"{tag}/g")
        for outsider in pushed - group - told:
            told.add(outsider)
            task = asyncio.ensure_future(self._push(outsider, f"{tag}/x", _NOTHING, deadline,
                                                    meta={"left_out": True}))
            self._notices.add(task)
            task.add_done_callback(self._notices.discard)

    def _remember_group(self, tag: str, group: list[str], deadline: float) -> None:
        self._groups[tag] = (frozenset(group), deadline, set())
        while len(self._groups) > _REMEMBERED_VIEWS:
            self._groups.popitem(last=False)

    # ----- sending -----
    async def _push(self, target: str, tag: str, encoded: tuple[bytes, int], deadline: float, view: str = "",
                    meta: dict | None = None, round: int | None = None) -> bool:
        """Deliver a tensor (`encoded`: its encoding in our codec and its element count) to `target`; False when
        it did not arrive. When `target` refuses it, takes no part in `round`, or is gone, it will send us
        nothing for this average either: that is noted as a notice under `tag`'s average, so nobody waits
        for it. Gone means its address refuses the connection, or a fresh stream closed unanswered too (`_ask`)."""
        loop = asyncio.get_running_loop()
        average = tag.rpartition("/")[0]  # tag is `average/phase`
        header = {"tag": tag, "wire": self.codec.name, "view": view, "numel": encoded[1],
                  "meta": meta or {}, **({} if round is None else {"round": round})}
        try:
            async with asyncio.timeout(max(deadline - loop.time(), 0.001)):
                answer = await self._ask(target, "push", lambda w: write_message(w, header, encoded[0], self.peer.stats),
                                         _PUSH_ANSWERS)
        except NotServing as e:
            log.info("push %s to %s: %s; not waiting for it", tag, target[-8:], e)
            await self._silent(target, average)
            return False
        except (_Unreachable, _StreamLost) as e:
            log.info("push %s to %s: gone (%s); not waiting for it", tag, target[-8:], e)
            await self._silent(target, average)
            return False
        except Exception as e:  # too slow, or a failure we cannot read: the round goes on without it
            log.info("push %s to %s failed: %r", tag, target[-8:], e)
            return False
        if answer == _ACK:
            return True
        if answer == _LEFT_OUT:
            log.info("push %s to %s: it averages without us; not waiting for it", tag, target[-8:])
            await self._silent(target, average, left_out=True)
        elif answer == _DONE:  # not gone: a redo of this average may count on it
            log.info("push %s to %s: it is done with this average; not waiting for it", tag, target[-8:])
            await self._silent(target, average, done=True)
        else:
            log.info("push %s to %s: %s; not waiting for it", tag, target[-8:], "it takes no part in this round "
                     "(a restarted process, or a newcomer)" if answer == _NOT_IN_ROUND else "refused")
            await self._silent(target, average)
        return False

    async def _ask(self, target: str, name: str, send: Callable[[asyncio.StreamWriter], Awaitable[None]],
                   answers: tuple[bytes, ...]) -> bytes:
        """Open a stream to `target`'s handler `name`, `send` our message on it and return its one-byte
        answer (one of `answers`). A stream that closes unanswered (or answers something else), or that
        libp2p fails to open, is asked again on a fresh one, at once and then after `ASK_AGAIN_AFTER_S`: a
        connection between two live processes can reset, and a fresh dial to a dead one is refused. While
        libp2p holds back dials to a live `target` (DialHeldBack) we ask again every `ASK_AGAIN_AFTER_S`, until the caller's timeout;
        while its address accepts a plain connection that counts as a sign of life (`_hear`): libp2p's
        backoff (5 s and more) outlasts `hang_s`, and two live members whose connection reset would
        otherwise take each other for hung. (A whole process group stopped, daemon included, whose
        connection then closed, has its kernel accept the plain dial too: it costs the timeout, not `hang_s`.)
        _Unreachable when its address refuses the connection; _StreamLost when the third stream closes
        unanswered too; NotServing when it has no handler `name`."""
        pauses = [0.0, ASK_AGAIN_AFTER_S]  # before the second and the third stream
        while True:
            try:
                reader, writer = await self.peer.open_stream(target, name)
            except ConnectionRefusedError as e:
                raise _Unreachable(repr(e)) from e
            except DialHeldBack as e:
                if e.accepted:  # its host answers: a reset between live members (a frozen worker's daemon
                    self._hear(target)  # keeps its connection up, so its dials are not held back)
                log.info("%s to %s: %s; asking again in %.1fs", name, target[-8:], e, ASK_AGAIN_AFTER_S)
                await asyncio.sleep(ASK_AGAIN_AFTER_S)
                continue
            except P2PDaemonError as e:  # libp2p failed to open it ("connect failed": seen right after a reset
                lost = _StreamLost(repr(e))  # between live members): as a stream closed unanswered
            else:
                try:
                    await send(writer)
                    answer = await read_frame(reader, self.peer.stats, 1)
                    if answer in answers:
                        return answer
                    lost = _StreamLost(f"an unknown answer {answer!r}")
                except (asyncio.IncompleteReadError, ConnectionError) as e:
                    lost = _StreamLost(repr(e))
                finally:
                    writer.close()
            if not pauses:
                raise lost
            log.info("%s to %s: the stream closed unanswered (%s); asking on a fresh one", name, target[-8:], lost)
            await asyncio.sleep(pauses.pop(0))

    async def _silent(self, peer: str, tag: str, **why: bool) -> None:
        """`peer` will send nothing more for average `tag`: nobody waits for it there. Without `why` it is
        gone (absent); `left_out=True`: it averages without us; `done=True`: it finished the average
        and is no more absent than we are. A later average asks again (a dead peer's dial is refused at
        once; a restarted one may have joined by then)."""
        await self.mailbox.put(f"{tag}/x", Message(peer, torch.empty(0), meta=why))

    def _hear(self, peer: str) -> None:
        """`peer` showed a sign of life (bytes of a push, a probe, an answer to ours); kept for the members
        of the averages we remember (see `_probe`)."""
        if any(peer in group for group, _, _ in self._groups.values()):
            self._heard[peer] = asyncio.get_running_loop().time()
            self._hung.discard(peer)

    async def _probe(self, peers: list[str], tag: str, round: int | None) -> None:
        """Until cancelled, ping each of `peers` every `probe_s`: one whose end closes is gone; one that
        serves no averaging (yet) or takes no part in `round` (a restarted process) is left out of this
        average; one done with average `tag` (so it sends nothing more, though a part of its never reached
        us) is no longer waited for, but is not absent: a redo counts on it. One that shows no sign of life
        for `hang_s` since we began (no answer to a probe, no probe of its own, no byte of a push: a frozen
        process, a host cut off or powered down) is taken for gone; one we took for hung before and have not
        heard from since, after `2 * probe_s` (a frozen member, still listed until its heartbeat expires,
        costs `hang_s` once, not in every round; once thawed it answers the first probe). A live member
        answers a probe within a round trip even while it trains or is slow to reach the average, and on
        a congested link the bytes of its parts keep arriving; a probe that merely times out proves
        nothing on its own."""
        request = json.dumps({"tag": tag, **({} if round is None else {"round": round})}).encode()
        began = asyncio.get_running_loop().time()

        async def ping(peer: str) -> None:
            try:
                async with asyncio.timeout(2 * self.probe_s):
                    answer = await self._ask(peer, "ping", lambda w: write_frame(w, request, self.peer.stats),
                                             _PING_ANSWERS)
                self._hear(peer)
                if answer == _NOT_IN_ROUND:
                    await self._silent(peer, tag)
                elif answer == _DONE:  # not gone: a redo of this average may count on it
                    await self._silent(peer, tag, done=True)
            except (NotServing, _Unreachable, _StreamLost, ConnectionError):
                await self._silent(peer, tag)
            except Exception as e:  # a timeout alone proves nothing on a congested link
                log.debug("ping %s: %r", peer[-8:], e)

        pinging: dict[str, asyncio.Task] = {}  # at most one probe in flight per peer
        try:
            while True:
                await asyncio.sleep(self.probe_s)
                now, gone = asyncio.get_running_loop().time(), self.mailbox.senders(f"{tag}/x")
                for peer in peers:
                    if peer in gone:
                        continue
                    quiet = now - max(began, self._heard.get(peer, began))
                    hung_before = peer in self._hung  # and silent since
                    if quiet >= (2 * self.probe_s if hung_before else self.hang_s):
                        log.info("%s: no sign of life from %s for %.1fs (no answer to our probes, no bytes)%s; "
                                 "taken for hung, not waiting for it", tag, peer[-8:], quiet,
                                 " nor since we took it for hung before" if hung_before else "")
                        self._hung.add(peer)
                        await self._silent(peer, tag)
                    elif peer not in pinging or pinging[peer].done():
                        pinging[peer] = asyncio.ensure_future(ping(peer))
        finally:
            for task in pinging.values():
                task.cancel()

    def _ban(self, peer: str, reason: str) -> None:
        if peer not in self.banned:
            log.warning("excluding %s from every later average: %s", peer, reason)
            self.banned[peer] = reason

    # ----- averaging -----
    async def average(self, flat: torch.Tensor, group: list[str], tag: str, timeout: float,
                      round: int | None = None, note: dict | None = None) -> AverageResult:
        """Mean of `flat` over `group` (peer ids including ours). Never raises for peer failures.

        `round`, when given, travels with every push: a member that takes no part in it (a restarted
        process whose predecessor announced it, or a newcomer that missed it: its `first_round` is
        later) says so at once, and the average is redone without it. When we take no part in `round`
        ourselves (`take_part_from`), our input comes back at once, rolled back, and the other members as
        having averaged without us (`left_out`: a protocol that keeps replicas identical takes their state).

        Excluded members are left out (every member saw them misbehave, so every member leaves them out).
        When the average does not commit and members were absent, elsewhere (another member list) or
        excluded, it is redone once without them (`tag/again`), so the others commit a common result
        rather than roll back; those who did commit answer a redo's pushes with "no part in it", so a
        member that redoes alone finds out at once. A member that averages without us answers our
        pushes "left out" (`AverageResult.left_out`). `note` travels in the header of each of our phase-1
        parts; an average that commits counted every member's part, so it hands each member the same notes."""
        if self.peer.peer_id not in group:
            raise ValueError("this peer is not in the group it was asked to average with")
        flat = flat.detach().float().reshape(-1).cpu()
        if round is not None:
            self.begun = round if self.begun is None else max(self.begun, round)
        if self._not_in(round):  # see `take_part_from`: the members average it without us
            log.info("%s: we take no part in round %d; not averaging", tag, round)
            self._finish(tag)
            others = sorted(p for p in group if p != self.peer.peer_id)
            return AverageResult(flat, flat, sorted(group), False, 1, absent=others, left_out=others)
        alive = [p for p in group if p not in self.banned]
        result = await self._average_once(flat, alive, tag, timeout, round, note)
        dropped = [p for p in alive if p in result.absent or p in result.rejected or p in self.banned]
        if not result.complete and dropped and len(alive) - len(dropped) >= 2:
            log.info("%s: redoing the average without %d member(s) absent, elsewhere or excluded", tag, len(dropped))
            self._finish(tag)
            survivors = [p for p in alive if p not in dropped]
            retry = await self._average_once(flat, survivors, f"{tag}/again", timeout, round, note, dropped)
            result = replace(retry, rejected={**result.rejected, **retry.rejected},
                             absent=sorted(set(result.absent) | set(retry.absent)),
                             left_out=sorted(set(result.left_out) | set(retry.left_out)),
                             elsewhere=sorted(set(result.elsewhere) | set(retry.elsewhere)))
        self._finish(tag, f"{tag}/again")
        result.rejected.update({p: f"excluded: {self.banned[p]}" for p in group if p in self.banned
                                and p not in result.rejected})
        return result

    def _tell_if_too_slow(self, tag: str, silent: set[str], took: float, timeout: float) -> None:
        """Warn when members we waited out were alive and sending: their parts were still arriving (a piece
        in the last `2 * probe_s`, or cut off on the way) when the attempt's time ran out, so the link is too
        slow for the swarm's timeout at this model's size (every average rolls back, and the members look
        absent). A member that froze mid-part stopped sending long before: not counted."""
        slow = {}
        for phase in "rg":
            for peer, part in self._arriving(f"{tag}/{phase}", sorted(silent)).items():
                slow.setdefault(peer, part)
        if slow:
            peer, (got, size, _) = next(iter(slow.items()))
            log.warning("%s: %d member(s)' parts were still arriving when the average ran out of time (from %s: %.1f "
                        "of %.1f MiB in %.0fs): the link is too slow for swarm.timeout = %gs at this size; raise "
                        "swarm.timeout, or send fewer bytes (swarm.codec)", tag, len(slow), peer[-8:], got / 2**20,
                        size / 2**20, took, timeout)

    def _arriving(self, tag: str, peers: list[str]) -> dict[str, list[float]]:
        """Those of `peers` whose part under `tag` is on its way (a piece of it in the last `2 * probe_s`, or cut
        off on the way): {peer: [bytes in, bytes, loop time of the last piece]}."""
        now, parts = asyncio.get_running_loop().time(), {}
        for peer in peers:
            part = self._partial.get((tag, peer))
            if part and now - part[2] <= 2 * self.probe_s:
                parts[peer] = part
        return parts

    def _finish(self, *tags: str) -> None:
        """We take no more part in these averages: pushes and probes for them are answered so."""
        for tag in tags:
            self._finished[tag] = None
        while len(self._finished) > 4 * _REMEMBERED_VIEWS:
            self._finished.popitem(last=False)

    async def _average_once(self, flat: torch.Tensor, group: list[str], tag: str, timeout: float,
                            round: int | None, note: dict | None, without: list[str] | None = None) -> AverageResult:
        """One attempt at the average of `flat` (flat, float32, on the CPU: see `average`). A redo names the
        members it goes `without` in the header of its phase-1 parts (see `redoing`)."""
        me = self.peer.peer_id
        group = sorted(group)
        view = view_fingerprint(group)
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + timeout
        silent: set[str] = set()  # members that sent nothing, nor word of leaving, before a phase's deadline

        def note_silent(expected: set[str], got: dict) -> None:
            silent.update(expected - set(got) - self.mailbox.senders(f"{tag}/x"))

        def gone() -> set[str]:
            """Members that said (or whose address said) they send nothing for this attempt: without their parts
            it cannot commit. Not those merely done with it, nor those averaging without us: each of the latter
            says so, and we wait for all of them to (`AverageResult.left_out`)."""
            return {p for p, m in self.mailbox.peek(f"{tag}/x").items()
                    if p != me and not m.meta.get("done") and not m.meta.get("left_out")}
        self.max_part_numel = flat.numel() if not self._sized else max(self.max_part_numel, flat.numel())
        self._sized = True
        encoded, decoded = await asyncio.to_thread(encode_chunks, self.codec, flat, len(group))
        own = list(torch.tensor_split(decoded, len(group)))
        mine = group.index(me)
        others = [p for p in group if p != me]
        rejected: dict[str, str] = {}
        wire: list[tuple[bytes, int] | None] = [None] * len(group)  # each chunk of the result as it travelled
        self._remember_group(tag, group, loop.time() + 1.5 * timeout)
        self._notice_outsiders(tag)
        probe = asyncio.ensure_future(self._probe(others, tag, round))

        def redoing() -> set[str]:
            """Members whose part of this average's redo reached us: they gave this attempt up (it cannot commit),
            having waited out members we may still wait for (our view of a member that woke as their probe gave up
            can differ); we stop waiting and meet them in the redo, without the members they redo without that
            are silent to us too (not one merely late to us, nor one whose part is still on its way)."""
            return self.mailbox.senders(f"{tag}/again/r")

        def redone_without() -> set[str]:
            """The members the redoers' parts say they redo without (a redo part that names none: none)."""
            named = [m.meta.get("without") for m in self.mailbox.peek(f"{tag}/again/r").values()]
            return {p for without in named if isinstance(without, list) for p in without if isinstance(p, str)}

        def other_views(messages: dict[str, Message]) -> set[str]:
            """Senders that split by another member list: their parts are rejected, and they will not send
            us the parts we expect either, so we do not wait for them."""
            split = {p for p, msg in messages.items() if msg.view != view}
            for p in split:
                rejected[p] = OTHER_LIST
            return split

        phases: list[PhaseTimes] = []  # of phases 1 and 2, as they begin

        def time_deliveries(targets: list[str], pushes: list[asyncio.Future]) -> None:
            delivered = phases[-1].delivered
            for target, push in zip(targets, pushes):
                push.add_done_callback(lambda f, t=target: delivered.update(
                    {t: loop.time()} if not f.cancelled() and f.exception() is None and f.result() else {}))

        def accept(sender: str, reason: str | None) -> bool:
            if reason:
                rejected[sender] = reason
                self._ban(sender, reason)
            return reason is None

        try:
            # phase 1: reduce-scatter. Parts are clipped to the group's norm bound, ours included.
            meta = {**({"note": note} if note else {}), **({"without": sorted(without)} if without else {})}
            sends = [asyncio.ensure_future(self._push(p, f"{tag}/r", encoded[group.index(p)], deadline, view,
                                                      meta or None, round))
                     for p in others]
            phases.append(PhaseTimes(began))
            time_deliveries(others, sends)
            received = await self.mailbox.collect(f"{tag}/r", set(others), deadline, unless=f"{tag}/x",
                                                  stop=lambda: bool(gone() or redoing()))
            phases[-1].arrived.update({s: m.arrived for s, m in received.items()})
            found_gone, redoers = bool(gone()), redoing()
            if not found_gone:  # else we stopped waiting at once: the parts not in yet are not silent, only late
                quiet = set(others) - redoers
                if redoers:  # a part on its way (a slow link) is not silent either
                    quiet = (quiet & redone_without()) - set(self._arriving(f"{tag}/r", others))
                note_silent(quiet, received)
            elsewhere = other_views(received) | self.mailbox.senders(f"{tag}/x")  # left us out, or gone
            checked = await asyncio.to_thread(lambda: {s: check_part(m.tensor, own[mine]) for s, m in received.items()
                                                       if s not in elsewhere})
            parts = {me: own[mine], **{s: received[s].tensor for s, reason in checked.items() if accept(s, reason)}}
            notes = {s: received[s].meta.get("note") if s != me else note for s in parts}
            sparse = self.codec.error_feedback and self.aggregation == "mean"

            def reduce_chunk() -> tuple[dict[str, float], float, tuple[bytes, int], torch.Tensor, torch.Tensor]:
                """The parts' norms and bound; the mean of our chunk, its encoding and what every member holds
                of it; our own part as that mean counted it."""
                sizes = {s: float(t.norm()) for s, t in parts.items()}
                bound = norm_bound(list(sizes.values()), self.max_norm_ratio, own[mine].numel())
                clipped = [clip(t, sizes[s], bound) for s, t in parts.items()]
                mean = aggregate(clipped, self.aggregation)
                encoded_mean = (self.codec.encode(mean), mean.numel())
                averaged = self.codec.decode(*encoded_mean)
                ours = clip(parts[me], sizes[me], bound)
                if sparse:
                    mask = kept(averaged)
                    ours = fold_owner_error(ours * mask, mean * mask, averaged, len(parts))
                return sizes, bound, encoded_mean, averaged, ours

            sizes, bound, encoded_mine, averaged_mine, counted_mine = await asyncio.to_thread(reduce_chunk)
            for sender in sizes:
                if sizes[sender] > bound and sender != me:
                    log.info("%s: clipped the part from %s to the group's bound %.3g", tag, sender[-8:], bound)
            counted = list(own)  # our input as the average counted it (for a sparse codec: after phase 2)
            counted[mine] = counted_mine
            elsewhere |= set(self.banned)  # members we just excluded: we refuse their pushes from now on
            part_missing = len(parts) < len(group)
            received = checked = parts = None  # averaged: their memory is free for the gather's chunks

            if part_missing:  # a member's part is missing (silent, gone, elsewhere or rejected): no
                # member can hold the group's whole mean of our chunk, so the average cannot commit; we skip phases
                # 2 and 3 (their bytes and round trips) and it is redone without that member. When a member is
                # gone, or another redoes the average already, our parts still on their way are of no use to anyone
                # either: we stop sending them (their receivers find it gone as we did, and a probe finds us done
                # with the attempt), so the redo's parts get the link at once (and a part to a frozen member does
                # not hold us until it wakes). Not for data we rejected: a receiver learns what is wrong with the
                # sender's data from its own part of it, which may reach it only after ours
                if found_gone or redoers:
                    for send in sends:
                        send.cancel()
                result, counts, disagree = list(own), [1] * len(group), []
            else:
                # phase 2: all-gather; peers that waited out a dead one in phase 1 still get time to swap results
                my_norms = [min(sizes[p], bound) for p in group]  # (every member's part is in: none is missing)
                deadline = max(deadline, loop.time() + timeout / 2)
                owners = [p for p in others if p not in elsewhere]
                phases.append(PhaseTimes(loop.time()))
                results = [asyncio.ensure_future(self._push(p, f"{tag}/g", encoded_mine, deadline, view,
                                                            {"norms": my_norms}, round)) for p in owners]
                time_deliveries(owners, results)
                sends += results
                gathered = await self.mailbox.collect(f"{tag}/g", set(others) - elsewhere, deadline, unless=f"{tag}/x")
                phases[-1].arrived.update({s: m.arrived for s, m in gathered.items()})
                note_silent(set(others) - elsewhere, gathered)
                elsewhere |= other_views(gathered)
                result, counts, norms = list(own), [1] * len(group), [[] for _ in group]
                result[mine], counts[mine], norms[mine] = averaged_mine, len(sizes), my_norms
                wire[mine] = encoded_mine

                def weigh(sender: str, msg: Message) -> tuple[str | None, list[float], torch.Tensor | None]:
                    """Why an owner's result may not be taken (None when it may), the norms it reports, and our
                    part as it counted it: clipped to the norm it reports for us."""
                    j = group.index(sender)
                    own_norm = float(own[j].norm())
                    reason = check_part(msg.tensor, own[j]) or check_owner_result(
                        msg.tensor, msg.meta.get("norms"), mine, own_norm, self.max_norm_ratio, self.aggregation,
                        len(group))
                    if reason:
                        return reason, [], None
                    reported = [float(n) for n in msg.meta["norms"]]
                    ours = clip(own[j], own_norm, reported[mine])
                    return None, reported, ours * kept(msg.tensor) if sparse else ours

                candidates = {s: m for s, m in gathered.items() if s not in elsewhere and s not in self.banned}
                weighed = await asyncio.to_thread(lambda: {s: weigh(s, m) for s, m in candidates.items()})
                for sender, (reason, reported, ours) in weighed.items():
                    if accept(sender, reason):
                        j = group.index(sender)
                        result[j], norms[j], counted[j] = candidates[sender].tensor, reported, ours
                        wire[j] = (candidates[sender].payload, result[j].numel())
                        counts[j] = len(reported)  # (one per member, check_owner_result: it averaged every part)

                # phase 3: commit. Members swap digests of the chunks they hold; the average stands only where
                # every member that answered holds exactly what we hold.
                digests = await asyncio.to_thread(lambda: [chunk_digest(c, n) if counts[j] == len(group) else None
                                                           for j, (c, n) in enumerate(zip(result, norms))])
                deadline = max(deadline, loop.time() + timeout / 4)
                voters = set(others) - elsewhere
                sends += [asyncio.ensure_future(self._push(p, f"{tag}/c", _NOTHING, deadline, view,
                                                           {"digests": digests}, round))
                          for p in voters]
                votes = await self.mailbox.collect(f"{tag}/c", voters, deadline, unless=f"{tag}/x")
                note_silent(voters, votes)
                disagree = sorted(p for p, msg in votes.items() if msg.meta.get("digests") != digests)
                for p, msg in votes.items():  # an owner whose own digest is not what it sent us lied to us
                    theirs = msg.meta.get("digests")
                    j = group.index(p)
                    if (isinstance(theirs, list) and len(theirs) == len(group) and digests[j] is not None
                            and theirs[j] != digests[j]):
                        accept(p, "its chunk's digest differs from the chunk it sent us")
            await asyncio.gather(*sends, return_exceptions=True)  # cancelled ones: see above
        finally:
            probe.cancel()
        notices = self.mailbox.peek(f"{tag}/x")
        done = {p for p, notice in notices.items() if notice.meta.get("done")}  # may be redoing it: not absent
        absent = sorted((silent | set(group) & set(notices)) - done)
        left_out = [p for p in absent if p in notices and notices[p].meta.get("left_out") is True]
        for sender, reason in rejected.items():
            log.warning("rejected data from %s in %s: %s", sender[-8:], tag, reason)
        self._tell_if_too_slow(tag, silent, loop.time() - began, timeout)
        agreed = min(counts) == len(group) and not disagree
        if disagree:
            log.warning("%s: rolled back: %d member(s) hold another result than ours", tag, len(disagree))
        log.info("%s: %s over %d members in %.1fs%s%s", tag, "committed" if agreed else "rolled back", len(group),
                 loop.time() - began, f"; absent {[p[-8:] for p in absent]}" if absent else "",
                 f"; waited out {[p[-8:] for p in sorted(silent)]}" if silent else "")
        tensor, sent = flat, flat  # rolled back: our input
        if agreed:  # what the average counted of ours is our input as decoded, unless clipped or dropped somewhere
            as_decoded = all(c is o for c, o in zip(counted, own))
            tensor, sent = await asyncio.to_thread(
                lambda: (torch.cat(result), decoded if as_decoded else torch.cat(counted)))
        return AverageResult(
            tensor=tensor,
            sent=sent,
            group=group,
            complete=agreed,
            contributors=min(counts) if agreed else 1,
            rejected=rejected,
            absent=absent,
            disagree=disagree,
            left_out=left_out,
            elsewhere=sorted(p for p, why in rejected.items() if why == OTHER_LIST),
            notes={p: n for p, n in notes.items() if isinstance(n, dict)} if agreed else {},
            encoded=EncodedAverage(self.codec, wire) if agreed else None,
            held_by=held_up(phases, me) if agreed else None,
        )


async def _make_mailbox() -> Mailbox:
    return Mailbox()  # created on the loop it will serve
