"""Framing of our messages on libp2p streams, with every byte counted.

A message is a JSON header frame followed by a payload frame (a tensor in the swarm's codec, decentral.codec).
Each frame is an 8-byte big-endian length and the bytes (hivemind's `P2P.send_raw_data` format).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable


_LEN_BYTES = 8
MAX_FRAME = 1 << 34  # 16 GiB: anything larger is a corrupt length, not a model
MAX_HEADER = 1 << 16  # a JSON header frame; checked before anything is allocated
PIECE = 1 << 16  # bytes a large frame is paced (LinkShaper) and watched arriving (`read_frame`) by

class WireError(RuntimeError):
    """A peer sent bytes that do not form a valid message."""


@dataclass
class TrafficStats:
    """Cumulative bytes on our streams (both directions), safe to read from any thread."""

    bytes_sent: int = 0
    bytes_received: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received


class LinkShaper:
    """Emulation the kernel cannot do here, applied to our own sends (decentral.netlab sets the variables).

    DECENTRAL_LINK_LATENCY_MS: every frame waits this long before it is sent (this kernel has no
    netem). DECENTRAL_LINK_RATE_BPS, only when DECENTRAL_NETLAB_MODE is "loopback": frames are paced
    to this many bits per second, a piece at a time (in netns mode tc tbf enforces the rate, for all
    traffic).
    Lives on the swarm's event loop; covers our streams only, not the DHT's traffic.
    """

    def __init__(self, latency_s: float = 0.0, rate_bps: float | None = None):
        self.latency_s, self.rate_bps = latency_s, rate_bps
        self._next_free = 0.0

    @property
    def paces(self) -> bool:
        """Whether sends are paced to a rate (then a frame goes out in pieces, see `write_frame`)."""
        return bool(self.rate_bps)

    @classmethod
    def from_env(cls) -> "LinkShaper":
        latency = float(os.environ.get("DECENTRAL_LINK_LATENCY_MS") or 0) / 1000
        rate = os.environ.get("DECENTRAL_LINK_RATE_BPS") or None
        loopback = os.environ.get("DECENTRAL_NETLAB_MODE") == "loopback"
        return cls(latency, float(rate) if rate and loopback else None)

    async def before_send(self, nbytes: int, first: bool = True) -> None:
        """Wait until `nbytes` may go out: the latency before a frame's `first` piece, and the rate's pace."""
        wait = self.latency_s if first else 0.0
        if self.rate_bps:
            now = time.monotonic()
            self._next_free = max(self._next_free, now) + 8 * nbytes / self.rate_bps
            wait += self._next_free - now
        if wait > 0:
            await asyncio.sleep(wait)


LINK = LinkShaper.from_env()


async def write_frame(writer: asyncio.StreamWriter, data: bytes | memoryview, stats: TrafficStats) -> None:
    """One frame, handed to the stream a piece (PIECE bytes) at a time, each once the stream's buffer has
    drained: a large frame never waits whole in the transport's buffer (Python 3.11's copies what the socket
    did not take at once). Paced by LINK per piece, so that a large frame flows as it would on a slow link
    (a small frame on another stream gets the link between two pieces) rather than waiting whole."""
    view = memoryview(data).cast("B")
    if not LINK.paces:
        await LINK.before_send(_LEN_BYTES + len(view))
    for start in range(0, max(len(view), 1), PIECE):  # an empty frame: its length alone
        piece = view[start:start + PIECE]
        if LINK.paces:
            await LINK.before_send(len(piece) + (_LEN_BYTES if start == 0 else 0), first=start == 0)
        if start == 0:
            writer.write(len(view).to_bytes(_LEN_BYTES, "big"))
        writer.write(piece)
        await writer.drain()
    stats.add(sent=_LEN_BYTES + len(view))


async def read_frame(reader: asyncio.StreamReader, stats: TrafficStats, max_bytes: int = MAX_FRAME,
                     on_bytes: Callable[[], None] | None = None) -> bytes:
    """One frame; WireError before anything is allocated when it announces more than `max_bytes`.
    `on_bytes()` is called whenever a piece of it (at most PIECE bytes) has arrived: a sign of life of its
    sender while a large frame is still on its way."""
    length = int.from_bytes(await reader.readexactly(_LEN_BYTES), "big")
    if length > max_bytes:
        raise WireError(f"frame length {length} exceeds the {max_bytes}-byte limit")
    if on_bytes is None:
        data = await reader.readexactly(length)
    else:
        on_bytes()
        pieces = []
        for start in range(0, length, PIECE):
            pieces.append(await reader.readexactly(min(PIECE, length - start)))
            on_bytes()
        data = b"".join(pieces)
    stats.add(received=_LEN_BYTES + length)
    return data


async def write_message(writer: asyncio.StreamWriter, header: dict, payload: bytes, stats: TrafficStats) -> None:
    await write_frame(writer, json.dumps(header).encode(), stats)
    await write_frame(writer, payload, stats)


async def read_header(reader: asyncio.StreamReader, stats: TrafficStats) -> dict:
    """A JSON-object header frame of at most MAX_HEADER bytes; WireError otherwise."""
    raw_header = await read_frame(reader, stats, MAX_HEADER)
    try:
        header = json.loads(raw_header)
    except ValueError as e:
        raise WireError(f"message header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise WireError("message header is not a JSON object")
    return header


async def read_message(reader: asyncio.StreamReader, stats: TrafficStats, max_payload: int = MAX_FRAME
                       ) -> tuple[dict, bytes]:
    header = await read_header(reader, stats)
    return header, await read_frame(reader, stats, max_payload)
