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

A newcomer downloads the state in shares from every peer that publishes the donor's digest for its round,
at once (each sends a slice of every tensor): a donor's uplink also carries its own averages.
A newcomer whose state arrived rounds old (a large model over a slow link) replays the rounds since rather
than download again (decentral.rounds): on the `rounds` stream, a peer that holds the state a request names
keeps the rounds after it and hands out their committed averages in the codec's bytes; the newcomer asks
every member that kept them for a share, in parallel (the peers at the donor's round are asked to keep them
as the download starts).

A state travels as a tensor message (decentral.swarm.wire): neither side holds a serialised copy of it.
The swarm's timeout bounds the wait for each piece of a download, not the whole download, which on a slow
link takes minutes for a large model (57M parameters' φ and momentum at 20 Mb/s: 3 minutes); a long one
logs its progress. A donor ends a transfer whose requester stopped reading for REQUEST_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import random
import threading
from concurrent.futures import Future
from typing import Callable

import torch

from decentral.codec import Codec
from decentral.rounds import RoundLog
from decentral.swarm.peer import SwarmPeer
from decentral.swarm.wire import (MAX_FRAME, MAX_HEADER, WireError, read_frame, read_header, read_tensor_message,
                                  write_frame, write_frame_of, write_message, write_tensor_message)
from decentral.transport import (EncodedAverage, JoinRequest, MissedRound, StateUnavailable, all_finite,
                                 heartbeat_digest, state_digest, trained_past)

log = logging.getLogger(__name__)
progress_log = logging.getLogger("decentral.progress")  # shown without --verbose: the CLI sets it to INFO

REQUEST_TIMEOUT_S = 30.0  # a state request must arrive within this time
MAX_JOIN_REQUESTS = 8  # join requests waiting for our protocol at once; more are refused
MAX_SHARES = 64  # peers a newcomer fetches shares of a state, or of the rounds since it, from at once
HOLDER_POLL_S = 1.0  # a state's share waits for a peer a round behind to hold it: its heartbeat looked up this often
PROGRESS_LOG_S = 10.0  # a state download that takes longer says how far it is this often
STATE_GROWTH = 4  # a donor's state may hold this many times the bytes of ours (+ MAX_HEADER): the same tensors, and
# up to three model-sized vectors of an inner optimizer ours has not made yet (DDP's AdamW before its first step)

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
        peer.add_handler("rounds", self._on_rounds)
        self.rounds = RoundLog()  # our last round, and those since a state we served: replayed instead of downloads

    def offer(self, meta: dict, tensors: dict[str, torch.Tensor], digest: str | None = None,
              led_by: EncodedAverage | None = None) -> None:
        """Make (meta, tensors) what we hand out; the tensors must not be modified afterwards. `digest`:
        their `state_digest`, when the caller has it; `led_by`: the average that turned our previous offer
        into this one (kept for newcomers that hold an older state: `self.rounds`)."""
        self._snapshot = (dict(meta), tensors, digest or state_digest(tensors))
        self.rounds.offered(meta, self._snapshot[2], led_by, sum(t.nbytes for t in tensors.values()),
                            busy=bool(self._transfers))

    async def _request(self, reader: asyncio.StreamReader) -> dict:
        """A requester's JSON object (within REQUEST_TIMEOUT_S); WireError when it is none, and the peer drops
        the stream with a warning."""
        return await asyncio.wait_for(read_header(reader, self.peer.stats), REQUEST_TIMEOUT_S)

    async def _on_rounds(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Hand out the rounds since the state whose digest the request names ("after"; from now on we keep the
        rounds after it, if it is a state we hold: decentral.rounds): a header that lists them (meta, digest,
        and each chunk's element count, or null for a round that changed nothing), then, in one frame, the
        chunks of the averages in the requested share ("share": [i, n]: `_pieces_of_share` of the first "count"
        rounds, all of them without a count; none without a share, a list only)."""
        request = await self._request(reader)
        after, share, upto = request.get("after"), request.get("share"), request.get("count")
        i, n = share if _is_share(share) else (0, 0)
        rounds = None
        if isinstance(after, str) and not self._closing:
            self.rounds.want(after)
            rounds = self.rounds.since(after)
        if rounds is None:
            await write_message(writer, {"ok": False}, b"", self.peer.stats)
            return
        numels = [None if r.average is None else [numel for _, numel in r.average.chunks] for r in rounds]
        pieces = _pieces_of_share(numels, upto if type(upto) is int and upto >= 0 else len(rounds),
                                  (i, n) if n else None)
        step_now = self.live_step() if self.live_step is not None else None
        header = {"ok": True, "step_now": step_now, "rounds": [
            {"meta": r.meta, "digest": r.digest, "numels": chunks} for r, chunks in zip(rounds, numels)]}
        chunks = [rounds[k].average.chunks[c][0] for k, c in pieces]
        async with self._transfer(reader), _sending_watch() as watch:
            await write_frame(writer, json.dumps(header).encode(), self.peer.stats)
            await write_frame_of(writer, chunks, sum(len(c) for c in chunks), self.peer.stats, watch)

    async def _on_request(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await self._request(reader)
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
        share = request.get("share")
        if _is_share(share):  # a share of it, for a newcomer that downloads the state from several peers at once
            if request.get("digest") != digest:
                await write_message(writer, {"ok": False}, b"", self.peer.stats)
                return
            tensors = {k: t.reshape(-1).tensor_split(share[1])[share[0]] for k, t in tensors.items()}
        self.rounds.want(digest)  # the rounds after this state: the newcomer replays them rather than download again
        await write_tensor_message(writer, {"ok": True, "meta": meta, "step_now": step_now}, tensors, self.peer.stats,
                                   on_progress=watch)
        self.rounds.want(digest)  # for KEEP_S from the download's end

    async def _on_join(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Queue the sender's request for our protocol and stream back the state it grants, or a refusal
        (when it refuses, does not answer within `join_timeout`, takes no requests (it never asked for
        them: not DDP, or not started), or too many wait already)."""
        await self._request(reader)
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
            async with self._asking(donor, "join", {}) as reader:
                header, tensors = await read_tensor_message(reader, self.peer.stats, on_progress=watch)
        if not header.get("ok"):
            return None
        return _served_snapshot(header, tensors)

    @contextlib.asynccontextmanager
    async def _asking(self, peer: str, stream: str, request: dict):
        """A stream to `peer`'s `stream` handler with `request` sent on it: yields its reader; closed after the
        block (a server that waits for the close, `_transfer`, knows then that its answer has arrived)."""
        reader, writer = await self.peer.open_stream_or_again(peer, stream)
        try:
            await write_frame(writer, json.dumps(request).encode(), self.peer.stats)
            yield reader
        finally:
            writer.close()

    async def _download(self, donor: str, have: str | None, timeout: float, meta_if_past: bool = False,
                        max_bytes: int = MAX_FRAME) -> Snapshot | str | None:
        """The donor's snapshot; "same" when it equals the state whose digest is `have`; None if it has none;
        with `meta_if_past`, only its meta (tensors {}) when the donor trained past it. TimeoutError when no
        byte arrives for `timeout` (however long the whole download takes on a slow link); WireError, before
        anything is allocated, when it announces more than `max_bytes`."""
        async with _receiving_watch(donor, first_byte_s=timeout, idle_s=timeout) as watch:
            async with self._asking(donor, "state", {"have": have, "meta_if_past": meta_if_past}) as reader:
                header, tensors = await read_tensor_message(reader, self.peer.stats, max_bytes, on_progress=watch)
        if not header.get("ok"):
            return None
        if header.get("same"):
            return "same"
        return _served_snapshot(header, tensors)

    async def _download_shares(self, holders: list[str], digest: str, like: dict[str, torch.Tensor], timeout: float,
                               pending: frozenset[str] = frozenset(), holds: Callable[[str], bool] | None = None
                               ) -> Snapshot | None:
        """The state whose digest is `digest`, in as many shares as `holders` (each peer sends a slice of every
        tensor, read straight into place; the first holder is the donor), at once. A share whose holder no
        longer holds the state, or fails, comes from the other holders in turn (the donor first); None when
        none of them can send it. A holder in `pending` does not hold the state yet (a round behind the donor:
        its boundary is near): its share waits until `holds(holder)` (a blocking check of its heartbeat), and
        comes from the others once the donor has sent its own first. `like`: tensors of the state's names,
        dtypes and shapes (our own state). ValueError when what arrived is not that state; a holder fails as in
        `_download` (TimeoutError)."""
        tensors = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in like.items()}
        failed: set[str] = set()  # holders that no longer hold the state, or failed: not asked again
        donor_done = asyncio.Event()  # the donor's own share is in (or failed): it is free for another

        async def share(i: int) -> dict | None:
            into = {name: t.reshape(-1).tensor_split(len(holders))[i] for name, t in tensors.items()}
            what = f"share {i + 1}/{len(holders)} of the state"
            if holders[i] in pending:
                while not await asyncio.to_thread(holds, holders[i]):
                    if donor_done.is_set():
                        failed.add(holders[i])
                        break
                    await asyncio.sleep(HOLDER_POLL_S)  # polling its heartbeat for the donor's digest
            for holder in [holders[i], *(h for h in holders if h != holders[i])]:
                if holder in failed:
                    continue
                try:
                    async with _receiving_watch(holder, timeout, timeout, what) as watch:
                        async with self._asking(holder, "state", {"share": [i, len(holders)], "digest": digest}
                                                ) as reader:
                            header, got = await read_tensor_message(reader, self.peer.stats, on_progress=watch,
                                                                    into=into)
                except Exception as e:  # its slice (partly written, perhaps) is asked of the next holder
                    log.info("%s from %s failed: %r", what, holder[-8:], e)
                    header, got = {}, {}
                if header.get("ok") and got:
                    return header
                if not header.get("ok"):
                    log.info("%s: %s no longer holds the state", what, holder[-8:])
                failed.add(holder)
            return None

        async def donors_share() -> dict | None:
            try:
                return await share(0)
            finally:
                donor_done.set()

        headers = await asyncio.gather(donors_share(), *(share(i) for i in range(1, len(holders))))
        if not all(headers):
            return None
        if state_digest(tensors) != digest:
            raise ValueError("the state assembled from its shares is not the one its holders publish")
        return _served_snapshot(headers[0], tensors)

    def fetch_rounds(self, holders: list[str], digest: str, numel: int, codec: Codec, timeout: float
                     ) -> tuple[list[MissedRound], int] | None:
        """The rounds the first of `holders` (the donor of our state) kept since the state whose digest is
        `digest` (see decentral.rounds), each an average of exactly `numel` values in `codec` (checked before a
        byte of them is read), and its inner step. The averages come in shares from every holder that kept
        the same rounds, in parallel, each round's chunks from several of them (as many rounds as the holder
        that kept the most of them; the rest, the donor's alone, at the next call): a donor's uplink also
        carries its own averages, so one alone may send a round's average barely faster than the swarm
        averages the next. None when the donor kept none, or its transfer failed (no byte for `timeout`);
        rounds from the first one a share failed to bring are left for the next call."""
        try:
            return self.peer.call(self._fetch_rounds(holders, digest, numel, codec, timeout)).result()
        except Exception as e:
            log.info("fetching the rounds since our state from %s failed: %r", holders[0][-8:], e)
            return None

    async def _fetch_rounds(self, holders: list[str], digest: str, numel: int, codec: Codec, timeout: float
                            ) -> tuple[list[MissedRound], int] | None:
        lists = await asyncio.gather(*(self._rounds_from(h, digest, numel, codec, timeout) for h in holders),
                                     return_exceptions=True)
        if not isinstance(lists[0], tuple):
            if isinstance(lists[0], BaseException):
                raise lists[0]
            return None
        listed = [entry[:3] for entry in lists[0][0]]
        if not listed:
            return [], lists[0][1]
        agreed = {h: _agreeing(got[0], listed) for h, got in zip(holders[1:], lists[1:]) if isinstance(got, tuple)}
        count = max(agreed.values(), default=0) or len(listed)  # the rounds others kept too; none: the donor's all
        sharing = [holders[0], *(h for h, n in agreed.items() if n >= count)]  # a holder a round behind still helps
        shares = await asyncio.gather(*(self._rounds_from(h, digest, numel, codec, timeout, (i, len(sharing)), count)
                                        for i, h in enumerate(sharing)), return_exceptions=True)
        wanted = lists[0][0][:count]
        every_piece = _pieces_of_share([numels for _, _, numels, _ in wanted], count, (0, 1))
        sender = {piece: shares[g % len(sharing)] for g, piece in enumerate(every_piece)}

        def chunk(k: int, c: int) -> memoryview | None:
            """Round k's chunk c, from the share that carries it; None when it did not come."""
            share = sender[(k, c)]
            got = share[0][k] if isinstance(share, tuple) and len(share[0]) > k else None
            return got[3].get(c) if got is not None and got[1:3] == wanted[k][1:3] else None

        rounds = []
        for k, (meta, round_digest, numels, _) in enumerate(wanted):
            chunks = [(chunk(k, c), n) for c, n in enumerate(numels or [])]
            if any(data is None for data, _ in chunks):
                break
            rounds.append(MissedRound(meta, round_digest, None if numels is None else EncodedAverage(codec, chunks)))
        return rounds, lists[0][1]

    async def _rounds_from(self, holder: str, digest: str, numel: int, codec: Codec, timeout: float,
                           share: tuple[int, int] | None = None, count: int | None = None
                           ) -> tuple[list[tuple[dict, str, list[int] | None, dict[int, bytes]]], int] | None:
        """One holder's answer to a rounds request: [(meta, digest, chunk sizes or None, {chunk: its bytes} of
        those its `share` of the first `count` rounds carries)], its step; None when it holds no such state."""
        async with _receiving_watch(holder, timeout, timeout, "the rounds since our state") as watch:
            async with self._asking(holder, "rounds", {"after": digest, "share": share, "count": count}) as reader:
                header = await read_header(reader, self.peer.stats)
                if not header.get("ok"):
                    return None
                listed = _checked_rounds(header.get("rounds"), numel)
                pieces = _pieces_of_share([numels for _, _, numels in listed],
                                          len(listed) if count is None else count, share)
                total = sum(codec.size(listed[k][2][c]) for k, c in pieces)
                payload = memoryview(await read_frame(reader, self.peer.stats, total, on_progress=watch))
        if len(payload) != total:
            raise WireError(f"the rounds' averages came in {len(payload)} bytes, their list says {total}")
        carried, at = [{} for _ in listed], 0
        for k, c in pieces:
            size = codec.size(listed[k][2][c])
            carried[k][c], at = payload[at:at + size], at + size
        step_now = header.get("step_now")
        return [(*entry, got) for entry, got in zip(listed, carried)], step_now if isinstance(step_now, int) else 0

    def keep_rounds_for(self, holders: list[str], digest: str) -> None:
        """Ask `holders` to keep the rounds after the state whose digest is `digest` (the one we download from
        our donor; a holder that does not offer it ignores this), so that they can send shares of them
        (`fetch_rounds`); not waited for."""
        for holder in holders:
            self.peer.call(self._ask_to_keep(holder, digest))

    async def _ask_to_keep(self, holder: str, digest: str) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                async with self._asking(holder, "rounds", {"after": digest}) as reader:
                    await read_header(reader, self.peer.stats)

    def fetch(
        self, candidates: dict[str, dict], timeout: float, have: dict[str, torch.Tensor] | None = None,
        meta_if_past: bool = False, progress: Callable[[], dict[str, dict]] | None = None,
    ) -> tuple[str, Snapshot] | None:
        """Download a snapshot from one of `candidates` ({peer: {"round": r}}) that claim the highest round
        (at most one past their lower median), in random order, those that publish the state most of them
        publish for that round first; a donor's state must be the one it publishes (`_check_published`).

        When other candidates publish the donor's digest for that round, the state comes in shares from all
        of them at once (`_download_shares`; from the donor alone when none of them can send a share); with
        `progress` (the live heartbeats), from those a round behind too, once they publish it.
        Returns (donor, snapshot), or None when no candidate has one to serve, or when the first that
        could holds exactly `have` (the state we would offer ourselves) and has not trained since. Raises
        StateUnavailable when a download failed (one fails when no byte of it arrives for `timeout`) and
        none succeeded. The snapshot's meta gains `donor_step`, the donor's inner step when it served it.
        `meta_if_past`: see `_download`. With `have`, a donor that announces a state of more than STATE_GROWTH times
        its bytes is refused before any of it is allocated (a state of another model, or a lie).
        """
        have_digest = state_digest(have) if have is not None else None
        max_bytes = MAX_FRAME if have is None else STATE_GROWTH * sum(t.nbytes for t in have.values()) + MAX_HEADER
        rounds = {p: _claimed_round(info) for p, info in candidates.items() if p != self.peer.peer_id}
        rounds = {p: r for p, r in rounds.items() if r is not None}
        if not rounds:
            return None
        ceiling = sorted(rounds.values())[(len(rounds) - 1) // 2] + 1
        top = max(r for r in rounds.values() if r <= ceiling)
        order = [p for p, r in rounds.items() if r == top]  # a peer behind the others (restarted) is no donor
        random.shuffle(order)
        published = {p: heartbeat_digest(candidates[p], top) for p in order}
        held_by = collections.Counter(d for d in published.values() if d is not None)
        order.sort(key=lambda p: -held_by[published[p]])  # the state most of them publish first: not a lone liar's
        failed = []
        for donor in order:
            digest = published[donor]
            if digest is not None and digest != have_digest:  # a download: the others at its round keep what follows
                self.keep_rounds_for([p for p in order if p != donor], digest)  # (those that hold it: see `want`)
                holders = [p for p in order if p != donor and published[p] == digest]
                pending = [p for p, r in rounds.items() if r == top - 1] if progress is not None else []
                if (holders or pending) and have is not None and not meta_if_past:
                    def holds(p: str) -> bool:
                        return heartbeat_digest(progress().get(p), top) == digest

                    try:
                        got = self.peer.call(self._download_shares([donor, *holders, *pending], digest, have, timeout,
                                                                   frozenset(pending), holds)).result()
                    except Exception as e:  # not the state published: the whole state from the donor alone
                        log.info("state download in shares from %d peers failed: %r", 1 + len(holders) + len(pending),
                                 e)
                        got = None
                    if got is not None:
                        return donor, got
            try:
                got = self.peer.call(self._download(donor, have_digest, timeout, meta_if_past, max_bytes)).result()
                if isinstance(got, tuple) and got[1]:
                    _check_published(got, candidates[donor], progress and (lambda: progress().get(donor)))
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
async def _receiving_watch(donor: str, first_byte_s: float, idle_s: float, what: str = "the state"):
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
            progress_log.info("downloading %s of %s: %.0f of %.0f MiB (%.1f MiB/s)", what, donor[-8:],
                              done / 2**20, total / 2**20, done / 2**20 / (now - began))

    try:
        async with asyncio.timeout(first_byte_s) as clock:
            yield watch
    except TimeoutError:
        raise TimeoutError(f"no byte of {what} from {donor[-8:]} for {waited:g}s") from None


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


def _served_snapshot(header: dict, tensors: dict[str, torch.Tensor]) -> Snapshot:
    """The state a donor served (`header`: its answer), its meta with `donor_step`, its inner step then.
    WireError unless the meta is an object whose round, and inner step where it names one, are counts (whatever
    else a protocol keeps there is the protocol's to check), and unless every value of `tensors` is finite (a
    member's own state never holds NaN or inf: its protocol stops before it syncs one)."""
    not_finite = [name for name, t in tensors.items() if not all_finite(t)]
    if not_finite:
        raise WireError(f"a state holding NaN or inf (in {', '.join(not_finite)})")
    meta = header.get("meta")
    counts = isinstance(meta, dict) and "round" in meta and all(
        type(meta.get(key, 0)) is int and meta.get(key, 0) >= 0 for key in ("round", "step"))
    if not counts:
        raise WireError(f"a state whose meta names no round and inner step: {str(meta)[:120]}")
    meta = dict(meta)
    if isinstance(header.get("step_now"), int):
        meta["donor_step"] = header["step_now"]
    return meta, tensors


def _check_published(snapshot: Snapshot, heartbeat: dict, latest: Callable[[], object] | None) -> None:
    """WireError unless the donor's `snapshot` is the state whose digest its `heartbeat` publishes for the
    snapshot's round, where it publishes one (a member that serves another state than the one it publishes, or
    than the one the other members hold, is no donor). When it differs, or none was published yet, the donor's
    `latest` heartbeat has the last word (its state was repaired, or it moved on to a round, since)."""
    meta, tensors = snapshot
    digest = state_digest(tensors)
    published = heartbeat_digest(heartbeat, meta["round"])
    if published != digest and latest is not None:
        published = heartbeat_digest(latest(), meta["round"])
    if published is not None and published != digest:
        raise WireError(f"a state of round {meta['round']} other than the one it publishes for that round")


def _checked_rounds(listed: object, numel: int) -> list[tuple[dict, str, list[int] | None]]:
    """A `rounds` answer's list as (meta, digest, chunk sizes or None); WireError unless each names a round
    and its chunks add up to `numel` values."""
    if not isinstance(listed, list):
        raise WireError("a rounds answer without its list of rounds")
    checked = []
    for entry in listed:
        numels = entry.get("numels") if isinstance(entry, dict) else None
        if not (isinstance(entry, dict) and isinstance(entry.get("meta"), dict)
                and isinstance(entry["meta"].get("round"), int) and isinstance(entry.get("digest"), str)
                and (numels is None or (isinstance(numels, list) and all(type(n) is int and n >= 0 for n in numels)
                                        and sum(numels) == numel))):
            raise WireError(f"a round listed as {str(entry)[:120]!r}, not a round's meta, digest and {numel} values")
        checked.append((entry["meta"], entry["digest"], numels))
    return checked


def _pieces_of_share(numels: list[list[int] | None], count: int, share: tuple[int, int] | None
                     ) -> list[tuple[int, int]]:
    """The (round, chunk) pieces a share [i, n] of the first `count` rounds' averages carries (none without a
    share): every chunk of those rounds in order, the ones at i, i + n, ...: each round's chunks come from
    several holders, so that even one round comes over every holder's uplink."""
    if share is None:
        return []
    pieces = [(k, c) for k, chunks in enumerate(numels[:count]) if chunks is not None for c in range(len(chunks))]
    return pieces[share[0]::share[1]]


def _is_share(share: object) -> bool:
    """Whether a state or rounds request's share is [i, n] with 0 <= i < n <= MAX_SHARES."""
    return (isinstance(share, list) and len(share) == 2 and all(type(v) is int for v in share)
            and 0 <= share[0] < share[1] <= MAX_SHARES)


def _agreeing(answer: list[tuple], listed: list[tuple[dict, str, list[int] | None]]) -> int:
    """How many of the donor's `listed` rounds (meta, digest and chunk sizes: an island in sharded mode cuts
    an average into other chunks than a flat peer) a holder's answer lists the same, from the first on."""
    same = 0
    while same < min(len(answer), len(listed)) and answer[same][:3] == listed[same]:
        same += 1
    return same


def _claimed_round(info: dict) -> int | None:
    """The round a heartbeat claims, or None when it is not a round number."""
    round = info.get("round", 0) if isinstance(info, dict) else None
    return round if isinstance(round, int) and round >= 0 else None
