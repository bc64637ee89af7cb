"""Safetensors files read one tensor at a time and written as a stream, for merges in bounded memory.

The format: 8 bytes little-endian header length N, N bytes of JSON header
(`{"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ..., "__metadata__": {...}}`,
offsets relative to the data section), then the data section, tensors back to back.

`SafetensorsReader` parses and checks only the header when it opens a file, and `get(name)` reads
that tensor's bytes with plain reads, into fresh memory or a buffer the caller reuses. It maps
nothing: pages of a long-lived mapping that were touched can stay resident and count towards RSS,
which would make merging k experts cost k models. `safetensors.safe_open` does map the file, but
measured with safetensors 0.8.0 on a 400 MB file read tensor by tensor it does not accumulate
(peak RSS +26 MiB, this reader +34 MiB, the largest tensor being 16 MiB). This reader is used all
the same: it reads into reusable buffers, exposes the header bytes so a merge can hash each file
as it reads it, names the file in every error, and does not depend on how a safetensors release
maps files.

`ShardedReader` reads a model saved in shards (save_pretrained's model.safetensors.index.json and the
files its `weight_map` names) as one file: every shard's header is checked against the index.

`SafetensorsWriter` is given every tensor's dtype and shape up front, writes the header first and
then each tensor's bytes as they are produced, hashing them on the way. Its bytes equal what
`safetensors.torch.save` writes for the same tensors without metadata: header keys in the order
dtype, shape, data_offsets, no spaces, padded with spaces to a multiple of 8; tensors ordered by
dtype (widest first, in safetensors' own dtype order) and then by name.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from decentral.merge.base import MergeError

# safetensors' dtype codes in the order of its Rust `Dtype` enum (files sort tensors by it, widest first)
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn, "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
    "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
    "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64,
}
CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}
FLOAT_CODES = ("F8_E5M2", "F8_E4M3", "F16", "BF16", "F32", "F64")
MAX_HEADER = 100_000_000  # the safetensors library's own limit
_DTYPE_RANK = {code: rank for rank, code in enumerate(DTYPES)}


class TensorFileError(MergeError):
    """A safetensors file is truncated, corrupt or not a safetensors file; the message names it."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors code, e.g. "F32"
    shape: tuple[int, ...]
    begin: int  # byte offsets in the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsReader:
    """One safetensors file: `tensors` (name -> TensorInfo) from its checked header, `get(name)` reads one.
    `header` holds the file's bytes before the data section (length and JSON), for hashing the file
    as it is read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = open(self.path, "rb", buffering=0)
        try:
            self.tensors, self.metadata, self.header = _parse_header(self._file, self.path)
            self._data_start = len(self.header)
        except BaseException:
            self._file.close()
            raise

    def get(self, name: str, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name`, read from the file into fresh memory, or into the start of `buffer` (a uint8
        tensor at least `tensors[name].nbytes` long, reused across calls to spare the allocation):
        the result is then a view of `buffer`, valid until it is overwritten."""
        info = self.tensors.get(name)
        if info is None:
            raise TensorFileError(f"{self.path}: no tensor {name!r}")
        data = torch.empty(info.nbytes, dtype=torch.uint8) if buffer is None else buffer[:info.nbytes]
        view = memoryview(data.numpy())
        self._file.seek(self._data_start + info.begin)
        done = 0
        while done < info.nbytes:
            count = self._file.readinto(view[done:])
            if not count:
                raise TensorFileError(f"{self.path}: file ended inside tensor {name!r} (truncated while open?)")
            done += count
        return data.view(DTYPES[info.dtype]).reshape(info.shape)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShardedReader:
    """The shards an index file (`weight_map`: tensor name -> file beside it) names, read as one model: `tensors`
    (name -> TensorInfo, offsets within its shard) and `get(name, buffer)` as SafetensorsReader's. TensorFileError
    when the index is malformed or a shard does not hold exactly the tensors the index puts in it."""

    def __init__(self, index: str | Path):
        self.path = Path(index)
        self.shards: dict[str, SafetensorsReader] = {}
        try:
            weight_map = _weight_map(self.path)
            for file in sorted(set(weight_map.values())):
                self.shards[file] = SafetensorsReader(self.path.parent / file)
            self._shard_of = {name: self.shards[file] for name, file in weight_map.items()}
            self.tensors = {}
            for file, reader in self.shards.items():
                for name, info in reader.tensors.items():
                    if weight_map.get(name) != file:
                        raise TensorFileError(f"{reader.path}: holds tensor {name!r}, which {self.path.name} puts "
                                              f"in {weight_map.get(name) or 'no shard'}")
                    self.tensors[name] = info
            missing = sorted(set(weight_map) - set(self.tensors))
            if missing:
                raise TensorFileError(f"{self.path.parent / weight_map[missing[0]]}: has no tensor {missing[0]!r}, "
                                      f"which {self.path.name} puts there")
        except BaseException:
            self.close()
            raise

    def get(self, name: str, buffer: torch.Tensor | None = None) -> torch.Tensor:
        if name not in self._shard_of:
            raise TensorFileError(f"{self.path}: no tensor {name!r}")
        return self._shard_of[name].get(name, buffer)

    def close(self) -> None:
        for reader in self.shards.values():
            reader.close()

    def __enter__(self) -> ShardedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _weight_map(index: Path) -> dict[str, str]:
    """The `weight_map` of a save_pretrained index file, every shard a plain file name."""
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TensorFileError(f"{index}: not a readable JSON index ({e})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise TensorFileError(f"{index}: expected {{\"weight_map\": {{tensor name: shard file}}}}")
    for file in set(weight_map.values()):
        if Path(file).name != file or file in (".", ".."):
            raise TensorFileError(f"{index}: shard {file!r} is not a file name beside the index")
    return weight_map


def _parse_header(file, path: Path) -> tuple[dict[str, TensorInfo], dict[str, str], bytes]:
    """The tensors, the metadata and the file's first bytes up to the data section (length + header)."""
    size = os.fstat(file.fileno()).st_size
    if size < 8:
        raise TensorFileError(f"{path}: {size} bytes is too short for a safetensors file")
    prefix = file.read(8)
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER, size - 8):
        raise TensorFileError(f"{path}: header length {length} does not fit the file ({size} bytes): "
                              "truncated or not a safetensors file")
    raw = file.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TensorFileError(f"{path}: header is not valid JSON ({e}): corrupt or not a safetensors file") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise TensorFileError(f"{path}: __metadata__ must map strings to strings")
    tensors = {name: _tensor_info(entry, f"{path}: tensor {name!r}") for name, entry in header.items()}
    data_size = size - 8 - length
    position, previous = 0, None
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != position:
            what = f"overlaps {previous!r}" if info.begin < position else "leaves a gap before it"
            raise TensorFileError(f"{path}: tensor {name!r} starts at data byte {info.begin}, which {what} "
                                  f"(expected {position})")
        position, previous = info.end, name
    if position > data_size:
        raise TensorFileError(f"{path}: tensor data needs {position} bytes after the header but the file has "
                              f"{data_size}: truncated")
    if position < data_size:
        raise TensorFileError(f"{path}: {data_size - position} bytes after the last tensor: corrupt")
    return tensors, metadata, prefix + raw


def _tensor_info(entry: object, where: str) -> TensorInfo:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise TensorFileError(f"{where}: expected {{dtype, shape, data_offsets}}, got {entry!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise TensorFileError(f"{where}: unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(_natural(d) for d in shape):
        raise TensorFileError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise TensorFileError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    needed = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != needed:
        raise TensorFileError(f"{where}: shape {shape} of {dtype} needs {needed} bytes, data_offsets {offsets} "
                              f"span {offsets[1] - offsets[0]}")
    return TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def write_order(specs: Mapping[str, tuple[str, Sequence[int]]]) -> list[str]:
    """The order `safetensors.torch.save` stores tensors in: by dtype, widest first, then by name."""
    return sorted(specs, key=lambda name: (-_DTYPE_RANK[specs[name][0]], name))


class SafetensorsWriter:
    """Writes `path` from `specs` (name -> (dtype code, shape)): the header at once, then `write` each
    tensor in `order`; `close()` checks all were written and returns the file's sha256."""

    def __init__(self, path: str | Path, specs: Mapping[str, tuple[str, Sequence[int]]]):
        self.path = Path(path)
        self.order = write_order(specs)
        header, position = {}, 0
        for name in self.order:
            dtype, shape = specs[name]
            size = math.prod(shape) * DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, position + size]}
            position += size
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        text += b" " * (-len(text) % 8)
        self._header = header
        self._next = 0
        self._digest = hashlib.sha256()
        self._file = open(self.path, "wb", buffering=0)
        self._write(struct.pack("<Q", len(text)) + text)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.order) or name != self.order[self._next]:
            expected = self.order[self._next] if self._next < len(self.order) else "nothing (all written)"
            raise ValueError(f"{self.path}: tensors must be written in order; got {name!r}, expected {expected!r}")
        entry = self._header[name]
        if CODES.get(tensor.dtype) != entry["dtype"] or list(tensor.shape) != entry["shape"]:
            raise ValueError(f"{self.path}: tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, "
                             f"declared {entry['dtype']} {entry['shape']}")
        data = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
        if data.numel():
            self._write(memoryview(data.numpy()))
        self._next += 1

    def _write(self, data) -> None:
        self._digest.update(data)
        view = memoryview(data)
        while view:
            view = view[self._file.write(view):]

    def close(self) -> str:
        """Close the file; ValueError unless every tensor was written. The sha256 of the file's bytes."""
        self._file.close()
        if self._next != len(self.order):
            raise ValueError(f"{self.path}: {len(self.order) - self._next} tensor(s) not written, "
                             f"first {self.order[self._next]!r}")
        return self._digest.hexdigest()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._file.closed:
            self._file.close()
