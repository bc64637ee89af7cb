"""Calls between a pipeline's nodes, signed with the swarm key (decentral.swarm.admission).

gRPC carries our frames and commands in the clear, so with a swarm key every call carries, as
metadata, the time it was sent and HMAC-SHA256(k, method, time, body), k derived from the swarm
key. A node refuses (UNAUTHENTICATED) a call whose MAC does not check or whose time is more than
`WINDOW_S` away from its own clock, before it decodes the body: a stranger can neither send frames or
commands nor ask for a stage's weights, and a call overheard on the wire can be replayed only
within that window (iterations and attempts in the frames make a replayed frame stale sooner).
What it does not give: secrecy (activations and gradients travel unencrypted).
"""

from __future__ import annotations

import hashlib
import hmac
import time

from decentral.swarm.admission import SwarmKey

MAC, TIME = "x-decentral-mac", "x-decentral-time"
WINDOW_S = 60.0
_PURPOSE = "/decentral/pipeline/grpc"


class CallKey:
    """Signs outgoing calls and checks incoming ones for one swarm key."""

    def __init__(self, swarm_key: SwarmKey):
        self._secret = swarm_key.stream_token("pipeline", "pipeline", _PURPOSE)

    def _mac(self, method: str, sent: str, body: bytes) -> str:
        mac = hmac.new(self._secret, f"{method}\n{sent}\n".encode(), hashlib.sha256)
        mac.update(body)
        return mac.hexdigest()

    def sign(self, method: str, body: bytes) -> tuple[tuple[str, str], ...]:
        """The metadata of a call of `method` with `body`."""
        sent = f"{time.time():.3f}"
        return (TIME, sent), (MAC, self._mac(method, sent, body))

    def refusal(self, method: str, body: bytes, metadata) -> str | None:
        """Why an incoming call is refused, or None when its MAC and time check."""
        found = dict(metadata or ())
        sent, mac = found.get(TIME), found.get(MAC)
        if not isinstance(sent, str) or not isinstance(mac, str):
            return "the call is not signed with this swarm's key"
        try:
            skew = abs(time.time() - float(sent))
        except ValueError:
            return "the call's time is not a number"
        if skew > WINDOW_S:
            return f"the call was sent {skew:.0f}s away from our clock (at most {WINDOW_S:.0f}s)"
        if not hmac.compare_digest(mac, self._mac(method, sent, body)):
            return "the call is not signed with this swarm's key"
        return None
