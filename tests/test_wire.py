"""Message framing and the application-level link shaper used where the kernel cannot emulate a link."""

import asyncio
import json
import time

import pytest
import torch

from decentral.swarm import wire
from decentral.swarm.wire import (PIECE, LinkShaper, TrafficStats, WireError, read_frame, read_header,
                                  read_tensor_message, write_frame, write_message, write_tensor_message)


async def across_a_socket(send, receive):
    """What `receive(reader)` returns once `send(writer)` has written to it over a real loopback socket."""
    got = asyncio.get_running_loop().create_future()

    async def serve(reader, writer):
        try:
            got.set_result(await receive(reader))
        except Exception as e:
            got.set_exception(e)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    await send(writer)
    try:
        return await asyncio.wait_for(got, 10)
    finally:
        writer.close()
        server.close()


def test_messages_cross_a_real_socket_and_are_counted():
    sent, received = TrafficStats(), TrafficStats()

    async def receive(reader):
        return await read_header(reader, received), await read_frame(reader, received)

    header, payload = asyncio.run(across_a_socket(lambda w: write_message(w, {"tag": "x"}, b"abc" * 100, sent),
                                                  receive))
    assert header == {"tag": "x"} and payload == b"abc" * 100
    assert sent.bytes_sent == received.bytes_received == 8 + len(b'{"tag": "x"}') + 8 + 300


def test_a_tensor_message_carries_every_dtype_and_shape_bit_for_bit():
    """Tensors larger than a piece, of every kind a state holds (a 0-d step count, an empty tensor, a
    non-contiguous one, bfloat16, bool), arrive equal in dtype, shape and bits, and every byte is counted."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "slow": torch.randn(3 * PIECE // 4 + 11, generator=g),
        "momentum.bf16": torch.randn(1000, 7, generator=g).to(torch.bfloat16),
        "step": torch.tensor(17.0),
        "empty": torch.empty(0, 4),
        "transposed": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),
        "mask": torch.rand(33, generator=g) > 0.5,
    }
    sent, received = TrafficStats(), TrafficStats()
    header, got = asyncio.run(across_a_socket(
        lambda w: write_tensor_message(w, {"ok": True, "meta": {"round": 3}}, tensors, sent),
        lambda r: read_tensor_message(r, received)))
    assert header == {"ok": True, "meta": {"round": 3}}
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), name
    assert sent.bytes_sent == received.bytes_received > sum(t.numel() * t.element_size() for t in tensors.values())


def test_a_tensor_message_read_into_given_tensors_fills_them_and_refuses_another_spec():
    """A share of a state (a slice of each tensor) is read straight into its place in the whole."""
    whole = {"slow": torch.zeros(2 * PIECE + 5), "momentum": torch.zeros(2 * PIECE + 5)}
    sent = {k: torch.randn(PIECE + 3) for k in whole}
    into = {k: t[PIECE + 2:] for k, t in whole.items()}  # the second half of each (contiguous views)
    got = asyncio.run(across_a_socket(lambda w: write_tensor_message(w, {"ok": True}, sent, TrafficStats()),
                                      lambda r: read_tensor_message(r, TrafficStats(), into=into)))[1]
    assert all(got[k] is into[k] for k in whole)
    assert all(torch.equal(whole[k][PIECE + 2:], sent[k]) and not whole[k][:PIECE + 2].any() for k in whole)
    with pytest.raises(WireError, match="other tensors"):
        asyncio.run(across_a_socket(lambda w: write_tensor_message(w, {"ok": True}, sent, TrafficStats()),
                                    lambda r: read_tensor_message(r, TrafficStats(), into={"slow": into["slow"]})))
    refusal = asyncio.run(across_a_socket(lambda w: write_message(w, {"ok": False}, b"", TrafficStats()),
                                          lambda r: read_tensor_message(r, TrafficStats(), into=into)))
    assert refusal == ({"ok": False}, {})  # a refusal names no tensors: read as it is, not as a wrong spec


def test_a_tensor_is_sent_from_its_own_memory():
    """A contiguous CPU tensor goes to the stream as it is: no serialised copy of a state is made to send it."""
    t = torch.randn(1000)
    assert wire._wire_bytes(t).obj.__array_interface__["data"][0] == t.data_ptr()


@pytest.mark.parametrize("spec, length, error", [
    ([["slow", "float32", [1 << 30]]], 8, "its spec says 4294967296"),  # a huge claim, not followed by its bytes
    ([["slow", "float32", [4]]], 12, "its spec says 16"),
    ([["slow", "complex64", [4]]], 32, "not \\[name, dtype, shape\\]"),
    ([["slow", "float32", [-4]]], 0, "not \\[name, dtype, shape\\]"),
    ([["a", "float32", [1]], ["a", "float32", [1]]], 8, "names a tensor twice"),
    ({"slow": "float32"}, 0, "not a list"),
])
def test_a_tensor_message_that_contradicts_its_spec_is_refused_before_anything_is_allocated(spec, length, error):
    async def main():
        reader = asyncio.StreamReader()
        header = json.dumps({"ok": True, "tensors": spec}).encode()
        reader.feed_data(len(header).to_bytes(8, "big") + header + length.to_bytes(8, "big"))
        reader.feed_eof()  # the bytes the frame announces never come: a refusal must not wait for them
        return await read_tensor_message(reader, TrafficStats())

    with pytest.raises(WireError, match=error):
        asyncio.run(main())


@pytest.mark.solo
def test_shaper_paces_to_its_rate_and_adds_latency():
    async def send(shaper, frames, size):
        start = time.monotonic()
        for _ in range(frames):
            await shaper.before_send(size)
        return time.monotonic() - start

    paced = asyncio.run(send(LinkShaper(rate_bps=8_000_000), 10, 100_000))  # 8 Mbit at 8 Mbit/s
    assert 0.9 <= paced <= 1.5
    delayed = asyncio.run(send(LinkShaper(latency_s=0.05), 4, 10))
    assert 0.2 <= delayed <= 0.6


def test_shaper_reads_netlab_variables(monkeypatch):
    monkeypatch.setenv("DECENTRAL_LINK_LATENCY_MS", "25")
    monkeypatch.setenv("DECENTRAL_LINK_RATE_BPS", "20000000")
    monkeypatch.setenv("DECENTRAL_NETLAB_MODE", "netns")
    shaper = LinkShaper.from_env()
    assert shaper.latency_s == 0.025 and shaper.rate_bps is None  # tc enforces the rate in netns mode
    monkeypatch.setenv("DECENTRAL_NETLAB_MODE", "loopback")
    assert LinkShaper.from_env().rate_bps == 20_000_000


def test_a_large_frame_is_watched_arriving_piece_by_piece():
    """`on_progress` fires as each piece of a frame arrives (a sign of life of a slow sender) with the bytes in
    so far, and the frame comes out whole."""
    async def main():
        reader = asyncio.StreamReader()
        data = bytes(range(256)) * (5 * PIECE // 256 + 7)
        reader.feed_data(len(data).to_bytes(8, "big") + data)
        calls = []
        got = await read_frame(reader, TrafficStats(), on_progress=lambda done, total: calls.append((done, total)))
        return data, got, calls

    data, got, calls = asyncio.run(main())
    assert got == data and len(calls) == 1 + -(-len(data) // PIECE)  # once at its length, then once a piece
    assert calls == [(min(k * PIECE, len(data)), len(data)) for k in range(len(calls))]


@pytest.mark.solo
def test_a_paced_link_lets_a_small_frame_through_between_the_pieces_of_a_large_one(monkeypatch):
    """On a link paced by the application (netlab's loopback mode), a large frame goes out in pieces:
    a probe's answer sent meanwhile on another stream arrives long before the large frame is done, as it
    would on a real link."""
    monkeypatch.setattr(wire, "LINK", LinkShaper(rate_bps=8_000_000))  # 1 MB/s: 1 MB takes a second

    async def main():
        arrived = {}
        loop = asyncio.get_running_loop()

        async def serve(reader, writer):
            name = (await read_frame(reader, TrafficStats())).decode()
            await read_frame(reader, TrafficStats())
            arrived[name] = loop.time()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        (_, big), (_, small) = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        start = loop.time()

        async def send(writer, name, payload):
            await write_frame(writer, name.encode(), TrafficStats())
            await write_frame(writer, payload, TrafficStats())

        large = asyncio.ensure_future(send(big, "large", bytes(1_000_000)))
        await asyncio.sleep(0.2)
        await send(small, "small", b"ok")
        await large
        while len(arrived) < 2:
            await asyncio.sleep(0.01)
        for w in (big, small):
            w.close()
        server.close()
        return {k: v - start for k, v in arrived.items()}

    arrived = asyncio.run(main())
    assert arrived["small"] < 0.5 and arrived["large"] > 0.9, arrived  # the large frame took about 1 s
