"""Stage servers find each other through the swarm's DHT.

Every node announces `{name, address, stage, incarnation}` under `pipeline/servers`, with its peer
id as the subkey, so the record is signed by the peer it names (decentral.swarm.admission) and,
with a swarm key, sealed. It renews the record every ANNOUNCE_EVERY_S seconds for RECORD_TTL_S, each renewal
sent on time whether or not the last has finished: a store waits out the RPC timeout of each DHT node that
hangs, and renewals that waited for the one before left every node's record lapsed for seconds while a member
was frozen (SIGSTOP). A renewal lands here once the key's nodes are found (one RPC timeout at worst), so
RECORD_TTL_S leaves room for two. A killed node's record lingers that long, which is why the coordinator also
remembers the incarnations it found dead. `incarnation` is new on every start, so a restarted node is told
apart from its ghost.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from decentral.swarm.peer import DHT_RPC_TIMEOUT_S, SwarmPeer

log = logging.getLogger(__name__)

KEY = "pipeline/servers"
ANNOUNCE_EVERY_S = 2.0  # how often a node renews its record
RECORD_TTL_S = ANNOUNCE_EVERY_S + 2 * DHT_RPC_TIMEOUT_S  # the next renewal lands in time even when it waits


@dataclass(frozen=True)
class Server:
    name: str
    address: str  # host:port of its gRPC server
    stage: int
    incarnation: str  # new on every start
    started: float = 0.0  # wall-clock time of the start, to prefer the newest of two records with one name


def new_server(name: str, address: str, stage: int) -> Server:
    return Server(name, address, stage, uuid.uuid4().hex[:12], time.time())


class Announcer:
    """Keeps `server`'s record in the DHT (a background thread) until `close`."""

    def __init__(self, peer: SwarmPeer, server: Server):
        self.peer, self.server = peer, server
        self._stop = threading.Event()
        self.peer.publish(KEY, self.peer.peer_id, asdict(server), ttl=RECORD_TTL_S)
        self._thread = threading.Thread(target=self._run, name="announce", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(ANNOUNCE_EVERY_S):
            try:
                self.peer.publish_nowait(KEY, self.peer.peer_id, asdict(self.server), ttl=RECORD_TTL_S)
            except Exception as e:  # the DHT may be shutting down; the next renewal tries again
                log.debug("announcing %s failed: %s", self.server.name, e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=ANNOUNCE_EVERY_S + 5)


def lookup_servers(peer: SwarmPeer) -> dict[str, Server]:
    """The servers announced now, by name (the newest start where two records share a name)."""
    found: dict[str, Server] = {}
    for value in peer.lookup(KEY).values():
        try:
            server = Server(str(value["name"]), str(value["address"]), int(value["stage"]),
                            str(value["incarnation"]), float(value.get("started", 0.0)))
        except (KeyError, TypeError, ValueError):
            continue  # a malformed record (signed by its peer, so only that peer loses by it)
        if server.name not in found or server.started > found[server.name].started:
            found[server.name] = server
    return found


class ServerView:
    """`lookup_servers`, refreshed every `every` seconds by a background thread; `get()` is instant."""

    def __init__(self, peer: SwarmPeer, every: float = 1.0):
        self.peer, self.every = peer, every
        self._servers = lookup_servers(peer)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="server-view", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.peer.keep_in_touch()  # (SwarmPeer.keep_in_touch: two nodes' DHT views can split for good)
                servers = lookup_servers(self.peer)
            except Exception as e:
                log.debug("looking up servers failed: %s", e)
                continue
            with self._lock:
                self._servers = servers

    def get(self) -> dict[str, Server]:
        with self._lock:
            return dict(self._servers)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.every + 5)
