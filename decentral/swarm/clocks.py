"""Whether our clock agrees with the other peers' clocks, read again and again while we run.

hivemind's DHT keeps a record until its expiry by the clock of the node that stores it, and refuses one whose
expiry that clock has passed; it compares clocks only as a peer joins (3 s apart at most). A clock that jumps
or drifts later went unnoticed. Measured with two `decentral train` members, one machine's clock set back 200 s
after it joined: its heartbeats expired on arrival, the other member counted it gone, and it took the other's
state at every round, its own steps wasted, without a word; set 200 s ahead instead, it was the other member
that was left out of every round, with nothing said either.

A reading pings a few of our DHT node's neighbours (decentral.swarm.peer.SwarmPeer.read_clocks): each answer
carries the clock of the peer that made it, read between our request and its answer. If our clock showed
`sent` and `answered` then, the peer's clock is ahead of ours by between `its - answered` and `its - sent`
seconds; a bound beyond the tolerance, either side, proves the two clocks apart.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

from hivemind.utils.mpfuture import MPFuture

log = logging.getLogger(__name__)

TOLERANCE_S = 3.0  # what hivemind's DHT allows a peer that joins (MAX_DHT_TIME_DISCREPANCY_SECONDS)
REPEAT_S = 600.0  # a difference that lasts is reported again this often


def apart(least: float, most: float, tolerance_s: float = TOLERANCE_S) -> float:
    """How far a peer's clock is proven from ours by a reading that puts it `least` to `most` seconds ahead: the
    bound beyond the tolerance (positive: ahead, negative: behind), else 0.0 (within it, or a reading too slow
    to tell)."""
    if least > tolerance_s:
        return least
    return most if most < -tolerance_s else 0.0


class ClockCheck:
    """The peers whose clocks are proven further than `tolerance_s` from ours, reading after reading; a
    warning names them when one is new, and again every `REPEAT_S` while any is."""

    def __init__(self, tolerance_s: float = TOLERANCE_S):
        self.tolerance_s = tolerance_s
        self._warned: tuple[float, set[str]] | None = None  # (when, whom) the last warning named

    def check(self, readings: dict[str, tuple[float, float]]) -> dict[str, float]:
        """`readings`: {peer: (least, most) seconds its clock is ahead of ours}, one per peer that answered a
        reading. Returns {peer: the bound that proves its clock further than the tolerance from ours: positive
        when ahead, negative when behind}, and warns about them (see the class)."""
        proven = {peer: apart(least, most, self.tolerance_s) for peer, (least, most) in readings.items()}
        proven = {peer: seconds for peer, seconds in proven.items() if seconds}
        self._report(proven, len(readings))
        return proven

    def _report(self, proven: dict[str, float], read: int) -> None:
        if not proven:
            if self._warned is not None and read:
                log.info("the clocks of the peers we read agree with ours again (within %g s)", self.tolerance_s)
                self._warned = None
            return
        if self._warned is not None and set(proven) <= self._warned[1] and time.monotonic() - self._warned[0] < REPEAT_S:
            return
        self._warned = (time.monotonic(), set(proven))
        listed = ", ".join(f"{p[-8:]}'s clock is at least {abs(d):.0f} s {'ahead of' if d > 0 else 'behind'} ours"
                           for p, d in sorted(proven.items(), key=lambda item: -abs(item[1])))
        ours = (": most clocks are apart from ours, so this machine's is likely the wrong one"
                if read > 1 and len(proven) > read / 2 and len({d > 0 for d in proven.values()}) == 1 else "")
        log.warning("clocks apart: %s (%d of the %d peers whose clocks we read%s). The swarm's records "
                    "expire by the clock of the node that keeps them, and hivemind allows %g s: members whose "
                    "clocks are further apart drop out of each other's rounds. Set the wrong clock right (NTP: "
                    "`timedatectl set-ntp true`)", listed, len(proven), read, ours, self.tolerance_s)


class Readings:
    """Clock readings one after another: `start()` sends one (SwarmPeer.read_clocks) and returns its future;
    each `take` hands over the last one's result once it is done (waited for only when asked) and sends the next."""

    def __init__(self, start: Callable[[], MPFuture]):
        self._start = start
        self._under_way: MPFuture | None = None

    def take(self, wait_s: float = 0.0) -> dict[str, tuple[float, float]] | None:
        """The result of the reading under way, once it is done (waiting up to `wait_s` for it; a first one is
        sent now), else None; a new one is sent when it is done. A reading that failed (our DHT process ended)
        gives {}."""
        if self._under_way is None:
            self._under_way = self._start()
        reading = self._under_way
        if wait_s and not reading.done():
            with contextlib.suppress(Exception):  # (late, or failed: said below)
                reading.result(timeout=wait_s)
        if not reading.done():
            return None
        self._under_way = self._start()
        return {} if reading.cancelled() or reading.exception() is not None else reading.result()
