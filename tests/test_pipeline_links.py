"""A node's outgoing calls: emulated latency, FIFO per destination or per uplink, dead peers told apart."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from decentral.pipeline.links import SEND, SERVICE, Links, is_gone

HOLD_S = 0.1  # how long each server takes to answer: a message's time on the wire


@pytest.fixture
def servers():
    """Two gRPC servers that record when each message arrives and answer HOLD_S later."""
    arrivals: list[tuple[str, bytes, float]] = []
    lock = threading.Lock()
    made = []
    for name in ("x", "y"):
        def handle(request, context, name=name):
            with lock:
                arrivals.append((name, request, time.monotonic()))
            time.sleep(HOLD_S)  # the emulated transmission
            return b"ok"

        server = grpc.server(ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE, {"Send": grpc.unary_unary_rpc_method_handler(handle)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        made.append((server, f"127.0.0.1:{port}"))
    yield arrivals, [address for _, address in made]
    for server, _ in made:
        server.stop(0)


def post_all(links: Links, messages: list[tuple[str, bytes]]) -> float:
    """Post every message at once; wait until all are answered; returns when they were posted."""
    left = threading.Semaphore(0)
    posted = time.monotonic()
    for address, payload in messages:
        links.post(address, SEND, payload, lambda reply, error: left.release())
    for _ in messages:
        assert left.acquire(timeout=10)
    return posted


def test_latency_delays_every_message_and_one_destination_is_a_fifo(servers):
    arrivals, (x, _) = servers
    links = Links(1 << 20, latency_s=0.05)
    try:
        links.call(x, SEND, b"0")  # the connection is up before anything is timed
        arrivals.clear()
        posted = post_all(links, [(x, b"1"), (x, b"2"), (x, b"3")])
        assert [payload for _, payload, _ in arrivals] == [b"1", b"2", b"3"]
        times = [t - posted for _, _, t in arrivals]
        assert times[0] >= 0.05
        assert all(b - a >= HOLD_S for a, b in zip(times, times[1:]))  # each waits for the one before it
    finally:
        links.close()


def test_destinations_go_in_parallel_unless_they_share_an_uplink(servers):
    arrivals, (x, y) = servers
    links = Links(1 << 20, latency_s=0.0)
    try:
        post_all(links, [(x, b"0"), (y, b"0")])  # connections up before anything is timed
        arrivals.clear()
        post_all(links, [(x, b"a"), (y, b"b")])
        assert abs(arrivals[1][2] - arrivals[0][2]) < HOLD_S  # the second did not wait for the first's answer
    finally:
        links.close()
    arrivals.clear()
    shared = Links(1 << 20, latency_s=0.0, shared_uplink=True)
    try:
        post_all(shared, [(x, b"0"), (y, b"0")])
        arrivals.clear()
        post_all(shared, [(x, b"a"), (y, b"b")])
        assert [(name, payload) for name, payload, _ in arrivals] == [("x", b"a"), ("y", b"b")]
        assert arrivals[1][2] - arrivals[0][2] >= HOLD_S
    finally:
        shared.close()


def test_a_peer_with_no_process_is_gone():
    links = Links(1 << 20, latency_s=0.0, timeout_s=5.0)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            links.call("127.0.0.1:1", SEND, b"x")
        assert is_gone(caught.value)
    finally:
        links.close()
