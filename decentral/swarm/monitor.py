"""Watch a running swarm: what each peer's heartbeat says about it, read by an observer that takes no part.

A training peer's heartbeat (decentral.swarm.membership) carries its step and round; `StatusCard` adds
its name, its multiaddrs and, over its last `WINDOW_S` seconds or more, its mean training loss and its
tokens per second; its bytes sent and received per second over its last `BYTES_WINDOW_S` (a peer
sends in bursts, one per sync: a few seconds' window before a heartbeat would mostly show none); and who held
its latest `HELD_ROUNDS` averages up, for how long (`held_by`: decentral.swarm.averaging.held_up), which the
monitor adds up over every live card into each peer's seconds held up per average. The
card rides on the regular heartbeat:
no connection and no DHT write of its own.

`SwarmMonitor` joins the run's DHT as a client-only node: it serves nothing, publishes nothing (no
heartbeat, no round announcement), so no member counts it, waits for it or averages with it. It reads
the `peers` records (and the `entry` marks of `swarm start` entries) with its own validator, which hands
it every record as stored; it then checks each one as a member would (signed by the peer it names,
sealed under the swarm key) and keeps those that pass. Records that do not open at all tell it that the
swarm has another key (or none) than the one it holds. It also pings the nodes it knows, as members do
with each heartbeat: each answer carries its peer's clock, shown against ours (decentral.swarm.clocks). (A
DHT node that serves forged records in place of a peer's can hide that peer from the monitor; members'
nodes store no such record, and nobody can fake a peer's row.)
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Callable, Sequence, TextIO

from hivemind.dht import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from decentral.swarm.admission import AdmissionError, SignedRecords, SwarmKey, ensure_identity
from decentral.swarm.clocks import Readings, apart
from decentral.swarm.membership import ENTRY_KEY
from decentral.swarm.peer import (
    DHT_RPC_TIMEOUT_S, SwarmError, _DHTProcess, _read_clocks, check_multiaddrs, dht_result, startup_error,
)

WINDOW_S = 3.0  # the shortest window a card's loss and tokens per second are measured over
BYTES_WINDOW_S = 60.0  # the window a card's bytes per second are measured over (shorter in the first minute)
NAME_CHARS = 64
MAX_ADDRS = 4
ADDR_CHARS = 256
GONE_KEPT_S = 600.0  # how long a live monitor keeps listing a peer whose heartbeat expired
REJOIN_S = 5.0  # how often a monitor that no node of the swarm answers joins again through its initial peers
CLOCKS_READ = 32  # how many nodes one reading of the peers' clocks pings (a random sample of those we know)
HELD_ROUNDS = 8  # the latest averages of a peer whose holders its card sums


class StatusCard:
    """What a training peer tells the monitor (module docstring), through `transport`'s heartbeat.
    `update` after every inner step adds up its loss and, once per window, reads the transport's byte
    counters and hands it the new figures (`set_card`, published with the next regular heartbeat); `synced`
    after every sync, who held its average up. `tokens_per_step`: tokens one inner step trains on."""

    def __init__(self, transport, name: str, tokens_per_step: int):
        self.transport, self.tokens_per_step = transport, tokens_per_step
        self._start: float | None = None  # when the window began
        self._counts: deque[tuple[float, int, int]] = deque()  # (time, bytes sent, received) at each window's end
        self._steps, self._loss = 0, 0.0  # inner steps in the window, and the sum of their losses
        self._held: deque[tuple[str, float]] = deque(maxlen=HELD_ROUNDS)  # (peer id, seconds) of the latest
        addrs = [a[:ADDR_CHARS] for a in transport.multiaddrs()[:MAX_ADDRS]]
        transport.set_card(False, name=name[:NAME_CHARS], addrs=addrs)

    def synced(self, held_by: tuple[str, float] | None) -> None:
        """After a sync: the member that held its average up longest and by how long (`SyncReport.held_by`;
        None: not timed). The card carries their sum per member over our latest `HELD_ROUNDS` timed averages,
        `held`: {"rounds", "by": {peer id: seconds}}."""
        if held_by is None:
            return
        self._held.append(held_by)
        by: dict[str, float] = {}
        for peer, seconds in self._held:
            by[peer] = by.get(peer, 0.0) + seconds
        self.transport.set_card(False, held={"rounds": len(self._held),
                                             "by": {peer: _rounded(seconds) for peer, seconds in by.items()}})

    def update(self, loss: float, now_s: float) -> None:
        """After an inner step: its training loss, and the time in seconds (any monotonic clock)."""
        counts = (now_s, self.transport.bytes_sent, self.transport.bytes_received)
        if self._start is None:
            self._start = now_s
            self._counts.append(counts)
            self.transport.set_card(False, loss=_rounded(loss))
            return
        self._steps += 1
        self._loss += loss
        elapsed = now_s - self._start
        if elapsed < WINDOW_S:
            return
        self._counts.append(counts)
        while len(self._counts) > 2 and self._counts[1][0] <= now_s - BYTES_WINDOW_S:
            self._counts.popleft()  # the oldest count left is the last one at least BYTES_WINDOW_S old
        since, sent, received = (now - then for now, then in zip(counts, self._counts[0]))
        self.transport.set_card(False, loss=_rounded(self._loss / self._steps),
                                tokens_per_s=_rounded(self._steps * self.tokens_per_step / elapsed),
                                sent_per_s=_rounded(sent / since), received_per_s=_rounded(received / since))
        self._start, self._steps, self._loss = now_s, 0, 0.0


def _rounded(x: float) -> float:
    return float(f"{x:.4g}")


class _RawRecords(RecordValidatorBase):
    """Hands every record to the monitor's process as stored (key, subkey, value, expiry), to be checked there."""

    def validate(self, record: DHTRecord) -> bool:
        return True

    def strip_value(self, record: DHTRecord) -> bytes:
        return MSGPackSerializer.dumps([record.key, record.subkey, record.value, record.expiration_time])


class SwarmMonitor:
    """An observer of run `run`, joined through any member's multiaddr in `initial_peers`; `swarm_key`:
    the swarm's key, if it has one. SwarmError when no member answers. While none does later (`reachable`
    False), `rows` has a new DHT node join through `initial_peers` in the background, one join at a time and
    at most every `rejoin_s` seconds, until one answers: meanwhile the rows are read without waiting for it
    (a join through an address that drops packets lasts up to `startup_timeout`)."""

    def __init__(self, run: str, initial_peers: Sequence[str], *, swarm_key: SwarmKey | None = None,
                 startup_timeout: float = 30.0, rejoin_s: float = REJOIN_S):
        check_multiaddrs(initial_peers)
        self.run, self.swarm_key, self.rejoin_s = run, swarm_key, rejoin_s
        self._initial_peers, self._startup_timeout = list(initial_peers), startup_timeout
        with tempfile.TemporaryDirectory(prefix="decentral-monitor-") as folder:  # a key it only checks with
            self._check = SignedRecords(ensure_identity(Path(folder) / "identity.key"), swarm_key)
        self._seen: dict[str, tuple[dict, float]] = {}  # peer id -> (its last heartbeat read, when read)
        self._joined_at = time.monotonic()  # when our latest join began
        self._joining: Future[_DHTProcess] | None = None  # a join under way in the background
        self._clocks: dict[str, float] | None = None  # peer id -> its clock against ours, as last read (apart)
        self.dht = self._join()
        self._readings = Readings(lambda: self.dht.run_coroutine(partial(_read_clocks, CLOCKS_READ),
                                                                 return_future=True))

    def _join(self) -> _DHTProcess:
        """A new client-only DHT node joined through our initial peers; SwarmError when none answers. Its peer
        id is a fresh one (no identity file), so it can join beside the node it replaces."""
        try:
            return _DHTProcess(initial_peers=self._initial_peers, client_mode=True, start=True, await_ready=True,
                               startup_timeout=self._startup_timeout, record_validators=[_RawRecords()],
                               cache_locally=False, cache_nearest=0)
        except Exception as e:  # hivemind raises several types for an unreachable multiaddr
            raise SwarmError(startup_error(e, self._initial_peers, "127.0.0.1", 0)) from e  # a client listens nowhere

    @property
    def rejoining(self) -> bool:
        """Whether a join through our initial peers is under way (no node of the swarm answered us)."""
        return self._joining is not None and not self._joining.done()

    def _rejoin_if_cut_off(self) -> None:
        """A node that joined in the background replaces ours; when none is joining, no node answers us and our
        latest join began `rejoin_s` ago or more, one starts to (if none of the initial peers answers it, ours
        stays, to try again later)."""
        if self._joining is not None:
            if not self._joining.done():
                return
            joined, self._joining = self._joining, None
            if joined.exception() is None:
                self.dht.shutdown()
                self.dht = joined.result()
                return
        if time.monotonic() - self._joined_at < self.rejoin_s or self.reachable():
            return
        self._joined_at, self._joining = time.monotonic(), Future()
        threading.Thread(target=_settle, args=(self._joining, self._join), name="monitor-join", daemon=True).start()

    def rows(self, leave_out: frozenset[str] = frozenset()) -> list[dict]:
        """One row per peer with a heartbeat (state "alive"), or that said it left ("left"), or, in a
        monitor that looked before, whose heartbeat expired since ("gone", or "left" still for one that left;
        either listed for `GONE_KEPT_S` after its record was last read), sorted by name and id: {"id", "name",
        "state", "addrs", "step", "round", "loss", "tokens_per_s", "sent_per_s", "received_per_s",
        "last_seen_s", "clock_s", "held_s" (`held_up`)}; None where a peer does not say (an older version).
        AdmissionError when records of peers or entries exist but none opens with our key (or without one).
        `leave_out`: peers whose records are not counted (a member checking the swarm it joined: itself). Joins
        again first when nobody answers (class docstring)."""
        self._rejoin_if_cut_off()
        heartbeats, unreadable = self._records("peers")
        entries, unreadable_entries = self._records(ENTRY_KEY)  # marks of `swarm start` entries: no rows
        current = {peer: info for peer, info in heartbeats.items() if peer not in leave_out}
        now = get_dht_time()
        if (unreadable or unreadable_entries) and not current and not entries:
            if self.swarm_key is None:
                raise AdmissionError(f"run {self.run!r} is keyed: its records do not open without its key; "
                                     "give it with --swarm-key FILE")
            raise AdmissionError(f"the records of run {self.run!r} do not open with swarm key "
                                 f"{self.swarm_key.fingerprint}: the swarm has another key, or none")
        self._read_clocks()
        self._seen = {p: seen for p, seen in self._seen.items() if p not in current and now - seen[1] < GONE_KEPT_S}
        rows = [_row(p, info, "left" if info.get("left") else "gone", now, self._clocks.get(p))
                for p, (info, _) in self._seen.items()]
        rows += [_row(p, info, "left" if info.get("left") else "alive", now, self._clocks.get(p))
                 for p, info in current.items()]
        held = held_up(current)
        for row in rows:
            row["held_s"] = held.get(row["id"], 0.0) if held is not None else None
        self._seen.update((p, (info, now)) for p, info in current.items())
        return sorted(rows, key=lambda r: (r["name"] or "", r["id"]))

    def _read_clocks(self) -> None:
        """The peers' clocks against ours (decentral.swarm.clocks), for the CLOCK column: the first reading is
        waited for (a table shown once has it), the others taken when done."""
        readings = self._readings.take(wait_s=0.0 if self._clocks is not None else DHT_RPC_TIMEOUT_S + 2)
        self._clocks = {**(self._clocks or {}), **{peer: apart(*bounds) for peer, bounds in (readings or {}).items()}}

    def reachable(self) -> bool:
        """Whether our DHT node knows a node that still answers: a request that a node does not answer takes
        it out of the routing table, so when the swarm (or the way to it) is gone, none is left."""
        return dht_result(self.dht, self.dht.run_coroutine(_routing_table_size, return_future=True)) > 0

    def _records(self, name: str) -> tuple[dict[str, dict], int]:
        """The records under `run/name` that pass a member's checks, {peer id: value}, and how many did not."""
        found = dht_result(self.dht, self.dht.get(f"{self.run}/{name}", latest=True, return_future=True))
        stored = found.value if found is not None and isinstance(found.value, dict) else {}
        key = DHTID.generate(source=f"{self.run}/{name}").to_bytes()  # as stored
        opened = [self._open(item.value, key) for item in stored.values()]
        return dict(o for o in opened if o is not None), sum(o is None for o in opened)

    def _open(self, raw, expected_key: bytes) -> tuple[str, dict] | None:
        """(peer id, its value) of a record as stored, when it passes a member's checks."""
        try:
            key, subkey, value, expiration = raw
            record = DHTRecord(key, subkey, value, expiration)
            if key != expected_key or not self._check.validate(record):
                return None
            info = MSGPackSerializer.loads(self._check.strip_value(record))
            peer = MSGPackSerializer.loads(subkey)
        except Exception:  # not a record of ours at all
            return None
        return (peer, info) if isinstance(info, dict) and isinstance(peer, str) else None

    def close(self) -> None:
        if self._joining is not None:  # a node still joining is shut down once it has
            self._joining.add_done_callback(lambda f: f.exception() is None and f.result().shutdown())
        self.dht.shutdown()


def _settle(future: Future, call: Callable[[], object]) -> None:
    """`future` takes `call`'s result or exception (a thread's target)."""
    try:
        future.set_result(call())
    except BaseException as e:
        future.set_exception(e)


async def _routing_table_size(dht, node) -> int:
    """The nodes in a DHT node's routing table (run in its DHT process: DHT.run_coroutine)."""
    return len(node.protocol.routing_table.uid_to_peer_id)


def _number(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


def _row(peer: str, info: dict, state: str, now: float, clock_s: float | None) -> dict:
    """A peer's heartbeat as a row: fields of the wrong type (or missing) are None; `clock_s`: its clock against
    ours (clocks.apart), None when not read."""
    name, addrs, at = info.get("name"), info.get("addrs"), _number(info.get("at"))
    step, round = _number(info.get("step")), _number(info.get("round"))
    return {
        "id": peer, "name": name[:NAME_CHARS] if isinstance(name, str) else None, "state": state,
        "addrs": [a[:ADDR_CHARS] for a in addrs[:MAX_ADDRS] if isinstance(a, str)] if isinstance(addrs, list) else [],
        "step": None if step is None else int(step), "round": None if round is None else int(round),
        **{k: _number(info.get(k)) for k in ("loss", "tokens_per_s", "sent_per_s", "received_per_s")},
        "last_seen_s": None if at is None else max(0.0, now - at), "clock_s": clock_s,
    }


def held_up(cards: dict[str, dict]) -> dict[str, float] | None:
    """Per peer named in the live `cards`' `held` (StatusCard.synced), the seconds it held up an average: their
    sum over every card, divided by the averages those cover. None when no card says (fields of the wrong type
    are not counted)."""
    rounds, by = 0, {}
    for info in cards.values():
        held = info.get("held")
        if not isinstance(held, dict) or not isinstance(held.get("by"), dict):
            continue
        count = _number(held.get("rounds"))
        if not count or count < 1:
            continue
        rounds += count
        for peer, seconds in held["by"].items():
            if isinstance(peer, str) and (seconds := _number(seconds)) is not None and seconds >= 0:
                by[peer] = by.get(peer, 0.0) + seconds
    return {peer: seconds / rounds for peer, seconds in by.items()} if rounds else None


COLUMNS = ("PEER", "NAME", "STATE", "STEP", "ROUND", "LOSS", "TOKENS/S", "SENT/S", "RECV/S", "HELD", "SEEN",
           "CLOCK", "ADDRESS")


def format_table(run: str, rows: list[dict], reachable: bool = True) -> str:
    """The rows as a text table under a title line, which says so when no node of the swarm answers the
    monitor's DHT (`reachable` False: whoever it has not read since shows as gone, even one that left)."""

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = [[r["id"][-8:], r["name"] or "-", r["state"], num(r["step"], "d"), num(r["round"], "d"),
              num(r["loss"], ".3f"), num(r["tokens_per_s"], ",.0f"), _bytes(r["sent_per_s"]),
              _bytes(r["received_per_s"]), "-" if r.get("held_s") is None else f"{r['held_s']:.2f}s",
              "-" if r["last_seen_s"] is None else f"{r['last_seen_s']:.0f}s ago",
              _clock(r["clock_s"]), r["addrs"][0] if r["addrs"] else "-"] for r in rows]
    widths = [max([len(c), *(len(line[i]) for line in lines)]) for i, c in enumerate(COLUMNS)]  # no rows: the headers
    alive = sum(r["state"] == "alive" for r in rows)
    cut_off = ("" if rows else "; no peer of this run has a record yet (is --run its name?)") if reachable else \
        "; no peer of the swarm answers (all gone, or unreachable from here)"
    out = [f"run {run!r}: {alive} peer{'s' * (alive != 1)} alive, {time.strftime('%H:%M:%S')}{cut_off}",
           "  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
    out += ["  ".join(v.ljust(w) for v, w in zip(line, widths)) for line in lines]
    return "\n".join(line.rstrip() for line in out)


def _clock(seconds: float | None) -> str:
    """A peer's clock against ours: "ok" within the tolerance, else how far ahead (+) or behind (-)."""
    if seconds is None:
        return "-"
    return "ok" if not seconds else f"{seconds:+.0f}s"


def _bytes(rate: float | None) -> str:
    if rate is None:
        return "-"
    for unit in ("B", "KB", "MB"):
        if rate < 1000:
            return f"{rate:.1f} {unit}" if unit != "B" and rate < 10 else f"{rate:.0f} {unit}"
        rate /= 1000
    return f"{rate:.1f} GB"


CLEAR = "\x1b[H\x1b[2J"  # ANSI: cursor home, clear the screen


def watch(monitor: SwarmMonitor, *, interval_s: float, as_json: bool, once: bool, out: TextIO = sys.stdout) -> None:
    """Print the monitor's rows: one JSON document ({"run", "reachable", "peers"}; `SwarmMonitor.reachable`)
    with `as_json`, one table with `once`, else a table redrawn in place every `interval_s` until Ctrl-C."""
    if as_json:
        rows = monitor.rows()
        json.dump({"run": monitor.run, "reachable": monitor.reachable(), "peers": rows}, out, indent=1)
        out.write("\n")
        return
    while True:
        rows = monitor.rows()
        table = format_table(monitor.run, rows, monitor.reachable())
        if once:
            out.write(table + "\n")
            return
        out.write((CLEAR if out.isatty() else "\n") + table + "\n")
        out.flush()
        time.sleep(interval_s)  # the refresh period the user asked for
