"""Framing of our messages on libp2p streams, with every byte counted.

A message is a JSON header frame followed by a payload frame (raw little-endian tensor bytes).
Each frame is an 8-byte big-endian length and the bytes (hivemind's `P2P.send_raw_data` format).
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field

import torch

_LEN_BYTES = 8
MAX_FRAME = 1 << 34  # 16 GiB: anything larger is a corrupt length, not a model

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


async def write_frame(writer: asyncio.StreamWriter, data: bytes | memoryview, stats: TrafficStats) -> None:
    writer.write(len(data).to_bytes(_LEN_BYTES, "big"))
    writer.write(data)
    await writer.drain()
    stats.add(sent=_LEN_BYTES + len(data))


async def read_frame(reader: asyncio.StreamReader, stats: TrafficStats) -> bytes:
    length = int.from_bytes(await reader.readexactly(_LEN_BYTES), "big")
    if length > MAX_FRAME:
        raise WireError(f"frame length {length} exceeds the {MAX_FRAME}-byte limit")
    data = await reader.readexactly(length)
    stats.add(received=_LEN_BYTES + length)
    return data


def tensor_to_bytes(tensor: torch.Tensor, wire_dtype: str) -> bytes:
    """Flat tensor → bytes in `wire_dtype` (one of WIRE_DTYPES)."""
    flat = tensor.detach().reshape(-1).to(device="cpu", dtype=WIRE_DTYPES[wire_dtype]).contiguous()
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes, wire_dtype: str) -> torch.Tensor:
    """Inverse of `tensor_to_bytes`; returns a flat float32 tensor. Raises WireError on a bad size or dtype."""
    if wire_dtype not in WIRE_DTYPES:
        raise WireError(f"unknown wire dtype {wire_dtype!r}")
    dtype = WIRE_DTYPES[wire_dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(data) % itemsize:
        raise WireError(f"payload of {len(data)} bytes is not a whole number of {wire_dtype} elements")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).to(torch.float32)


async def write_message(writer: asyncio.StreamWriter, header: dict, payload: bytes, stats: TrafficStats) -> None:
    await write_frame(writer, json.dumps(header).encode(), stats)
    await write_frame(writer, payload, stats)


async def read_message(reader: asyncio.StreamReader, stats: TrafficStats) -> tuple[dict, bytes]:
    raw_header = await read_frame(reader, stats)
    try:
        header = json.loads(raw_header)
    except ValueError as e:
        raise WireError(f"message header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise WireError("message header is not a JSON object")
    payload = await read_frame(reader, stats)
    return header, payload
