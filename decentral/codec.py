"""How a flat float32 tensor travels in an average (`swarm.codec`), and what the others decode.

Every codec maps a tensor of n elements to exactly `size(n)` bytes (so a receiver checks an announced
size before it reads a byte) and back to float32; a receiver decodes each part and accumulates the
average in float32, never summing encoded values (ALGORITHMS.md §9).

- `float32`, `float16`, `bfloat16`: every element rounded to the type (relative error ≤ 2^-11, 2^-8;
  float16 below 6.1e-5 is subnormal: absolute error ≤ 2^-25).
- `int8`, `int4`: blockwise absmax. Per block of `block` values, scale s = max|x| (float32) and codes
  round(x / s · q) with q = 127 (int8) or 7 (int4, two codes per byte): |x − x̂| ≤ s / (2q) per element.
- `topk` (SparseLoCo, arXiv 2508.15706): per chunk of 4096 values, the k = ceil(density · chunk) of
  largest magnitude, their positions in the chunk (Elias–Fano: each position's low ⌊log2(chunk/k)⌋ bits
  as they are, the rest as a bitmap of k + chunk/2^low bits; 8.6 bits a position at density 0.01, where
  plain offsets take 12), and 2 bits each: a sign, and whether the magnitude lies above the mean of the
  kept magnitudes. Each of the two groups decodes to its mean magnitude (bfloat16). Entries not kept
  decode to 0, so the error is most of the tensor: `error_feedback` tells the protocol to keep what was
  not sent and add it to its next input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

DENSE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CodecError(ValueError):
    """Bytes that are no valid encoding of the announced number of values."""


class Codec:
    """Encode a flat float32 CPU tensor to bytes, decode it back (float32)."""

    name: str
    error_feedback = False  # decoding drops most of the tensor: the sender must keep and resend the rest

    @property
    def spec(self) -> str:
        """The `swarm.codec` that makes exactly this codec (`make_codec(spec)`): members of one swarm share it."""
        return self.name

    def size(self, numel: int) -> int:
        """Bytes of the encoding of any tensor of `numel` elements."""
        raise NotImplementedError

    def encode(self, flat: torch.Tensor) -> bytes:
        raise NotImplementedError

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        """The float32 tensor `data` encodes; CodecError when `data` is no valid encoding of `numel` values."""
        raise NotImplementedError

    def round_trip(self, flat: torch.Tensor) -> torch.Tensor:
        """What a receiver of `encode(flat)` holds."""
        flat = _flat32(flat)
        return self.decode(self.encode(flat), flat.numel())


def _flat32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()


@dataclass(frozen=True)
class Dense(Codec):
    """Every element in `name`'s float type."""

    name: str

    def size(self, numel: int) -> int:
        return numel * DENSE[self.name].itemsize

    def encode(self, flat: torch.Tensor) -> bytes:
        return _flat32(flat).to(DENSE[self.name]).view(torch.uint8).numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        _check_size(data, self.size(numel), self.name)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return raw.view(DENSE[self.name]).to(torch.float32)

    def round_trip(self, flat: torch.Tensor) -> torch.Tensor:
        return _flat32(flat).to(DENSE[self.name]).to(torch.float32)


@dataclass(frozen=True)
class Blockwise(Codec):
    """Blockwise absmax integers of `bits` bits (8, or 4 packed two per byte), a float32 scale per block."""

    name: str
    bits: int
    block: int

    @property
    def levels(self) -> int:
        return (1 << (self.bits - 1)) - 1  # 127 or 7: symmetric, so −x encodes to −code

    def size(self, numel: int) -> int:
        return 4 * _blocks(numel, self.block) + _packed_len(numel, self.bits)

    def encode(self, flat: torch.Tensor) -> bytes:
        flat = _flat32(flat)
        blocks = _padded(flat, self.block)
        scales = blocks.abs().amax(dim=1)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(blocks / safe[:, None] * self.levels).reshape(-1)[: flat.numel()].to(torch.int8)
        raw = codes.numpy().view(np.uint8) if self.bits == 8 else _nibbles(codes.numpy() + self.levels + 1)
        return scales.numpy().astype("<f4").tobytes() + raw.tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        _check_size(data, self.size(numel), self.name)
        count = _blocks(numel, self.block)
        scales = torch.from_numpy(np.frombuffer(data, "<f4", count).astype(np.float32))
        if not (bool(torch.isfinite(scales).all()) and bool((scales >= 0).all())):
            raise CodecError(f"{self.name}: a block scale is negative or not finite")
        body = np.frombuffer(data, np.uint8, offset=4 * count)
        if self.bits == 8:
            codes = body.view(np.int8).astype(np.int16)
        else:
            codes = np.stack([body >> 4, body & 15], axis=1).reshape(-1)[:numel].astype(np.int16) - (self.levels + 1)
        if codes.size and (codes.min() < -self.levels or codes.max() > self.levels):
            raise CodecError(f"{self.name}: a code outside ±{self.levels}")
        values = _padded(torch.from_numpy(codes.astype(np.float32)), self.block)
        return (values * (scales / self.levels)[:, None]).reshape(-1)[:numel]


# What a user choosing top-k should know first (printed once by `decentral train`).
TOPK_NOTICE = ("note: swarm.codec topk ended at or above the loss of training without communication in every run "
               "measured (6, 20 and 30 outer steps: BENCHMARKS.md, \"Top-k\"); int8 sends half of float16's bytes at "
               "its loss, int4 a quarter for 0.3% more.")


@dataclass(frozen=True)
class TopK(Codec):
    """Per chunk of `chunk` values, the k largest in magnitude: positions and a 2-bit value each
    (module docstring). Chunks shorter than `chunk` (the last) keep ceil(density · their length)."""

    density: float = 0.01
    chunk: int = 4096
    name: str = "topk"
    error_feedback = True

    def __post_init__(self):
        if not 0 < self.density <= 1:
            raise ValueError(f"topk density must be in (0, 1], got {self.density}")

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.density:g}"

    def kept(self, length: int) -> int:
        """How many of a chunk of `length` values are sent."""
        return min(length, max(1, math.ceil(self.density * length))) if length else 0

    def size(self, numel: int) -> int:
        batches = self._rows(numel)
        total = sum(rows * k for _, rows, _, k in batches)
        return 4 * sum(rows for _, rows, _, _ in batches) + -(-_position_bits(batches) // 8) + _packed_len(total, 2)

    def _rows(self, numel: int) -> list[tuple[int, int, int, int]]:
        """(start, rows, length, k): the full chunks as one batch of rows, then the short last chunk."""
        full, rest = divmod(numel, self.chunk)
        batches = [(0, full, self.chunk, self.kept(self.chunk))] if full else []
        return batches + ([(full * self.chunk, 1, rest, self.kept(rest))] if rest else [])

    def encode(self, flat: torch.Tensor) -> bytes:
        flat = _flat32(flat)
        levels, positions, two_bits = [], [], []
        for start, rows, length, k in self._rows(flat.numel()):
            part = flat[start:start + rows * length].reshape(rows, length)
            where = torch.topk(part.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
            values = part.gather(1, where)
            magnitude = values.abs()
            high = magnitude > magnitude.mean(dim=1, keepdim=True)
            low_mean = _group_mean(magnitude, ~high)
            high_mean = torch.where(high.any(dim=1), _group_mean(magnitude, high), low_mean)
            levels.append(torch.stack([low_mean, high_mean], dim=1))
            positions.append(_elias_fano(where.numpy(), length))
            two_bits.append(((values < 0).to(torch.uint8) * 2 + high.to(torch.uint8)).reshape(-1))
        if not levels:
            return b""
        scales = torch.cat(levels).to(torch.bfloat16).view(torch.int16).numpy().astype("<i2")
        return (scales.tobytes() + np.packbits(np.concatenate(positions)).tobytes()
                + _pack(torch.cat(two_bits).numpy(), 2).tobytes())

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        _check_size(data, self.size(numel), self.name)
        batches = self._rows(numel)
        chunks = sum(rows for _, rows, _, _ in batches)
        total = sum(rows * k for _, rows, _, k in batches)
        scales = np.frombuffer(data, "<i2", 2 * chunks).astype(np.int16)
        levels = torch.from_numpy(scales).view(torch.bfloat16).float().reshape(-1, 2)
        if not (bool(torch.isfinite(levels).all()) and bool((levels >= 0).all())):
            raise CodecError("topk: a chunk's magnitude is negative or not finite")
        position_bits = _position_bits(batches)
        at = 4 * chunks + -(-position_bits // 8)
        bits = np.unpackbits(np.frombuffer(data, np.uint8, at - 4 * chunks, 4 * chunks), count=position_bits)
        two_bits = torch.from_numpy(_unpack(np.frombuffer(data, np.uint8, offset=at), 2, total).astype(np.int64))
        out = torch.zeros(numel)
        row = first = used = 0
        for start, rows, length, k in batches:
            size = rows * _elias_fano_bits(length, k)
            where = torch.from_numpy(_elias_fano_positions(bits[used:used + size], rows, length, k))
            bits_k = two_bits[first:first + rows * k].reshape(rows, k)
            magnitude = levels[row:row + rows].gather(1, bits_k & 1)
            out[start:start + rows * length].view(rows, length).scatter_(
                1, where, torch.where(bits_k >= 2, -magnitude, magnitude))
            row, first, used = row + rows, first + rows * k, used + size
        return out


def _elias_fano_layout(length: int, k: int) -> tuple[int, int]:
    """(low, slots) for k sorted distinct positions in [0, length): the low ⌊log2(length / k)⌋ bits of each
    go as they are, the rest as a bitmap of k ones among k + (number of high buckets) slots."""
    low = max(0, (length // k).bit_length() - 1)
    return low, k + ((length - 1) >> low) + 1


def _elias_fano_bits(length: int, k: int) -> int:
    """Bits of one row: k low parts, then the bitmap."""
    low, slots = _elias_fano_layout(length, k)
    return k * low + slots


def _position_bits(batches: list[tuple[int, int, int, int]]) -> int:
    """Bits of all positions of `TopK._rows` batches."""
    return sum(rows * _elias_fano_bits(length, k) for _, rows, length, k in batches)


def _elias_fano(where: np.ndarray, length: int) -> np.ndarray:
    """Rows of k strictly increasing positions in [0, length) as Elias–Fano bits (0/1, one row after the
    other: its low parts, then its bitmap, where position i sets slot (position >> low) + i)."""
    rows, k = where.shape
    low, slots = _elias_fano_layout(length, k)
    bitmap = np.zeros((rows, slots), np.uint8)
    np.put_along_axis(bitmap, (where >> low) + np.arange(k), 1, axis=1)
    return np.concatenate([_bits(where & ((1 << low) - 1), low).reshape(rows, k * low), bitmap], axis=1).reshape(-1)


def _elias_fano_positions(bits: np.ndarray, rows: int, length: int, k: int) -> np.ndarray:
    """Inverse of `_elias_fano`; CodecError unless every row holds k strictly increasing positions in
    [0, length)."""
    low, _ = _elias_fano_layout(length, k)
    bits = bits.reshape(rows, -1)
    bitmap = bits[:, k * low:]
    if not bool((bitmap.sum(axis=1) == k).all()):
        raise CodecError("topk: positions outside their chunk, or not strictly increasing")
    high = np.nonzero(bitmap)[1].reshape(rows, k) - np.arange(k)
    where = (high << low) | _from_bits(bits[:, :k * low].reshape(-1), low, rows * k).reshape(rows, k).astype(np.int64)
    if int(where.max()) >= length or (k > 1 and not bool((where[:, 1:] > where[:, :-1]).all())):
        raise CodecError("topk: positions outside their chunk, or not strictly increasing")
    return where


def _group_mean(values: torch.Tensor, member: torch.Tensor) -> torch.Tensor:
    """Per row, the mean of `values` where `member` holds (0 where it holds nowhere)."""
    count = member.sum(dim=1)
    return torch.where(member, values, torch.zeros_like(values)).sum(dim=1) / count.clamp(min=1)


CODECS = ("float32", "float16", "bfloat16", "int8", "int4", "topk")


def make_codec(spec: str) -> Codec:
    """The codec a recipe's `swarm.codec` names: one of CODECS, or `topk:DENSITY` (default 0.01)."""
    name, _, option = spec.partition(":")
    if name in DENSE and not option:
        return Dense(name)
    if name == "int8" and not option:
        return Blockwise("int8", 8, 256)
    if name == "int4" and not option:
        return Blockwise("int4", 4, 128)
    if name == "topk":
        try:
            return TopK(float(option)) if option else TopK()
        except ValueError as e:
            raise ValueError(f"codec {spec!r}: topk:DENSITY takes a density in (0, 1], e.g. topk:0.02 ({e})") from e
    raise ValueError(f"unknown codec {spec!r}; choose from {list(CODECS)} (topk:DENSITY sets topk's density)")


def fold_owner_error(sent: torch.Tensor, mean: torch.Tensor, held: torch.Tensor, count: int) -> torch.Tensor:
    """What a chunk owner's own part counts as once the average it sends is re-encoded: the mean of
    `count` parts was `mean`, everyone holds `held`; counting our part as `sent − count·(mean − held)`
    makes `held` exactly the mean of what was counted, so error feedback keeps the re-encoding's loss too."""
    return sent - count * (mean - held)


def _check_size(data: bytes, expected: int, name: str) -> None:
    if len(data) != expected:
        raise CodecError(f"{name}: {len(data)} bytes, an encoding of this many values has {expected}")


def _blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def _padded(flat: torch.Tensor, block: int) -> torch.Tensor:
    """`flat` zero-padded to whole blocks, one row per block."""
    rows = _blocks(flat.numel(), block)
    return torch.nn.functional.pad(flat, (0, rows * block - flat.numel())).reshape(rows, block)


def _packed_len(count: int, bits: int) -> int:
    return -(-count * bits // 8)


def _nibbles(values: np.ndarray) -> np.ndarray:
    """Values below 16, two per byte (the first in the high half)."""
    even = np.zeros(values.size + values.size % 2, np.uint8)
    even[: values.size] = values
    return (even[0::2] << 4) | even[1::2]


def _bits(values: np.ndarray, width: int) -> np.ndarray:
    """Unsigned integers below 2**width as `width` bits (0/1) each, most significant first."""
    as_bits = (values.astype(np.uint32).reshape(-1, 1) >> np.arange(width - 1, -1, -1, dtype=np.uint32)) & 1
    return as_bits.astype(np.uint8).reshape(-1)


def _from_bits(bits: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of `_bits` for `count` values."""
    as_bits = bits[: count * width].reshape(count, width).astype(np.uint32)
    return (as_bits << np.arange(width - 1, -1, -1, dtype=np.uint32)).sum(axis=1)


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned integers below 2**bits, `bits` each, most significant first, into bytes."""
    return np.packbits(_bits(values, bits))


def _unpack(data: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of `_pack` for `count` values."""
    return _from_bits(np.unpackbits(data, count=count * bits), bits, count)
