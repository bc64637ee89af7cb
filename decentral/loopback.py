"""Peers of one process joined by a `LoopbackHub`: the `Transport` with exact float32 averages and no
network, so the protocols' rules are tested in milliseconds (the real swarm's tests are the
integration tests: decentral.swarm).

Every transport of a hub sees the others' announcements, progress and offers at once. An average is
done when every member of its group has started the same tag with the same group: each then holds
the exact mean. When a member has closed, takes no part in the average's round (its first round is
later: a newcomer, or a replica that rejoined further on; or it began no average of the rounds its
protocol may lead by before it, `join_rounds`' `ahead`: it fell behind), or has not started it within
the hub's `timeout_s`, the average rolls back for those that did (each keeps its own input; `absent` names who
was missing), as a swarm average that cannot commit does.
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from concurrent.futures import Future

import torch

from decentral.codec import Dense
from decentral.rounds import RoundLog
from decentral.transport import (
    ROUNDS_AHEAD, AverageResult, EncodedAverage, JoinRequest, MissedRound, check_group, finished, own_note,
    present_for, state_digest, trained_past, with_digest, with_us,
)

EXACT = Dense("float32")  # how the hub's averages "travel": exactly
LOOKAHEAD = 2  # rounds past the one joined that `join_rounds` announces, as the swarm does


class LoopbackHub:
    """What the transports of one in-process swarm share. `transport()` makes the next peer."""

    def __init__(self, timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._open: set[str] = set()
        self._announced: dict[int, set[str]] = {}
        self._progress: dict[str, dict] = {}
        self._offers: dict[str, tuple[dict, dict[str, torch.Tensor], str]] = {}
        self._pending: dict[tuple[str, tuple[str, ...]], dict[str, tuple[torch.Tensor, Future, dict | None]]] = {}
        self._timers: dict[tuple[str, tuple[str, ...]], threading.Timer] = {}
        self._rounds: dict[tuple[str, tuple[str, ...]], int | None] = {}  # the round of each pending average
        self._first: dict[str, int] = {}  # peer -> the first round it takes part in (join_rounds(first=True))
        self._begun: dict[str, int] = {}  # peer -> the latest round it began an average of (or the one before
        # its first)
        self._ahead: dict[str, int] = {}  # peer -> the most rounds past `_begun` it takes part in (join_rounds' ahead)
        self._rounds_since: dict[str, RoundLog] = defaultdict(RoundLog)  # each donor's, as a swarm peer keeps
        self._joins: dict[str, list[JoinRequest]] = {}  # donor -> newcomers' requests it has not taken yet
        # (only donors that take requests: they called `join_requests`)

    def transport(self) -> LoopbackTransport:
        with self._cond:
            peer = f"loop{next(self._ids):04d}"
            self._open.add(peer)
            self._progress[peer] = {"step": 0, "round": 0, "digests": {}}
            self._cond.notify_all()
        return LoopbackTransport(self, peer)

    # ----- averages -----
    def start_average(self, peer: str, tensor: torch.Tensor, group: list[str], tag: str, round: int | None = None,
                      note: dict | None = None) -> Future[AverageResult]:
        if peer not in group:
            raise ValueError(f"{peer} averages over a group it is not in: {group}")
        flat = tensor.detach().reshape(-1).to(dtype=torch.float32, device="cpu", copy=True)
        members = tuple(sorted(set(group)))
        key = (tag, members)
        future: Future[AverageResult] = Future()
        with self._cond:
            if round is not None:  # an average of our own too, as the swarm's averager counts it
                self._begun[peer] = max(round, self._begun.get(peer, round))
            if members == (peer,):
                return finished(AverageResult(flat, flat.clone(), [peer], True, 1, notes=own_note(peer, note)))
            if self._not_in(peer, round):  # as the swarm's averager: the others average a round we take no part in
                others = [m for m in members if m != peer]  # without us
                return finished(AverageResult(flat, flat.clone(), list(members), False, 1, absent=others, left_out=others))
            started = self._pending.setdefault(key, {})
            if not started:
                timer = self._timers[key] = threading.Timer(self.timeout_s, self._give_up, (key,))
                timer.daemon = True
                timer.start()
                self._rounds[key] = round
            started[peer] = (flat, future, note)
            self._settle(key)
        return future

    def _settle(self, key: tuple[str, tuple[str, ...]], give_up: bool = False) -> None:
        """Finish average `key` when every member started it (the mean), or roll it back for those that
        did when a member is closed or takes no part in its round, or on `give_up` (under the lock)."""
        started, members = self._pending.get(key), key[1]
        if started is None:
            return
        missing = [m for m in members if m not in started]
        if not missing:
            mean = torch.stack([started[m][0] for m in members]).mean(0)
            notes = {m: started[m][2] for m in members if started[m][2]}
            encoded = EncodedAverage(EXACT, [(EXACT.encode(mean), mean.numel())])
            for m in members:
                flat, future, _ = started[m]
                future.set_result(AverageResult(mean.clone(), flat, list(members), True, len(members), notes=dict(notes),
                                                encoded=encoded))
        elif give_up or any(m not in self._open or self._not_in(m, self._rounds[key]) for m in missing):
            for flat, future, _ in started.values():
                future.set_result(AverageResult(flat.clone(), flat, list(members), False, 1, absent=missing))
        else:
            return
        del self._pending[key], self._rounds[key]
        self._timers.pop(key).cancel()

    def _not_in(self, peer: str, round: int | None) -> bool:
        """Whether `peer` takes no part in `round`: one before its first, or more than its protocol's lead
        (`join_rounds`' `ahead`) past the latest it began an average of (as the swarm's averager says)."""
        return round is not None and (round < self._first.get(peer, round)
                                      or round > self._begun.get(peer, round) + self._ahead.get(peer, ROUNDS_AHEAD))

    def take_part_from(self, peer: str, round: int) -> None:
        """`peer` takes part in no round before `round`: averages of earlier rounds that wait for it roll back."""
        with self._cond:
            self._first[peer] = round
            self._begun[peer] = max(round - 1, self._begun.get(peer, round - 1))
            for key in [k for k in self._pending if peer in k[1]]:
                self._settle(key)

    def _give_up(self, key: tuple[str, tuple[str, ...]]) -> None:
        with self._cond:
            self._settle(key, give_up=True)

    # ----- membership, progress, state -----
    def leave(self, peer: str) -> None:
        with self._cond:
            self._open.discard(peer)
            for key in [k for k in self._pending if peer in k[1]]:
                self._settle(key)
            self._cond.notify_all()


class LoopbackTransport:
    """One peer of a `LoopbackHub` (module docstring); made by `LoopbackHub.transport()`.

    Byte counters count each average's tensor once each way, as float32 (there is no wire)."""

    error_feedback = False  # averages are exact

    def __init__(self, hub: LoopbackHub, peer_id: str):
        self.hub, self.peer_id = hub, peer_id
        self.bytes_sent = self.bytes_received = 0

    def join_rounds(self, round: int, *, first: bool = False, ahead: int = ROUNDS_AHEAD) -> None:
        """As the swarm's: the first call, or one with `first`, fixes the first round we take part in."""
        with self.hub._cond:
            self.hub._ahead[self.peer_id] = ahead
            if first or self.peer_id not in self.hub._first:
                for r, peers in self.hub._announced.items():
                    if r < round:
                        peers.discard(self.peer_id)
                self.hub.take_part_from(self.peer_id, round)
            for r in range(round, round + LOOKAHEAD + 1):
                self.hub._announced.setdefault(r, set()).add(self.peer_id)
            self.hub._cond.notify_all()

    def members(self, round: int) -> list[str]:
        with self.hub._cond:
            return sorted(self.hub._announced.get(round, set()) & self.hub._open)

    def members_async(self, round: int) -> Future[list[str]]:
        return finished(self.members(round))

    def set_progress(self, step: int, round: int, digest: str | None = None) -> None:
        with self.hub._cond:
            digests = self.hub._progress[self.peer_id]["digests"]
            if digest is not None:
                digests = with_digest(digests, round, digest)
            self.hub._progress[self.peer_id] = {"step": int(step), "round": int(round), "digests": digests}
            self.hub._cond.notify_all()

    def progress(self, max_age_s: float = 0.0) -> dict[str, dict]:
        with self.hub._cond:
            return {p: dict(self.hub._progress[p]) for p in self.hub._open}

    def set_card(self, now: bool = True, **fields) -> None:
        """Nobody watches a hub: the fields are dropped."""

    def average(self, tensor: torch.Tensor, group: list[str], tag: str, round: int | None = None,
                note: dict | None = None) -> AverageResult:
        return self.average_async(tensor, group, tag, round, note).result()

    def average_async(self, tensor: torch.Tensor, group: list[str] | None, tag: str, round: int | None = None,
                      note: dict | None = None) -> Future[AverageResult]:
        check_group(group, round)
        if group is None:
            group = with_us(self.members(round), self.peer_id)
        if len(set(group)) > 1:
            self.bytes_sent += 4 * tensor.numel()
            self.bytes_received += 4 * tensor.numel()
        return self.hub.start_average(self.peer_id, tensor, group, tag, round, note)

    def wait_for_peers(self, count: int, timeout_s: float, round: int = 0) -> None:
        """Until `count` open transports are there for `round` (decentral.transport.present_for): a peer that
        has not joined yet would otherwise find us trained past the start and skip the steps we did (a sweep's
        worker once joined at round 1)."""
        with self.hub._cond:
            if not self.hub._cond.wait_for(lambda: len(present_for(self, round)) >= count, timeout_s):
                raise TimeoutError(f"fewer than {count} peers joined within {timeout_s:.0f}s")

    def multiaddrs(self) -> list[str]:
        return []

    def offer_state(self, meta: dict, tensors: dict[str, torch.Tensor], digest: str | None = None,
                    led_by: EncodedAverage | None = None) -> None:
        copies = {k: v.detach().clone() for k, v in tensors.items()}
        digest = digest or state_digest(copies)
        with self.hub._cond:
            self.hub._offers[self.peer_id] = (dict(meta), copies, digest)
        self.hub._rounds_since[self.peer_id].offered(meta, digest, led_by, sum(t.nbytes for t in copies.values()))

    def fetch_rounds(self, donor: str, digest: str, numel: int) -> tuple[list[MissedRound], int] | None:
        """The rounds the donor's RoundLog kept since `digest` (it keeps them once it served a state, or was
        asked for them), each an average of `numel` values."""
        with self.hub._cond:
            if donor not in self.hub._open:
                return None
            step_now = self.hub._progress[donor]["step"]
        log = self.hub._rounds_since[donor]
        log.want(digest)  # as a swarm peer does when asked: it keeps the rounds after it from now
        rounds = log.since(digest)
        if rounds is None or any(r.average and sum(n for _, n in r.average.chunks) != numel for r in rounds):
            return None
        return rounds, step_now

    def fetch_state(self, have: dict[str, torch.Tensor] | None = None, donors: set[str] | None = None,
                    meta_if_past: bool = False) -> tuple[str, tuple[dict, dict[str, torch.Tensor]]] | None:
        """The offer of the open peer with the highest round (the lowest id among equals), with `donor_step`
        its step now; None when nobody offers one, or when it is exactly `have` and the donor has not
        trained since; only its meta with `meta_if_past` when the donor trained past it."""
        with self.hub._cond:
            offers = {p: o for p, o in self.hub._offers.items()
                      if p != self.peer_id and p in self.hub._open and (donors is None or p in donors)}
            if not offers:
                return None
            donor = min(offers, key=lambda p: (-int(offers[p][0].get("round", 0)), p))
            meta, tensors, digest = offers[donor]
            step_now = self.hub._progress[donor]["step"]
        past = trained_past(meta, step_now)
        if have is not None and state_digest(have) == digest and not past:
            return None
        if not (meta_if_past and past):
            self.hub._rounds_since[donor].want(digest)
        return donor, ({**meta, "donor_step": step_now},
                       {} if meta_if_past and past else {k: v.clone() for k, v in tensors.items()})

    def request_join(self, donor: str) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """Queue our request with `donor` and wait up to the hub's timeout for what it grants."""
        request = JoinRequest(self.peer_id, Future())
        with self.hub._cond:
            if donor not in self.hub._open or donor not in self.hub._joins:  # it takes no requests
                return None
            self.hub._joins[donor].append(request)
        try:
            return request.answer.result(timeout=self.hub.timeout_s)
        except TimeoutError:
            request.answer.cancel()
            return None

    def join_requests(self) -> list[JoinRequest]:
        """From the first call on, requests to us are queued (before it, refused)."""
        with self.hub._cond:
            taken, self.hub._joins[self.peer_id] = self.hub._joins.get(self.peer_id, []), []
            return taken

    def close(self) -> None:
        self.hub.leave(self.peer_id)
