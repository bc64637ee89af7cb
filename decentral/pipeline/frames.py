"""The messages of stage.proto in protobuf's wire format, written and read by hand, and tensor frames.

grpcio-tools is not a dependency, so there is no generated code: each message is a schema (field
name, number, type) that `encode` and `decode` follow exactly as protobuf does (proto3: fields at
their default value are left out, repeated integers are packed, unknown fields are skipped).
`decode` never trusts a length: every one is checked against what is left of the buffer first.

A tensor travels as a TensorFrame: a small header (kind, iteration, microbatch, attempt, route, hop,
dtype, shape) and its raw little-endian bytes. `frame_tensor` checks the announced dtype and shape
against the bytes and a size limit before it allocates anything, then refuses NaN and inf.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

ACTIVATIONS, GRADIENTS = "activations", "gradients"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_ROUTE = 64  # nodes in a path
MAX_DIMS = 8

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_INT64_MOD = 1 << 64

TENSOR_FRAME = (("kind", 1, "string"), ("iteration", 2, "int64"), ("microbatch", 3, "int64"),
                ("attempt", 4, "int64"), ("route", 5, "repeated string"), ("hop", 6, "int32"),
                ("dtype", 7, "string"), ("shape", 8, "packed int64"), ("data", 9, "bytes"))
COMMAND = (("kind", 1, "string"), ("body", 2, "string"))
REPLY = (("ok", 1, "bool"), ("error", 2, "string"), ("body", 3, "string"), ("data", 4, "bytes"))
_DEFAULTS = {"string": "", "int64": 0, "int32": 0, "bool": False, "bytes": b"", "repeated string": (),
             "packed int64": ()}


class FrameError(ValueError):
    """Bytes that are not a valid message, or a tensor frame whose header does not fit its data."""


def encode(schema: tuple, values: dict) -> bytes:
    """`values` (field name -> value; missing fields take their default) in protobuf's wire format."""
    out = bytearray()
    for name, number, kind in schema:
        value = values.get(name, _DEFAULTS[kind])
        if kind in ("int64", "int32", "bool"):
            if value:
                out += _varint(number << 3 | _VARINT) + _varint(int(value))
        elif kind in ("string", "bytes"):
            data = value.encode() if kind == "string" else bytes(value)
            if data:
                out += _varint(number << 3 | _LENGTH) + _varint(len(data)) + data
        elif kind == "repeated string":
            for item in value:
                data = item.encode()
                out += _varint(number << 3 | _LENGTH) + _varint(len(data)) + data
        elif value:  # packed int64
            data = b"".join(_varint(int(v)) for v in value)
            out += _varint(number << 3 | _LENGTH) + _varint(len(data)) + data
    return bytes(out)


def decode(schema: tuple, buffer: bytes | memoryview) -> dict:
    """The fields of one message (defaults for absent ones; `bytes` fields as memoryviews of `buffer`)."""
    view = memoryview(buffer)
    fields = {number: (name, kind) for name, number, kind in schema}
    values: dict = {name: _DEFAULTS[kind] for name, _, kind in schema}
    lists: dict[str, list] = {}
    pos = 0
    while pos < len(view):
        key, pos = _read_varint(view, pos)
        number, wire = key >> 3, key & 7
        name, kind = fields.get(number, (None, None))
        if wire == _VARINT:
            value, pos = _read_varint(view, pos)
            if kind in ("int64", "int32"):
                values[name] = value - _INT64_MOD if value >= 1 << 63 else value
            elif kind == "bool":
                values[name] = value != 0
            elif kind == "packed int64":  # an unpacked repeated integer, which parsers must accept too
                lists.setdefault(name, []).append(_signed(value))
            elif kind is not None:
                raise FrameError(f"field {name} (number {number}) came as an integer")
        elif wire == _LENGTH:
            length, pos = _read_varint(view, pos)
            if length > len(view) - pos:
                raise FrameError(f"field number {number} announces {length} bytes, only {len(view) - pos} follow")
            data, pos = view[pos:pos + length], pos + length
            if kind == "bytes":
                values[name] = data
            elif kind in ("string", "repeated string"):
                try:
                    text = str(data, "utf-8")
                except UnicodeDecodeError:
                    raise FrameError(f"field {name} is not UTF-8") from None
                if kind == "string":
                    values[name] = text
                else:
                    lists.setdefault(name, []).append(text)
            elif kind == "packed int64":
                inner = 0
                while inner < len(data):
                    value, inner = _read_varint(data, inner)
                    lists.setdefault(name, []).append(_signed(value))
            elif kind is not None:
                raise FrameError(f"field {name} (number {number}) came as bytes")
        elif wire in (_FIXED64, _FIXED32) and kind is None:
            pos += 8 if wire == _FIXED64 else 4
            if pos > len(view):
                raise FrameError("a message ends inside a fixed-size field")
        else:
            raise FrameError(f"field number {number} has wire type {wire}, which this message does not use")
    values.update({name: tuple(items) for name, items in lists.items()})
    return values


def _varint(value: int) -> bytes:
    value %= _INT64_MOD  # negative integers as 64-bit two's complement, as protobuf writes them
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(10):
        if pos + i >= len(view):
            raise FrameError("a message ends inside an integer")
        byte = view[pos + i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value % _INT64_MOD, pos + i + 1
        shift += 7
    raise FrameError("an integer runs longer than 10 bytes")


def _signed(value: int) -> int:
    return value - _INT64_MOD if value >= 1 << 63 else value


@dataclass(frozen=True)
class TensorFrame:
    """One microbatch's activations or gradients on their way to `route[hop]` (see stage.proto)."""

    kind: str
    iteration: int
    microbatch: int
    attempt: int
    route: tuple[str, ...]
    hop: int
    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview

    @property
    def key(self) -> tuple[int, int, int]:
        return self.iteration, self.microbatch, self.attempt


def frame_of(kind: str, iteration: int, microbatch: int, attempt: int, route: tuple[str, ...], hop: int,
             tensor: torch.Tensor, dtype: str = "float32") -> bytes:
    """The encoded TensorFrame of `tensor` (sent as `dtype`)."""
    flat = tensor.detach().to(device="cpu", dtype=DTYPES[dtype]).contiguous()
    return encode(TENSOR_FRAME, {"kind": kind, "iteration": iteration, "microbatch": microbatch, "attempt": attempt,
                                 "route": route, "hop": hop, "dtype": dtype, "shape": tuple(flat.shape),
                                 "data": flat.reshape(-1).view(torch.uint8).numpy().tobytes()})


def decode_frame(buffer: bytes) -> TensorFrame:
    """The header and data of a TensorFrame; FrameError when its fields are malformed (nothing allocated)."""
    values = decode(TENSOR_FRAME, buffer)
    if values["kind"] not in (ACTIVATIONS, GRADIENTS):
        raise FrameError(f"frame kind must be {ACTIVATIONS!r} or {GRADIENTS!r}, got {values['kind']!r}")
    if not 0 < len(values["route"]) <= MAX_ROUTE or not 0 <= values["hop"] < len(values["route"]):
        raise FrameError(f"frame hop {values['hop']} does not fit a route of {len(values['route'])} nodes "
                         f"(at most {MAX_ROUTE})")
    if min(values["iteration"], values["microbatch"], values["attempt"]) < 0:
        raise FrameError("frame iteration, microbatch and attempt must be >= 0")
    return TensorFrame(**values)


def frame_tensor(frame: TensorFrame, max_bytes: int, width: int | None = None, max_rows: int | None = None,
                 max_tokens: int | None = None) -> torch.Tensor:
    """The frame's tensor (float32), after checking before any allocation that its dtype is known, its
    shape is (rows <= max_rows, tokens <= max_tokens, width) where given, and shape x itemsize is both
    the data's length and at most `max_bytes`; then that every element is finite. FrameError otherwise."""
    if frame.dtype not in DTYPES:
        raise FrameError(f"frame dtype must be one of {sorted(DTYPES)}, got {frame.dtype!r}")
    shape = frame.shape
    if not 0 < len(shape) <= MAX_DIMS or min(shape) < 0:
        raise FrameError(f"frame shape {list(shape)} is not a tensor shape")
    if width is not None and (len(shape) != 3 or shape[2] != width or shape[0] > (max_rows or shape[0])
                              or shape[1] > (max_tokens or shape[1])):
        raise FrameError(f"frame shape {list(shape)} is not (sequences <= {max_rows}, tokens <= {max_tokens}, {width})")
    itemsize = torch.empty((), dtype=DTYPES[frame.dtype]).element_size()
    announced = math.prod(shape) * itemsize
    if announced > max_bytes:
        raise FrameError(f"frame of shape {list(shape)} holds {announced} bytes, over the {max_bytes}-byte limit")
    if announced != len(frame.data):
        raise FrameError(f"frame of shape {list(shape)} and dtype {frame.dtype} needs {announced} bytes, "
                         f"it carries {len(frame.data)}")
    raw = torch.frombuffer(bytearray(frame.data), dtype=torch.uint8) if announced else torch.empty(0, dtype=torch.uint8)
    tensor = raw.view(DTYPES[frame.dtype]).reshape(shape).float()
    if not bool(torch.isfinite(tensor).all()):
        raise FrameError(f"frame of microbatch {frame.microbatch} ({frame.kind}) holds NaN or inf")
    return tensor


def command_of(kind: str, body: dict | None = None) -> bytes:
    return encode(COMMAND, {"kind": kind, "body": json.dumps(body or {})})


def decode_command(buffer: bytes) -> tuple[str, dict]:
    values = decode(COMMAND, buffer)
    return values["kind"], _json_object(values["body"], f"command {values['kind']!r}")


def reply_of(ok: bool = True, error: str = "", body: dict | None = None, data: bytes = b"") -> bytes:
    return encode(REPLY, {"ok": ok, "error": error, "body": json.dumps(body or {}), "data": data})


def decode_reply(buffer: bytes) -> tuple[bool, str, dict, bytes]:
    values = decode(REPLY, buffer)
    return values["ok"], values["error"], _json_object(values["body"], "reply"), bytes(values["data"])


def _json_object(text: str, where: str) -> dict:
    try:
        value = json.loads(text or "{}")
    except ValueError as e:
        raise FrameError(f"{where}: body is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise FrameError(f"{where}: body is not a JSON object")
    return value
