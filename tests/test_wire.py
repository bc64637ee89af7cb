"""Message framing and the application-level link shaper used where the kernel cannot emulate a link."""

import asyncio
import time


from decentral.swarm import wire
from decentral.swarm.wire import PIECE, LinkShaper, TrafficStats, read_frame, read_message, write_frame, write_message


def test_messages_cross_a_real_socket_and_are_counted():
    async def main():
        sent, received = TrafficStats(), TrafficStats()
        got = asyncio.get_running_loop().create_future()

        async def serve(reader, writer):
            got.set_result(await read_message(reader, received))
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        await write_message(writer, {"tag": "x"}, b"abc" * 100, sent)
        header, payload = await asyncio.wait_for(got, 10)
        writer.close()
        server.close()
        return header, payload, sent, received

    header, payload, sent, received = asyncio.run(main())
    assert header == {"tag": "x"} and payload == b"abc" * 100
    assert sent.bytes_sent == received.bytes_received == 8 + len(b'{"tag": "x"}') + 8 + 300


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
    """`on_bytes` fires as each piece of a frame arrives (a sign of life of a slow sender), and the frame
    comes out whole."""
    async def main():
        reader = asyncio.StreamReader()
        data = bytes(range(256)) * (5 * PIECE // 256 + 7)
        reader.feed_data(len(data).to_bytes(8, "big") + data)
        calls = []
        got = await read_frame(reader, TrafficStats(), on_bytes=lambda: calls.append(1))
        return data, got, len(calls)

    data, got, calls = asyncio.run(main())
    assert got == data and calls == 1 + -(-len(data) // PIECE)  # once at its length, then once a piece


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
