"""Outgoing gRPC calls of a pipeline node: one FIFO queue per destination, with the emulated latency.

The simulator's link model (decentral.pipeline.simulator) is a FIFO per ordered pair of nodes whose
messages arrive `latency` after they have left. Here every call to a destination waits in that
destination's queue until `latency` after it was posted and until the call before it has been
answered, then goes out; the kernel (netlab's tc cap) or our own pacing (DECENTRAL_LINK_RATE_BPS,
loopback mode) sets how long it takes. A message posted at t then arrives at
max(t + latency, previous arrival) + size / rate, which is the simulator's
max(t, previous departure) + size / rate + latency. A node whose network entry has an uplink
(`uplink_mbps`, as a netlab host has) keeps one queue for all destinations instead, as the
simulator's uplink is one FIFO: with equal latencies the same equality holds.

Latency comes from DECENTRAL_LINK_LATENCY_MS, which netlab sets: its kernel has no netem.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import grpc

from decentral.pipeline.auth import CallKey
from decentral.swarm.wire import LinkShaper

log = logging.getLogger(__name__)

SERVICE = "decentral.pipeline.Stage"
SEND, CONTROL = f"/{SERVICE}/Send", f"/{SERVICE}/Control"
GONE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)

Done = Callable[[bytes | None, Exception | None], None]


def channel_options(max_message: int) -> list[tuple[str, int]]:
    """gRPC options of our channels and servers: messages up to `max_message` bytes (larger ones are
    refused by gRPC from their length prefix, before they are read)."""
    return [("grpc.max_send_message_length", max_message), ("grpc.max_receive_message_length", max_message)]


def is_gone(error: Exception) -> bool:
    """Whether a failed call says its peer is gone (refused, unreachable, silent past the deadline)
    rather than that it refused the message."""
    return isinstance(error, grpc.RpcError) and error.code() in GONE_CODES


class Links:
    """The node's calls to others; thread-safe. `latency_s` and `rate_bps` (our own pacing of the
    node's uplink, None when the kernel caps it) default to the environment's (LinkShaper.from_env).
    `shared_uplink`: one queue for every destination (see the module docstring). `key`: sign every
    call with the swarm's key (decentral.pipeline.auth)."""

    def __init__(self, max_message: int, timeout_s: float = 60.0, latency_s: float | None = None,
                 rate_bps: float | None = None, shared_uplink: bool = False, key: CallKey | None = None):
        shaper = LinkShaper.from_env()
        self.latency_s = shaper.latency_s if latency_s is None else latency_s
        self.rate_bps = shaper.rate_bps if rate_bps is None else rate_bps
        self.timeout_s = timeout_s
        self.max_message = max_message
        self.shared_uplink = shared_uplink
        self.key = key
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._queues: dict[str, _Queue] = {}
        self._uplink_free = 0.0  # when our paced uplink is free again (rate_bps only)
        self._closed = False

    def post(self, address: str, method: str, payload: bytes, done: Done | None = None,
             timeout_s: float | None = None) -> None:
        """Queue a call; `done(reply, None)` or `done(None, error)` runs on the queue's thread when it ends."""
        key = "uplink" if self.shared_uplink else address
        with self._lock:
            if self._closed:
                raise RuntimeError("links are closed")
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = _Queue(self, key)
        queue.put(time.monotonic() + self.latency_s, address, method, payload, done, timeout_s or self.timeout_s)

    def call(self, address: str, method: str, payload: bytes, timeout_s: float | None = None) -> bytes:
        """A call through `address`'s queue, waited for; raises the gRPC error when it fails."""
        finished = threading.Event()
        result: list = []
        self.post(address, method, payload, lambda reply, error: (result.extend((reply, error)), finished.set()),
                  timeout_s)
        finished.wait()
        if result[1] is not None:
            raise result[1]
        return result[0]

    def probe(self, address: str, payload: bytes, timeout_s: float) -> bytes:
        """A call straight from this thread, past the queue (a liveness check must not wait behind
        activations); it still waits out the latency. Raises the gRPC error when it fails."""
        time.sleep(self.latency_s)  # emulated latency, as for queued calls
        return self._channel(address).unary_unary(CONTROL)(payload, timeout=timeout_s,
                                                           metadata=self._metadata(CONTROL, payload))

    def _metadata(self, method: str, payload: bytes):
        return self.key.sign(method, payload) if self.key is not None else None

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = grpc.insecure_channel(address, options=channel_options(self.max_message))
                self._channels[address] = channel
            return channel

    def _pace(self, size: int) -> None:
        """Hold a message until our paced uplink has sent what went before it (loopback mode only)."""
        if not self.rate_bps:
            return
        with self._lock:
            now = time.monotonic()
            self._uplink_free = max(self._uplink_free, now) + 8 * size / self.rate_bps
            wait = self._uplink_free - now
        time.sleep(wait)  # emulated transmission time: nothing else paces loopback

    def close(self) -> None:
        """Stop the queues (calls still queued end with an error) and close the channels."""
        with self._lock:
            self._closed = True
            queues, channels = list(self._queues.values()), list(self._channels.values())
        for queue in queues:
            queue.stop()
        for channel in channels:
            channel.close()


class _Queue:
    """A FIFO of calls (one destination's, or the uplink's), sent by its own thread (module docstring)."""

    def __init__(self, links: Links, name: str):
        self.links = links
        self._items: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self._stopped = False
        threading.Thread(target=self._run, name=f"link-{name}", daemon=True).start()

    def put(self, due: float, address: str, method: str, payload: bytes, done: Done | None, timeout_s: float) -> None:
        with self._ready:
            self._items.append((due, address, method, payload, done, timeout_s))
            self._ready.notify()

    def stop(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._items and not self._stopped:
                    self._ready.wait()
                if self._stopped:
                    left, self._items = list(self._items), collections.deque()
                    break
                due, address, method, payload, done, timeout_s = self._items.popleft()
            time.sleep(max(0.0, due - time.monotonic()))  # emulated latency (netlab has no netem)
            reply, error = None, None
            try:
                self.links._pace(len(payload))
                reply = self.links._channel(address).unary_unary(method)(
                    payload, timeout=timeout_s, metadata=self.links._metadata(method, payload))
            except Exception as e:  # grpc.RpcError, or a channel closed under us at shutdown
                error = e
            if done is not None:
                try:
                    done(reply, error)
                except Exception:
                    log.exception("a callback of a call to %s failed", address)
        for *_, done, _ in left:
            if done is not None:
                done(None, RuntimeError("links closed"))
