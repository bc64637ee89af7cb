"""stage.proto's messages as frames.py writes and reads them, and what a stage server refuses: bad
frames, and calls not signed with the swarm's key."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from decentral.pipeline.auth import MAC, TIME, CallKey
from decentral.pipeline.frames import (COMMAND, REPLY, TENSOR_FRAME, FrameError, command_of, decode, decode_frame,
                                       decode_reply, encode, frame_of, frame_tensor)
from decentral.pipeline.links import CONTROL, SEND, Links
from decentral.pipeline.node import StageNode
from decentral.pipeline.recipe import parse_pipeline_recipe
from decentral.pipeline.stages import make_stage
from decentral.swarm.admission import SwarmKey

PROTO = Path(__file__).resolve().parent.parent / "decentral" / "pipeline" / "stage.proto"
FIELDS = {"kind": "gradients", "iteration": 7, "microbatch": 3, "attempt": 2, "route": ("h0", "n1", "n2"), "hop": 1,
          "dtype": "float16", "shape": (2, 4, 8), "data": bytes(range(128))}


@pytest.fixture(scope="module")
def stage_pb2(tmp_path_factory):
    """The classes protoc generates from stage.proto (skipped where grpcio-tools is not installed)."""
    pytest.importorskip("grpc_tools")
    out = tmp_path_factory.mktemp("generated")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO.parent}", f"--python_out={out}", str(PROTO)],
                   check=True)
    spec = importlib.util.spec_from_file_location("stage_pb2", out / "stage_pb2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_our_bytes_are_protobufs_bytes(stage_pb2):
    theirs = stage_pb2.TensorFrame(**FIELDS).SerializeToString()
    assert encode(TENSOR_FRAME, FIELDS) == theirs
    decoded = decode(TENSOR_FRAME, theirs)
    assert {k: bytes(v) if k == "data" else v for k, v in decoded.items()} == FIELDS
    command = {"kind": "step", "body": '{"a": 1}'}
    assert encode(COMMAND, command) == stage_pb2.Command(**command).SerializeToString()
    reply = stage_pb2.Reply(ok=True, body="{}", data=b"\x00\x01").SerializeToString()
    assert decode_reply(reply) == (True, "", {}, b"\x00\x01")
    assert encode(REPLY, {"ok": False, "error": "no"}) == stage_pb2.Reply(ok=False, error="no").SerializeToString()
    negative = stage_pb2.TensorFrame(hop=-1, iteration=-5).SerializeToString()
    assert decode(TENSOR_FRAME, negative)["hop"] == -1 and decode(TENSOR_FRAME, negative)["iteration"] == -5
    assert encode(TENSOR_FRAME, {"hop": -1, "iteration": -5}) == negative


def test_unknown_fields_and_unpacked_integers_are_read_as_protobuf_does():
    unknown = bytes([0x50, 0x05]) + bytes([0x59]) + bytes(8) + encode(TENSOR_FRAME, {"kind": "activations"})
    assert decode(TENSOR_FRAME, unknown)["kind"] == "activations"  # fields 10 (varint) and 11 (fixed64) skipped
    unpacked = bytes([0x40, 0x02, 0x40, 0x03])  # shape as two unpacked varints
    assert decode(TENSOR_FRAME, unpacked)["shape"] == (2, 3)


@pytest.mark.parametrize("buffer, message", [
    (bytes([0x4A, 0x80, 0x80, 0x80, 0x80, 0x10]), "announces"),  # data field claims 4 GiB
    (bytes([0x10]), "ends inside an integer"),
    (bytes([0x10]) + bytes([0xFF] * 11), "longer than 10 bytes"),
    (bytes([0x0A, 0x02, 0xFF, 0xFE]), "not UTF-8"),
    (bytes([0x0D, 0, 0, 0, 0]), "wire type 5"),  # kind sent as fixed32
])
def test_malformed_bytes_are_refused_before_allocation(buffer, message):
    with pytest.raises(FrameError, match=message):
        decode(TENSOR_FRAME, buffer)


def test_a_tensor_survives_the_trip_and_bad_frames_are_refused():
    tensor = torch.randn(2, 4, 8)
    frame = decode_frame(frame_of("activations", 1, 2, 0, ("h", "a"), 1, tensor))
    assert torch.equal(frame_tensor(frame, 4096, width=8, max_rows=2, max_tokens=4), tensor)
    half = decode_frame(frame_of("activations", 1, 2, 0, ("h", "a"), 1, tensor, "bfloat16"))
    assert torch.allclose(frame_tensor(half, 4096), tensor, atol=0.05, rtol=0.01)
    with pytest.raises(FrameError, match="over the 100-byte limit"):
        frame_tensor(frame, 100)
    with pytest.raises(FrameError, match="not \\(sequences <= 2, tokens <= 4, 16\\)"):
        frame_tensor(frame, 4096, width=16, max_rows=2, max_tokens=4)
    lying = decode_frame(encode(TENSOR_FRAME, {**FIELDS, "dtype": "float32"}))  # 64 elements announced, 128 bytes
    with pytest.raises(FrameError, match="needs 256 bytes, it carries 128"):
        frame_tensor(lying, 1 << 20)
    with pytest.raises(FrameError, match="dtype must be one of"):
        frame_tensor(decode_frame(encode(TENSOR_FRAME, {**FIELDS, "dtype": "int8"})), 1 << 20)
    nan = tensor.clone()
    nan[1, 2, 3] = math.nan
    with pytest.raises(FrameError, match="NaN or inf"):
        frame_tensor(decode_frame(frame_of("gradients", 1, 2, 0, ("h", "a"), 1, nan)), 4096)
    with pytest.raises(FrameError, match="hop 5 does not fit"):
        decode_frame(encode(TENSOR_FRAME, {**FIELDS, "hop": 5}))


def test_a_stage_server_answers_bad_frames_with_invalid_argument():
    recipe = parse_pipeline_recipe({"pipeline": {"stages": 2}, "train": {"batch_size": 2, "context": 4},
                                    "model": {"n_layer": 2, "n_head": 2, "d_model": 8, "context": 8}})
    node = StageNode("n1", make_stage(recipe.recipe.model, 2, 1, seed=0), recipe, memory=2)
    node.start()
    links = Links(1 << 20)
    try:
        good = torch.randn(2, 4, 8)
        assert decode_reply(links.call(node.address, SEND, frame_of("activations", 0, 0, 0, ("h", "n1"), 1, good)))[0]
        bad = good.clone()
        bad[0, 0, 0] = math.inf
        cases = [(frame_of("activations", 0, 0, 0, ("h", "n1"), 1, bad), "NaN or inf"),
                 (frame_of("activations", 0, 0, 0, ("h", "n1"), 1, torch.randn(3, 4, 8)), "sequences <= 2"),
                 (frame_of("activations", 0, 0, 0, ("h", "other"), 1, good), "a frame for other reached n1"),
                 (frame_of("gradients", 0, 0, 0, ("n1", "h"), 0, good), "not a head"),
                 (b"\x0a\x05ab", "announces")]
        for payload, message in cases:
            with pytest.raises(grpc.RpcError) as caught:
                links.call(node.address, SEND, payload)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in caught.value.details()
        with pytest.raises(grpc.RpcError) as caught:
            links.call(node.address, CONTROL, command_of("launch", {"iteration": 0, "launches": [[0, 0, ["n1"]]]}))
        assert "cannot launch microbatches" in caught.value.details()
        huge = b"\x00" * (node.max_frame + (1 << 17))
        with pytest.raises(grpc.RpcError) as caught:  # refused by gRPC from the message's length prefix
            links.call(node.address, SEND, huge)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        ok, _, body, _ = decode_reply(links.call(node.address, CONTROL, command_of("ping")))
        assert ok and body == {"name": "n1", "stage": 1, "iteration": -1, "term": 0}
    finally:
        links.close()
        node.close()


def test_with_a_swarm_key_only_calls_signed_with_it_get_in(tmp_path):
    recipe = parse_pipeline_recipe({"pipeline": {"stages": 2}, "train": {"batch_size": 2, "context": 4},
                                    "model": {"n_layer": 2, "n_head": 2, "d_model": 8, "context": 8}})
    ours, theirs = (CallKey(SwarmKey.generate(tmp_path / name)) for name in ("ours.key", "theirs.key"))
    node = StageNode("n1", make_stage(recipe.recipe.model, 2, 1, seed=0), recipe, memory=2, key=ours)
    node.start()
    made = [Links(1 << 20, key=key) for key in (ours, theirs, None)]
    try:
        member, stranger, keyless = made
        assert decode_reply(member.call(node.address, CONTROL, command_of("ping")))[0]
        for links in (stranger, keyless):
            for method, payload in ((CONTROL, command_of("weights")), (CONTROL, command_of("stop")),
                                    (SEND, frame_of("activations", 0, 0, 0, ("h", "n1"), 1, torch.randn(2, 4, 8)))):
                with pytest.raises(grpc.RpcError) as caught:
                    links.call(node.address, method, payload)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "not signed with this swarm's key" in caught.value.details()
        assert not node.stopped.is_set()
        body = command_of("ping")
        sent = f"{time.time() - 120:.3f}"
        stale = ((TIME, sent), (MAC, ours._mac(CONTROL, sent, body)))
        assert "away from our clock" in ours.refusal(CONTROL, body, stale)
        assert ours.refusal(CONTROL, body, ours.sign(CONTROL, body)) is None
        assert ours.refusal(CONTROL, body + b"x", ours.sign(CONTROL, body)) is not None  # the body is signed too
    finally:
        for links in made:
            links.close()
        node.close()
