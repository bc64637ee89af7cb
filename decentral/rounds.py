"""The rounds a peer's state went through, kept so that a newcomer it handed an older state to (or a member
the others averaged a round without) replays them instead of downloading the state again.

A DiLoCo round changes φ and its momentum by one committed average, the same for every member (CO2's by the
round before's, Streaming DiLoCo's by each fragment's in turn), and in the swarm's codec that average is a
fraction of the state (int8: about an eighth of φ and momentum in float32).
A newcomer whose download took several rounds (a large model over a slow link) would find the swarm rounds
ahead of the state it got, and a second download would be as late again. Instead it asks for the averages
of the rounds since (`Transport.fetch_rounds`: on a swarm, in shares from its donor and the peers at the
donor's round, asked to keep them as the download began) and applies them as the members did, bit for bit
(checked against each round's digest).

A peer always keeps the last round (its average, as it travelled: int8, about a quarter of φ's bytes), so
that a member the others averaged without (left out of their member list, or theirs of another) replays it
on the state it began the round with instead of downloading theirs (sync/base.py `_repair`). It keeps more
rounds only while a newcomer may want them: from the state it served (or a newcomer asked after) on, while a
transfer of its state is under way and for KEEP_S after the last request, and never more bytes of averages
than the state itself holds (a replay that long costs more than a download).
"""

from __future__ import annotations

import threading
import time

from decentral.transport import EncodedAverage, MissedRound

KEEP_S = 120.0  # a donor keeps rounds this long after a newcomer last asked for its state or its rounds


class RoundLog:
    """A chain of offered states: the first is the base a newcomer may hold, each later one the state the
    previous one led to, with the average that led there. Thread-safe (offers come from the training thread,
    requests from the swarm's loop)."""

    def __init__(self, keep_s: float = KEEP_S):
        self.keep_s = keep_s
        self._chain: list[MissedRound] = []
        self._latest: MissedRound | None = None  # the state offered last (kept or not)
        self._until = float("-inf")  # kept until this time.monotonic(), unless a transfer is under way
        self._lock = threading.Lock()

    def want(self, digest: str) -> None:
        """A newcomer holds (or is being sent) the state whose digest is `digest`: keep the rounds after it, for
        `keep_s` from now (again). Only a state we still hold in the chain, or the one offered last, can be
        followed."""
        with self._lock:
            self._until = time.monotonic() + self.keep_s
            if self._latest is not None and self._latest.digest == digest and not self._holds(digest):
                self._chain = [self._latest]

    def wanted(self, busy: bool = False) -> bool:
        """Whether the next offer will be kept with the rounds before it (unless it breaks the chain): a newcomer
        wants the rounds, or `busy`, a transfer is under way."""
        with self._lock:
            return self._keeping(busy)

    def offered(self, meta: dict, digest: str, led_by: EncodedAverage | None, state_bytes: int,
                busy: bool = False) -> None:
        """We offer the state (meta, digest) now, which `led_by` turned the previous offer into (None: not an
        average we can hand out, e.g. a repair, unless the state is unchanged). Kept after the rounds before
        while wanted (or `busy`: a transfer is under way), the oldest dropped beyond `state_bytes` of averages;
        otherwise after the previous offer alone."""
        with self._lock:
            previous, self._latest = self._latest, MissedRound(dict(meta), digest, None)
            unchanged = previous is not None and digest == previous.digest
            if previous is None or (led_by is None and not unchanged):  # the chain breaks: it starts at this state
                self._chain = [self._latest]
                return
            link = MissedRound(dict(meta), digest, None if unchanged else led_by)
            if not self._keeping(busy):
                self._chain = [previous, link]  # the last round only
                return
            self._chain.append(link)
            while len(self._chain) > 1 and sum(r.average.nbytes for r in self._chain[1:] if r.average) > state_bytes:
                self._chain.pop(0)  # the next is the base now: its own average is never handed out

    def since(self, digest: str) -> list[MissedRound] | None:
        """The rounds after the latest state whose digest is `digest` ([] when it is the newest); None when we
        do not hold it."""
        with self._lock:
            at = [i for i, r in enumerate(self._chain) if r.digest == digest]
            return self._chain[at[-1] + 1:] if at else None

    def _keeping(self, busy: bool) -> bool:
        return bool(self._chain) and (busy or time.monotonic() <= self._until)

    def _holds(self, digest: str) -> bool:
        return any(r.digest == digest for r in self._chain)
