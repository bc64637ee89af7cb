"""Hand a peer's current outer state (slow weights, momentum, round) to a newcomer.

The donor serves an immutable snapshot that its protocol replaces after every outer step, so serving
never waits on training or averaging (the blocking that hivemind issue #445 describes). Newcomers
pick a random donor among the most advanced peers, not always the same one (hivemind issue #169),
and never one that is behind them (a restarted peer still catching up).
A newcomer that already holds the donor's state (same seed, nobody has trained yet) says so with a
fingerprint and gets no payload: on a slow uplink, N peers starting together would otherwise each pull
a full copy of the model from someone, and the congestion delays the DHT traffic of the first round.
A peer that claims a round far ahead of the others (by mistake or to become everyone's donor) is
passed over: donors are those at most one round past the candidates' lower median.

A newcomer can also ask a donor to take it into the group's averages from the donor's next step
(`join`, on the `join` stream): the request waits for the donor's protocol (`join_requests`), which
answers with the state it holds at that step, streamed back on the same stream.

A peer that leaves finishes the transfers under way first (`close`): the last members of a run that ends
would otherwise cut off a newcomer's download of the run's final state mid-transfer (seen in a CO2 soak:
the newcomer then held another final state than everyone else).

A state travels as a tensor message (decentral.swarm.wire): neither side holds a serialised copy of it.
The swarm's timeout bounds the wait for each piece of a download, not the whole download, which on a slow
link takes minutes for a large model (57M parameters' φ and momentum at 20 Mb/s: 3 minutes); a long one
logs its progress. A donor ends a transfer whose requester stopped reading for REQUEST_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import threading
from concurrent.futures import Future
from typing import Callable

import torch

from decentral.swarm.peer import SwarmPeer
from decentral.swarm.wire import (MAX_HEADER, read_frame, read_tensor_message, write_frame, write_message,
                                  write_tensor_message)
from decentral.transport import JoinRequest, StateUnavailable, state_digest, trained_past

log = logging.getLogger(__name__)
progress_log = logging.getLogger("decentral.progress")  # shown without --verbose: the CLI sets it to INFO

REQUEST_TIMEOUT_S = 30.0  # a state request must arrive within this time
MAX_JOIN_REQUESTS = 8  # join requests waiting for our protocol at once; more are refused
PROGRESS_LOG_S = 10.0  # a state download that takes longer says how far it is this often

Snapshot = tuple[dict, dict[str, torch.Tensor]]


class StateExchange:
    """Serve our snapshot on the `state` stream and download others'."""

    def __init__(self, peer: SwarmPeer, live_step: Callable[[], int] | None = None, join_timeout: float = 60.0):
        self.peer = peer
        self.live_step = live_step  # our inner step now (the snapshot may be older)
        self.join_timeout = join_timeout  # how long a join request waits for our protocol's answer
        self._snapshot: tuple[dict, dict[str, torch.Tensor], str] | None = None
        self._joins: list[JoinRequest] | None = None  # not yet taken by our protocol; None: it takes none
        self._joins_lock = threading.Lock()
        self._transfers: set[asyncio.Task] = set()  # handlers sending our state (see `close`)
        self._closing = False
        peer.add_handler("state", self._on_request)
        peer.add_handler("join", self._on_join)

    def offer(self, meta: dict, tensors: dict[str, torch.Tensor], digest: str | None = None) -> None:
        """Make (meta, tensors) what we hand out; the tensors must not be modified afterwards. `digest`:
        their `state_digest`, when the caller has it."""
        self._snapshot = (dict(meta), tensors, digest or state_digest(tensors))

    async def _on_request(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = json.loads(await asyncio.wait_for(read_frame(reader, self.peer.stats, MAX_HEADER), REQUEST_TIMEOUT_S)
                             or b"{}")
        snapshot = self._snapshot
        if snapshot is None or self._closing:
            await write_message(writer, {"ok": False}, b"", self.peer.stats)
            return
        async with self._transfer(reader), _sending_watch() as watch:
            await self._answer(request, snapshot, writer, watch)

    async def _answer(self, request: dict, snapshot: tuple[dict, dict[str, torch.Tensor], str],
                      writer: asyncio.StreamWriter, watch: Callable[[int, int], None]) -> None:
        meta, tensors, digest = snapshot
        step_now = self.live_step() if self.live_step is not None else int(meta.get("step", 0))
        past = trained_past(meta, step_now)
        if request.get("have") == digest and not past:
            await write_message(writer, {"ok": True, "same": True, "meta": meta}, b"", self.peer.stats)
            return
        if request.get("meta_if_past") is True and past:
            await write_message(writer, {"ok": True, "meta": meta, "step_now": step_now}, b"", self.peer.stats)
            return
        await write_tensor_message(writer, {"ok": True, "meta": meta, "step_now": step_now}, tensors, self.peer.stats,
                                   on_progress=watch)

    async def _on_join(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Queue the sender's request for our protocol and stream back the state it grants, or a refusal
        (when it refuses, does not answer within `join_timeout`, takes no requests (it never asked for
        them: not DDP, or not started), or too many wait already)."""
        await asyncio.wait_for(read_frame(reader, self.peer.stats, MAX_HEADER), REQUEST_TIMEOUT_S)
        request = JoinRequest(sender, Future())
        with self._joins_lock:
            queued = self._joins is not None and len(self._joins) < MAX_JOIN_REQUESTS
            if queued:
                self._joins.append(request)
        try:
            granted = await asyncio.wait_for(asyncio.wrap_future(request.answer), self.join_timeout) if queued else None
        except TimeoutError:  # wait_for cancelled the request: our protocol passes over it
            granted = None
        if granted is None or self._closing:
            await write_message(writer, {"ok": False}, b"", self.peer.stats)
            return
        meta, tensors = granted
        async with self._transfer(reader), _sending_watch() as watch:
            await write_tensor_message(writer, {"ok": True, "meta": meta}, tensors, self.peer.stats, on_progress=watch)

    @contextlib.asynccontextmanager
    async def _transfer(self, reader: asyncio.StreamReader):
        """A transfer of our state that `close` waits for: the calling handler's answer, sent in the block,
        and then until the requester has read all of it (`_until_closed`)."""
        task = asyncio.current_task()
        self._transfers.add(task)
        try:
            yield
            await _until_closed(reader)
        finally:
            self._transfers.discard(task)

    def close(self, timeout: float) -> None:
        """Refuse new requests, and wait (at most `timeout`) until the state we are sending has been sent."""
        if self._closing:
            return
        self._closing = True
        self.peer.call(self._finish_transfers(timeout)).result()

    async def _finish_transfers(self, timeout: float) -> None:
        if self._transfers:
            log.info("finishing %d state transfer(s) under way before leaving (at most %.0fs)", len(self._transfers),
                     timeout)
            await asyncio.wait(set(self._transfers), timeout=timeout)

    def join_requests(self) -> list[JoinRequest]:
        """The join requests that arrived since the last call (from the first call on, requests are queued)."""
        with self._joins_lock:
            taken, self._joins = self._joins or [], []
        return taken

    def join(self, donor: str, timeout: float) -> Snapshot | None:
        """Ask `donor` to average with us from its next step on: the state it grants, or None when it refused
        or failed (its answer awaited for twice `timeout`, then no more than `timeout` between two bytes)."""
        try:
            return self.peer.call(self._ask_to_join(donor, timeout)).result()
        except Exception as e:
            log.info("asking %s to join its averages failed: %r", donor[-8:], e)
            return None

    async def _ask_to_join(self, donor: str, timeout: float) -> Snapshot | None:
        async with _receiving_watch(donor, first_byte_s=2 * timeout, idle_s=timeout) as watch:
            reader, writer = await self.peer.open_stream(donor, "join")
            try:
                await write_frame(writer, b"{}", self.peer.stats)
                header, tensors = await read_tensor_message(reader, self.peer.stats, on_progress=watch)
            finally:
                writer.close()
        if not header.get("ok"):
            return None
        return dict(header["meta"]), tensors

    async def _download(self, donor: str, have: str | None, timeout: float, meta_if_past: bool = False
                        ) -> Snapshot | str | None:
        """The donor's snapshot; "same" when it equals the state whose digest is `have`; None if it has none;
        with `meta_if_past`, only its meta (tensors {}) when the donor trained past it. TimeoutError when no
        byte arrives for `timeout` (however long the whole download takes on a slow link)."""
        async with _receiving_watch(donor, first_byte_s=timeout, idle_s=timeout) as watch:
            reader, writer = await self.peer.open_stream(donor, "state")
            try:
                await write_frame(writer, json.dumps({"have": have, "meta_if_past": meta_if_past}).encode(),
                                  self.peer.stats)
                header, tensors = await read_tensor_message(reader, self.peer.stats, on_progress=watch)
            finally:
                writer.close()
        if not header.get("ok"):
            return None
        if header.get("same"):
            return "same"
        meta = dict(header["meta"])
        if isinstance(header.get("step_now"), int):
            meta["donor_step"] = header["step_now"]
        return meta, tensors

    def fetch(
        self, candidates: dict[str, dict], timeout: float, have: dict[str, torch.Tensor] | None = None,
        meta_if_past: bool = False,
    ) -> tuple[str, Snapshot] | None:
        """Download a snapshot from one of `candidates` ({peer: {"round": r}}) that claim the highest round
        (at most one past their lower median), in random order.

        Returns (donor, snapshot), or None when no candidate has one to serve, or when the first that
        could holds exactly `have` (the state we would offer ourselves) and has not trained since. Raises
        StateUnavailable when a download failed (one fails when no byte of it arrives for `timeout`) and
        none succeeded. The snapshot's meta gains `donor_step`, the donor's inner step when it served it.
        `meta_if_past`: see `_download`.
        """
        have_digest = state_digest(have) if have is not None else None
        rounds = {p: _claimed_round(info) for p, info in candidates.items() if p != self.peer.peer_id}
        rounds = {p: r for p, r in rounds.items() if r is not None}
        if not rounds:
            return None
        ceiling = sorted(rounds.values())[(len(rounds) - 1) // 2] + 1
        top = max(r for r in rounds.values() if r <= ceiling)
        order = [p for p, r in rounds.items() if r == top]  # a peer behind the others (restarted) is no donor
        random.shuffle(order)
        failed = []
        for donor in order:
            try:
                got = self.peer.call(self._download(donor, have_digest, timeout, meta_if_past)).result()
            except Exception as e:  # reported in StateUnavailable, once every donor failed
                log.info("state download from %s failed: %r", donor[-8:], e)
                failed.append(f"{donor[-8:]}: {type(e).__name__}: {' '.join(str(e).split())[:120]}")
                continue
            if got == "same":
                return None
            if got is not None:
                return donor, got
        if failed:  # the others (if any) have no snapshot yet
            raise StateUnavailable(f"none of the {len(order)} peers at round {top} handed over its state "
                                   f"({'; '.join(failed)})")
        return None


@contextlib.asynccontextmanager
async def _receiving_watch(donor: str, first_byte_s: float, idle_s: float):
    """The clock of a state we receive: TimeoutError when its header takes longer than `first_byte_s`, or a
    piece of it longer than `idle_s` after the one before; a long download logs its progress every
    PROGRESS_LOG_S. Yields the `on_progress` callback for `read_tensor_message`."""
    loop = asyncio.get_running_loop()
    began = logged = loop.time()
    waited = first_byte_s

    def watch(done: int, total: int) -> None:
        nonlocal logged, waited
        now, waited = loop.time(), idle_s
        clock.reschedule(now + idle_s)
        if now - logged >= PROGRESS_LOG_S:
            logged = now
            progress_log.info("downloading the state of %s: %.0f of %.0f MiB (%.1f MiB/s)", donor[-8:],
                              done / 2**20, total / 2**20, done / 2**20 / (now - began))

    try:
        async with asyncio.timeout(first_byte_s) as clock:
            yield watch
    except TimeoutError:
        raise TimeoutError(f"no byte of the state from {donor[-8:]} for {waited:g}s") from None


@contextlib.asynccontextmanager
async def _sending_watch():
    """TimeoutError when our answer's bytes stop leaving for REQUEST_TIMEOUT_S (the requester stopped reading):
    a stalled requester does not hold our handler and its snapshot forever. Yields `on_progress`."""
    async with asyncio.timeout(REQUEST_TIMEOUT_S) as clock:
        yield lambda done, total: clock.reschedule(asyncio.get_running_loop().time() + REQUEST_TIMEOUT_S)


async def _until_closed(reader: asyncio.StreamReader) -> None:
    """Until the requester closes the stream (it does once it has read our answer: only then has all of it
    arrived, rather than left our process), at most REQUEST_TIMEOUT_S."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            while await reader.read(4096):
                pass


def _claimed_round(info: dict) -> int | None:
    """The round a heartbeat claims, or None when it is not a round number."""
    round = info.get("round", 0) if isinstance(info, dict) else None
    return round if isinstance(round, int) and round >= 0 else None
