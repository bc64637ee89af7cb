"""The swarm as a sync protocol sees it: members of a round, group averages, state for newcomers.

`SwarmTransport` is the hivemind-backed implementation of `decentral.sync.base.Transport`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from typing import Sequence

import torch

from decentral.swarm.admission import SwarmKey
from decentral.swarm.averaging import GroupAverager
from decentral.codec import make_codec
from decentral.config import HANG_S, HEARTBEAT_S
from decentral.transport import (
    ROUNDS_AHEAD, AverageResult, EncodedAverage, JoinRequest, MissedRound, check_group, present_for, with_us,
)
from decentral.swarm.membership import Membership
from decentral.swarm.peer import DHT_RPC_TIMEOUT_S, SwarmError, SwarmPeer
from decentral.swarm.state import Snapshot, StateExchange

log = logging.getLogger(__name__)

PEER_POLL_S = 1.0  # the longest `wait_for_peers` waits between looks (half a heartbeat when that is shorter)
# A heartbeat lives at least this long: while a peer hangs, its DHT node does too (Membership), and a beat's
# write and the view's lookup may each wait out a DHT request to it; a shorter life lets live peers' beats
# expire meanwhile, and their views shrink to themselves (measured: rounds of one, timeout 3 s)
HEARTBEAT_STALL_S = 3 * DHT_RPC_TIMEOUT_S


class SwarmTransport:
    """Join (or start) the swarm of run `run` and offer what protocols need.

    timeout: how long an average waits for late or dead peers (one attempt takes at most 1.75x this: its
        gather and commit get timeout/2 and timeout/4 more; a redo without a dead member, as long again);
        also how long a peer's heartbeat stays valid (at least 3 heartbeats, and HEARTBEAT_STALL_S), so a
        dead peer leaves every view within it.
    codec: how averages travel (decentral.codec: float32, float16, bfloat16, int8, int4, topk[:DENSITY]).
    identity_path: a key file that keeps the peer id across restarts (see SwarmPeer).
    max_norm_ratio: every part is clipped to this multiple of the lower median of its chunk's parts'
        norms (ours included), which bounds what one member can move an average by.
    swarm_key: admit only peers holding it (see SwarmPeer).
    aggregation: "mean", or "trimmed" (each coordinate without its largest and smallest value, in groups
        of 3 or more).
    hang_s: a member of an average that shows no sign of life for this long (no answer to a probe, no byte
        of a part) is taken for hung, and the average goes on without it (see GroupAverager._probe).
    """

    def __init__(
        self,
        run: str = "decentral",
        initial_peers: Sequence[str] = (),
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        announce_host: str | None = None,
        timeout: float = 60.0,
        codec: str = "float32",
        max_norm_ratio: float = 2.0,
        aggregation: str = "mean",
        hang_s: float = HANG_S,
        heartbeat_s: float = HEARTBEAT_S,
        lookahead: int = 2,
        identity_path: str | None = None,
        swarm_key: SwarmKey | None = None,
    ):
        try:
            wire_codec = make_codec(codec)
        except ValueError as e:
            raise SwarmError(f"swarm.codec: {e}") from e
        self.timeout = timeout
        self.lookahead = lookahead
        self.peer = SwarmPeer(run, initial_peers, host=host, port=port, announce_host=announce_host,
                              identity_path=identity_path, swarm_key=swarm_key)
        membership = None
        try:  # (a setting refused below left the peer up, beating its heartbeat and serving nothing)
            membership = Membership(self.peer, heartbeat_s=heartbeat_s,
                                    expire_s=max(3 * heartbeat_s, timeout, HEARTBEAT_STALL_S))
            self.averager = GroupAverager(self.peer, codec=wire_codec, max_norm_ratio=max_norm_ratio,
                                          aggregation=aggregation, is_member=membership.is_alive,
                                          read_timeout=1.5 * timeout, hang_s=hang_s)
            self.state = StateExchange(self.peer, live_step=lambda: membership.step, join_timeout=timeout)
        except BaseException:
            if membership is not None:
                membership.close()
            self.peer.shutdown()
            raise
        self.membership = membership

    @property
    def peer_id(self) -> str:
        return self.peer.peer_id

    @property
    def error_feedback(self) -> bool:
        """Whether our codec drops most of what it sends (see Transport.error_feedback)."""
        return self.averager.codec.error_feedback

    @property
    def bytes_sent(self) -> int:
        return self.peer.stats.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.peer.stats.bytes_received

    def multiaddrs(self) -> list[str]:
        return self.peer.multiaddrs()

    def join_rounds(self, round: int, *, first: bool = False, ahead: int = ROUNDS_AHEAD) -> None:
        """We will take part in rounds `round` … `round + lookahead`; announce them. The first call, or
        one with `first`, fixes the first round of this process (pushes for earlier ones are answered
        "not in this round") and returns once the announcements are out; later calls (at round
        boundaries) leave them to the heartbeat thread, so training never waits on the DHT for them.
        `ahead`: see Transport.join_rounds (GroupAverager.rounds_ahead)."""
        self.averager.rounds_ahead = ahead
        joining = first or self.averager.first_round is None
        if joining:
            round = self.averager.take_part_from(round)
        for r in range(round, round + self.lookahead + 1):
            self.membership.announce(r, wait=joining)

    def members(self, round: int) -> list[str]:
        return self.membership.members(round)

    def members_async(self, round: int) -> Future[list[str]]:
        """The DHT reads of `members` in a thread of the swarm's event loop."""
        return self.peer.call(asyncio.to_thread(self.members, round))

    def set_progress(self, step: int, round: int, digest: str | None = None) -> None:
        self.membership.set_progress(step, round, digest)

    def progress(self, max_age_s: float = 0.0) -> dict[str, dict]:
        return self.membership.alive(max_age_s)

    def set_card(self, now: bool = True, **fields) -> None:
        """Fields our heartbeat carries from now on, which the others see in `progress()` (Membership.set_card)."""
        self.membership.set_card(now, **fields)

    def average(self, tensor: torch.Tensor, group: list[str], tag: str, round: int | None = None,
                note: dict | None = None) -> AverageResult:
        """Blocking mean of a flat tensor over `group`; see GroupAverager.average."""
        return self.average_async(tensor, group, tag, round, note).result()

    def average_async(self, tensor: torch.Tensor, group: list[str] | None, tag: str, round: int | None = None,
                      note: dict | None = None) -> Future[AverageResult]:
        """The same average on the swarm's event loop, returning at once (`group` None: the members' lookup,
        a DHT read, runs in a thread of that loop's first)."""
        check_group(group, round)
        return self.peer.call(self._average(tensor, group, tag, round, note))

    async def _average(self, tensor: torch.Tensor, group: list[str] | None, tag: str, round: int | None,
                       note: dict | None) -> AverageResult:
        if group is None:
            members = await asyncio.get_running_loop().run_in_executor(None, self.members, round)
            group = with_us(members, self.peer_id)
        return await self.averager.average(tensor, group, tag, self.timeout, round, note)

    def wait_for_peers(self, count: int, timeout_s: float, round: int = 0) -> None:
        """Block until `count` peers (us included) are there for `round` (decentral.transport.present_for);
        SwarmError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while len(present_for(self, round)) < count:
            if time.monotonic() > deadline:
                raise SwarmError(f"fewer than {count} peers joined within {timeout_s:.0f}s")
            time.sleep(min(self.membership.heartbeat_s / 2, PEER_POLL_S))  # peers announce rounds when ready to train

    def offer_state(self, meta: dict, tensors: dict[str, torch.Tensor], digest: str | None = None,
                    led_by: EncodedAverage | None = None) -> None:
        self.state.offer(meta, tensors, digest, led_by)

    def fetch_rounds(self, donor: str, digest: str, numel: int) -> tuple[list[MissedRound], int] | None:
        """The rounds `donor` kept since the state `digest`, in our codec, in shares from every live peer that
        kept them too (StateExchange.fetch_rounds)."""
        others = [p for p in self.membership.alive() if p not in (donor, self.peer_id)]
        return self.state.fetch_rounds([donor, *others], digest, numel, self.averager.codec, self.timeout)

    def fetch_state(self, have: dict[str, torch.Tensor] | None = None, donors: set[str] | None = None,
                    meta_if_past: bool = False) -> tuple[str, Snapshot] | None:
        """Download outer state from a live peer (one of `donors` when given; most advanced first); None
        when nobody serves one, or when the donor's state is exactly `have` (nothing to download)."""
        candidates = self.membership.alive()
        if donors is not None:
            candidates = {p: info for p, info in candidates.items() if p in donors}
        return self.state.fetch(candidates, timeout=self.timeout, have=have, meta_if_past=meta_if_past,
                                progress=self.membership.alive)

    def request_join(self, donor: str) -> Snapshot | None:
        """Ask `donor` to average with us from its next step (StateExchange.join)."""
        return self.state.join(donor, self.timeout)

    def join_requests(self) -> list[JoinRequest]:
        return self.state.join_requests()

    def close(self) -> None:
        """Leave the swarm, once the state transfers we serve are done (at most `timeout`)."""
        self.state.close(self.timeout)
        self.membership.close()
        self.peer.shutdown()
