"""Framing of our messages on libp2p streams, with every byte counted.

A message is a JSON header frame followed by a payload frame (a tensor in the swarm's codec, decentral.codec).
Each frame is an 8-byte big-endian length and the bytes (hivemind's `P2P.send_raw_data` format).
A tensor message (a state download) carries named tensors: its header lists them (`"tensors": [[name,
dtype, shape], ...]`) and its payload frame is their bytes back to back, in that order, written from each
tensor's own memory and read into each tensor's own: neither side holds a serialised copy of the state.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch


_LEN_BYTES = 8
MAX_FRAME = 1 << 34  # 16 GiB: anything larger is a corrupt length, not a model
MAX_HEADER = 1 << 16  # a JSON header frame; checked before anything is allocated
PIECE = 1 << 16  # bytes a large frame is paced (LinkShaper) and watched arriving (`read_frame`) by
MAX_TENSORS = 1 << 16  # named tensors in one tensor message
WIRE_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}  # what a tensor message may carry

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
    """One frame (see `write_frame_of`)."""
    await write_frame_of(writer, [data], memoryview(data).nbytes, stats)


async def write_frame_of(writer: asyncio.StreamWriter, parts: Iterable, length: int, stats: TrafficStats,
                         on_progress: Callable[[int, int], None] | None = None) -> None:
    """One frame of `length` bytes: `parts`, buffers taken one at a time as they are written (so a generator
    can make each when it is its turn). Handed to the stream a piece (PIECE bytes) at a time, each once the
    stream's buffer has drained (then `on_progress(bytes sent, length)` is called): a large frame never
    waits whole in the transport's buffer (Python 3.11's copies what the socket did not take at once).
    Paced by LINK per piece, so that a large frame flows as it would on a slow link (a small frame on
    another stream gets the link between two pieces) rather than waiting whole. ValueError when the parts
    do not add up to `length` (the stream is then unusable)."""
    if not LINK.paces:
        await LINK.before_send(_LEN_BYTES + length)
    sent = 0
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, len(view), PIECE):
            await _write_piece(writer, view[start:start + PIECE], length, first=sent == 0)
            sent += min(PIECE, len(view) - start)
            if on_progress is not None:
                on_progress(sent, length)
    if length == 0:
        await _write_piece(writer, b"", length, first=True)  # an empty frame: its length alone
    if sent != length:
        raise ValueError(f"a frame announced as {length} bytes had {sent}")
    stats.add(sent=_LEN_BYTES + length)


async def _write_piece(writer: asyncio.StreamWriter, piece: bytes | memoryview, length: int, first: bool) -> None:
    if LINK.paces:
        await LINK.before_send(len(piece) + (_LEN_BYTES if first else 0), first=first)
    if first:
        writer.write(length.to_bytes(_LEN_BYTES, "big"))
    writer.write(piece)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader, stats: TrafficStats, max_bytes: int = MAX_FRAME,
                     on_progress: Callable[[int, int], None] | None = None) -> bytes:
    """One frame; WireError before anything is allocated when it announces more than `max_bytes`.
    `on_progress(bytes arrived, bytes in all)` is called once its length is read and whenever a piece of it
    (at most PIECE bytes) has arrived: a sign of life of its sender while a large frame is on its way."""
    length = await _frame_length(reader, max_bytes)
    if on_progress is None:
        data = await reader.readexactly(length)
    else:
        on_progress(0, length)
        pieces = []
        for start in range(0, length, PIECE):
            pieces.append(await reader.readexactly(min(PIECE, length - start)))
            on_progress(start + len(pieces[-1]), length)
        data = b"".join(pieces)
    stats.add(received=_LEN_BYTES + length)
    return data


async def _frame_length(reader: asyncio.StreamReader, max_bytes: int) -> int:
    """The next frame's length; WireError when it is more than `max_bytes`."""
    length = int.from_bytes(await reader.readexactly(_LEN_BYTES), "big")
    if length > max_bytes:
        raise WireError(f"frame length {length} exceeds the {max_bytes}-byte limit")
    return length


async def write_message(writer: asyncio.StreamWriter, header: dict, payload: bytes, stats: TrafficStats) -> None:
    await write_frame(writer, json.dumps(header).encode(), stats)
    await write_frame(writer, payload, stats)


async def read_header(reader: asyncio.StreamReader, stats: TrafficStats, max_bytes: int = MAX_HEADER) -> dict:
    """A frame of at most `max_bytes` that holds a JSON object (a message's header, a request, an answer);
    WireError otherwise."""
    raw_header = await read_frame(reader, stats, max_bytes)
    try:
        header = json.loads(raw_header)
    except ValueError as e:
        raise WireError(f"a header or request that is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise WireError(f"a header or request that is not a JSON object: {raw_header[:64]!r}")
    return header


def tensor_spec(tensors: dict[str, torch.Tensor]) -> list[list]:
    """[[name, dtype, shape], ...]: what a tensor message's header says of its tensors."""
    return [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()]


def _wire_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes: its own memory when it is a contiguous CPU tensor, else a CPU copy of it alone."""
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


async def write_tensor_message(writer: asyncio.StreamWriter, header: dict, tensors: dict[str, torch.Tensor],
                               stats: TrafficStats, on_progress: Callable[[int, int], None] | None = None) -> None:
    """`header` (with "tensors", their spec) and the tensors' bytes, one tensor at a time; the tensors must not
    change while they are written. `on_progress`: see `write_frame_of`."""
    length = sum(t.numel() * t.element_size() for t in tensors.values())
    await write_frame(writer, json.dumps({**header, "tensors": tensor_spec(tensors)}).encode(), stats)
    await write_frame_of(writer, (_wire_bytes(t) for t in tensors.values()), length, stats, on_progress)


def _checked_spec(spec: object) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """A tensor message's spec as (name, dtype, shape); WireError when it is not one."""
    if not isinstance(spec, list) or len(spec) > MAX_TENSORS:
        raise WireError(f"a tensor message's spec is not a list of at most {MAX_TENSORS} tensors")
    checked = []
    for entry in spec:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and entry[1] in WIRE_DTYPES and isinstance(entry[2], list)
                and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < MAX_FRAME for d in entry[2])):
            raise WireError(f"a tensor message names {str(entry)[:80]!r}, not [name, dtype, shape]")
        checked.append((entry[0], WIRE_DTYPES[entry[1]], tuple(entry[2])))
    if len({name for name, _, _ in checked}) != len(checked):
        raise WireError("a tensor message names a tensor twice")
    return checked


async def read_tensor_message(reader: asyncio.StreamReader, stats: TrafficStats, max_bytes: int = MAX_FRAME,
                              on_progress: Callable[[int, int], None] | None = None,
                              into: dict[str, torch.Tensor] | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """A tensor message's header and tensors. Its spec is checked, and the payload's length against it,
    before a tensor is allocated (WireError); each tensor is then filled a piece at a time as it arrives,
    and `on_progress(bytes received, bytes in all)` called after each piece (and once before the first).
    `into`: contiguous CPU tensors to fill instead (the spec must name them, in order, with their dtypes and
    element counts, or none: a message without tensors, e.g. a refusal, is read as it is)."""
    header = await read_header(reader, stats)
    spec = _checked_spec(header.pop("tensors", []))
    if into is not None and spec and ([(name, dtype, math.prod(shape)) for name, dtype, shape in spec]
                             != [(name, t.dtype, t.numel()) for name, t in into.items()]):
        raise WireError("a tensor message names other tensors than the ones it is to be read into")
    sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in spec]
    length = await _frame_length(reader, max_bytes)
    if length != sum(sizes):
        raise WireError(f"a tensor message of {length} bytes, where its spec says {sum(sizes)}")
    tensors, received = {}, 0
    progress = on_progress or (lambda done, total: None)
    progress(0, length)
    for (name, dtype, shape), size in zip(spec, sizes):
        tensor = torch.empty(shape, dtype=dtype) if into is None else into[name]
        target = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        for start in range(0, size, PIECE):
            target[start:start + PIECE] = await reader.readexactly(min(PIECE, size - start))
            received += min(PIECE, size - start)
            progress(received, length)
        tensors[name] = tensor
    stats.add(received=_LEN_BYTES + length)
    return header, tensors
