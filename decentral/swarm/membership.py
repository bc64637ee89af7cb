"""Who is in the swarm, and who takes part in which outer round.

Three kinds of DHT records under the run's key:
- `peers`: a heartbeat per peer ({"step", "round", "digests", "at"} and its `set_card` fields, at most
  `CARD_BYTES`; "at": when it was sent, DHT time), refreshed every `heartbeat_s` and expiring
  after `expire_s`; a killed peer drops out of every view within that time, and a peer that closes
  cleanly marks itself as left at once. A heartbeat must outlive the longest stall that our own
  averaging traffic can put on a saturated uplink, or views split while a round is in flight
  (measured: 8 hosts at 20 Mbit/s, a 6 s expiry, every second round split), so SwarmTransport
  makes it at least the sync timeout. `digests` holds the digests of the state the peer held after
  each of its last few rounds (replicas compare them, see decentral.sync.base); a new one goes out at
  once rather than with the next beat.
- `round/<r>`: a peer announces that it will take part in round r `lookahead` rounds ahead, so that
  by the time anyone reaches round r all live participants have long since announced it. Every peer
  then derives the same member list for r without a barrier.
- `entry`: a mark per `decentral swarm start` entry (`EntryBeacon`), no member: a peer that joins
  through an entry alone reads it to learn that the swarm is there and whether its records open with
  the peer's key (decentral.swarm.monitor), rather than training alone.

A peer that hangs (SIGSTOP, a debugger, swapping) hangs its DHT node too: hivemind hands its DHT process a
pipe with every call, which that process fetches from the caller, so a call under way when the caller
stopped blocks the DHT process until it resumes. Every DHT request that reaches the node then waits
out the DHT's RPC timeout (decentral.swarm.peer.DHT_RPC_TIMEOUT_S), which is why heartbeats live at
least a few of those (decentral.swarm.transport.HEARTBEAT_STALL_S).

With each beat a peer also reads a few other peers' clocks against its own (decentral.swarm.clocks): records
expire by the clock of the node that keeps them, and hivemind compares clocks only as a peer joins.

A peer restarted under the same id (its key file) stays listed for the rounds its killed process had
announced: every peer keeps deriving the same list, and the averaging itself leaves it out at once
(the new process answers "not in this round"; decentral.swarm.averaging).
"""

from __future__ import annotations

import logging
import threading
import time

from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from decentral.config import HEARTBEAT_S
from decentral.swarm.clocks import ClockCheck, Readings
from decentral.swarm.peer import DHT_RPC_TIMEOUT_S, SwarmPeer
from decentral.transport import with_digest

log = logging.getLogger(__name__)

CARD_BYTES = 2048  # the most a peer's `set_card` fields may take (packed): a heartbeat stays small


class Membership:
    def __init__(
        self, peer: SwarmPeer, *, heartbeat_s: float = HEARTBEAT_S, expire_s: float | None = None, round_ttl_s: float = 3600.0
    ):
        self.peer = peer
        self.heartbeat_s = heartbeat_s
        self.expire_s = 3 * heartbeat_s if expire_s is None else expire_s
        self.round_ttl_s = round_ttl_s
        self._progress = {"step": 0, "round": 0, "digests": {}}
        self._card: dict = {}  # fixed fields every heartbeat carries besides the progress (see `set_card`)
        self._news = threading.Event()  # a digest or announcement to publish before the next regular beat
        self._announcing: set[int] = set()  # rounds to announce with the next beat
        self._view: tuple[float, dict[str, dict]] | None = None  # (when looked up, what `alive` found then)
        self.clocks = ClockCheck()  # the other peers' clocks against ours, read with every beat
        self._readings = Readings(peer.read_clocks)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._thread.start()

    def set_progress(self, step: int, round: int, digest: str | None = None) -> None:
        """What the next heartbeat reports; a `digest` of the state after `round` rounds is published at
        once, beside those of the previous few rounds (decentral.transport.with_digest)."""
        digests = self._progress["digests"]
        if digest is not None:
            digests = with_digest(digests, round, digest)
        self._progress = {"step": int(step), "round": int(round), "digests": digests}
        if digest is not None:
            self._news.set()

    @property
    def step(self) -> int:
        """Our inner step, as last set (the heartbeat may not carry it yet)."""
        return self._progress["step"]

    def set_card(self, now: bool = True, **fields) -> None:
        """Fields (JSON values) that every heartbeat carries from now on beside the progress, replacing those
        of the same name set before, e.g. an island's shard connections (decentral.hierarchy), what the
        monitor shows (decentral.swarm.monitor). `now`: published at once (a DHT write on the calling
        thread), else with the next regular beat. ValueError when the card would outgrow `CARD_BYTES`."""
        card = {**self._card, **fields}
        if len(MSGPackSerializer.dumps(card)) > CARD_BYTES:
            raise ValueError(f"a heartbeat card holds at most {CARD_BYTES} bytes: {sorted(card)} do not fit")
        self._card = card
        if now:
            self._beat()

    def _record(self) -> dict:
        return {**self._card, **self._progress, "at": round(get_dht_time(), 2)}

    def _beat(self) -> None:
        self.peer.publish("peers", self.peer.peer_id, self._record(), ttl=self.expire_s)

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            self._news.wait(self.heartbeat_s)
            self._news.clear()
            if self._stop.is_set():
                return
            with self._lock:
                rounds, self._announcing = sorted(self._announcing), set()
            try:
                self._beat()
                for round in rounds:
                    self.peer.publish(f"round/{round}", self.peer.peer_id, True, ttl=self.round_ttl_s)
                self.alive()  # a fresh view for `alive(max_age_s)`, looked up off the training thread
                if (readings := self._readings.take()) is not None:  # (a beat never waits on a reading)
                    self.clocks.check(readings)
                self.peer.keep_in_touch()
            except Exception as e:  # a missed beat is not fatal; the next one may go through
                with self._lock:
                    self._announcing.update(rounds)
                log.warning("heartbeat failed: %s", e)

    def alive(self, max_age_s: float = 0.0) -> dict[str, dict]:
        """Peers with a live heartbeat that have not left (this peer included): {peer_id: {"step", "round",
        "digests"}}. `max_age_s`: a view the heartbeat thread looked up at most this long ago will do (a DHT
        lookup waits behind our own averaging traffic on a saturated uplink: seconds, measured at 10 Mb/s)."""
        with self._lock:
            seen = self._view
        if seen is not None and time.monotonic() - seen[0] <= max_age_s:
            view = seen[1]
        else:
            view = {p: info for p, info in self.peer.lookup("peers").items()
                    if isinstance(info, dict) and not info.get("left")}
            with self._lock:
                self._view = (time.monotonic(), view)
        return {**view, self.peer.peer_id: view.get(self.peer.peer_id, self._record())}

    def is_alive(self, peer_id: str, refresh_s: float = 1.0) -> bool:
        """Whether `peer_id` has a live heartbeat. Answers from the last lookup, and looks again (at most
        once every `refresh_s`) only for a peer it did not list, so a flood of strangers costs one DHT
        lookup a second. Blocking: call it off the event loop."""
        with self._lock:
            seen = self._view
        if seen is not None and (peer_id in seen[1] or time.monotonic() - seen[0] < refresh_s):
            return peer_id in seen[1]
        return peer_id in self.alive()

    def announce(self, round: int, *, wait: bool = True) -> None:
        """Declare that this peer will take part in outer round `round`. `wait=False`: the heartbeat thread
        publishes it, at once, so the caller (the training thread, at a round boundary) never waits on the
        DHT."""
        if wait:
            self.peer.publish(f"round/{round}", self.peer.peer_id, True, ttl=self.round_ttl_s)
            return
        with self._lock:
            self._announcing.add(round)
        self._news.set()

    def members(self, round: int) -> list[str]:
        """Sorted ids of the live peers that announced `round` (this peer included if it did)."""
        announced = set(self.peer.lookup(f"round/{round}"))
        return sorted(announced & set(self.alive()))

    def close(self) -> None:
        """Stop the heartbeat and tell the others we left (so nobody waits for us in rounds we announced)."""
        self._stop.set()
        self._news.set()
        self._thread.join(timeout=5)
        try:
            self.peer.publish("peers", self.peer.peer_id, {**self._record(), "left": True}, ttl=self.expire_s)
        except Exception as e:
            if self.peer.dht.exitcode == 0:  # it ended by itself: a SIGTERM to our process group reached it too
                log.info("could not announce leaving: our DHT process has ended already (a signal to the whole "
                         "process group stops it too); the others see our heartbeat lapse within %.0fs",
                         self.expire_s)
            else:
                log.warning("could not announce leaving: %s", e)


ENTRY_KEY = "entry"


class EntryBeacon:
    """While an entry (`decentral swarm start`) serves: its signed record under `run/entry`, sealed in a keyed
    swarm like every record, published at once and refreshed every `every_s`, when the peers' clocks are read
    against the entry's too (decentral.swarm.clocks). It lists nobody as a member."""

    def __init__(self, peer: SwarmPeer, every_s: float = 3 * HEARTBEAT_S):
        self.peer, self.every_s = peer, every_s
        self.clocks, self._readings = ClockCheck(), Readings(peer.read_clocks)  # (as a member's heartbeat does)
        self._stop = threading.Event()
        self._publish()
        self._thread = threading.Thread(target=self._loop, name="entry-beacon", daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        self.peer.publish(ENTRY_KEY, self.peer.peer_id, {"at": get_dht_time()}, ttl=3 * self.every_s)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self._publish()
                if (readings := self._readings.take(wait_s=DHT_RPC_TIMEOUT_S + 1)) is not None:  # (every 30 s:
                    self.clocks.check(readings)  # this thread can wait for the answers, and the next tick is far)
            except Exception as e:  # the next one may go through
                log.warning("entry mark not refreshed: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
