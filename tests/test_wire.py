"""Message framing and the application-level link shaper used where the kernel cannot emulate a link."""

import asyncio
import time


from decentral.swarm.wire import LinkShaper, TrafficStats, read_message, write_message


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
