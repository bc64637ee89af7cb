"""Publish experts to a swarm and fetch them from it: a DHT record per expert, files over direct streams.

A publisher stores `experts` → `{name}/{peer id}` → the expert's `expert.json` record in the swarm's
DHT (refreshed while it serves; gone within `RECORD_TTL_S` after it stops) and answers `expert`
streams: a request names an expert, a file and which of its bytes (from where, up to where), the answer is
those bytes in chunks. A fetcher reads the records and downloads each file into a partial folder: in pieces
from all its publishers at once (pieces that come ahead of a missing one wait there in files of their own),
and with one publisher left, from where the last one stopped. It hashes the file as its bytes come in order,
and installs the expert in its registry only when every file has the size and sha256 of the record; anything
else (publishers that died mid-transfer, bytes that do not match) leaves the registry as it was, and the
bytes that came in the partial folder for the next fetch. Pieces from several that add up to other bytes
than the record's are fetched again whole from one at a time; the right file then names whose were wrong.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import fcntl
import glob
import hashlib
import json
import logging
import os
import random
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from decentral.experts.registry import (
    OPTIMIZER_FILE, Expert, Registry, RegistryError, expert_from_json, staging, verify_expert, write_meta,
)
from decentral.swarm.peer import SwarmPeer
from decentral.swarm.wire import WireError, read_frame, read_header, write_frame

log = logging.getLogger(__name__)

RECORD_TTL_S = 30.0
CHUNK_BYTES = 1 << 20
CHUNK_TIMEOUT_S = 30.0  # a publisher that sends nothing for this long is given up on
PARALLEL_PUBLISHERS = 8  # the most publishers a file comes from at once
PIECES_EACH = 4  # a piece is at most 1/(this many x publishers) of the file (uplinks that differ share it by speed)...
FIRST_PIECE_BYTES = CHUNK_BYTES // 4  # ... or this, if more; and a publisher's first piece (its rate not known yet)
MAX_PIECE_BYTES = 4 * CHUNK_BYTES  # ... and at most this (a piece is held in memory while it comes)
PIECE_SECONDS = 2.0  # a publisher's next piece: what its last one's rate carries in this long (within the above)
REQUEST_SHARE = 8  # a piece is at least what its publisher's rate carries in this many times the wait for its
MIN_PIECE_BYTES = 16 * 1024  # last answer (`smallest_piece`: worth its request), within this and FIRST_PIECE_BYTES
PIECES_AHEAD = 2  # per publisher: how far past the first missing piece a piece is asked for


@dataclass
class Published:
    """An expert as the swarm's records describe it, and who serves it (`without_optimizer`: those of `peers`
    that publish its model alone, having fetched it with --no-optimizer)."""

    expert: Expert
    peers: list[str]
    without_optimizer: set[str] = field(default_factory=set)

    def files(self, with_optimizer: bool = True) -> dict[str, tuple[str, int]]:
        """{file name: (sha256, size)} of what a download fetches (`Expert.files`, less the optimizer state
        unless `with_optimizer`)."""
        return self.expert.files(with_optimizer)


class ExpertSharing:
    """Serve the experts of `registry` that we publish, and fetch others' into it, over `peer`."""

    def __init__(self, peer: SwarmPeer, registry: Registry):
        self.peer = peer
        self.registry = registry
        self._published: dict[str, Expert] = {}
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        peer.add_handler("expert", self._serve)

    # ----- publishing -----
    def publish(self, names: list[str]) -> list[Expert]:
        """Verify and announce these experts of our registry; keeps announcing them until `close`."""
        experts = [self.registry.get(name) for name in names]
        for expert in experts:
            verify_expert(expert)
            self._published[expert.name] = expert
        self._announce()
        if self._refresher is None:
            self._refresher = threading.Thread(target=self._refresh, name="expert-records", daemon=True)
            self._refresher.start()
        return experts

    def _announce(self, wait: bool = True) -> None:
        """Store our records; without `wait`, return once the stores are sent (`SwarmPeer.publish_nowait`: a
        renewal that waited out a hung DHT node's timeouts, twice per expert, let the others' records lapse)."""
        store = self.peer.publish if wait else self.peer.publish_nowait
        for name, expert in list(self._published.items()):
            store("experts", f"{name}/{self.peer.peer_id}", expert.to_json(), ttl=RECORD_TTL_S)

    def _refresh(self) -> None:
        while not self._stop.wait(RECORD_TTL_S / 3):
            try:
                self._announce(wait=False)
            except Exception as e:  # the next refresh may go through
                log.warning("could not refresh expert records: %s", e)

    async def _serve(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A request names an expert, one of its files and the bytes of it to send: from "offset" (default 0: a
        fetch that another publisher left mid-file goes on from there) up to "end" (default: the file's end; a
        piece of a fetch from several publishers at once). The answer says so ({"ok": true, "offset": n,
        "end": m}) and sends those bytes in chunks, then an empty one."""
        request = await asyncio.wait_for(read_header(reader, self.peer.stats), CHUNK_TIMEOUT_S)
        expert = self._published.get(str(request.get("name")))
        name, offset = request.get("file"), request.get("offset", 0)
        files = expert.files() if expert is not None else {}
        size = files[name][1] if isinstance(name, str) and name in files else -1
        end = request.get("end", size)
        if type(offset) is not int or type(end) is not int or not 0 <= offset <= end <= size:
            await write_frame(writer, json.dumps({"ok": False}).encode(), self.peer.stats)
            return
        await write_frame(writer, json.dumps({"ok": True, "offset": offset, "end": end}).encode(), self.peer.stats)
        loop = asyncio.get_running_loop()
        with open(expert.folder / name, "rb") as f:
            f.seek(offset)
            while offset < end and (chunk := await loop.run_in_executor(None, f.read, min(CHUNK_BYTES, end - offset))):
                offset += len(chunk)
                await write_frame(writer, chunk, self.peer.stats)
        await write_frame(writer, b"", self.peer.stats)

    # ----- finding and fetching -----
    def available(self) -> dict[str, list[Published]]:
        """What the swarm publishes now: {name: [one entry per distinct sha256, with its publishers]}."""
        found: dict[str, dict[str, Published]] = {}
        for subkey, record in self.peer.lookup("experts").items():
            name, _, peer = subkey.rpartition("/")
            try:
                expert = expert_from_json(record, f"record {subkey}")
            except RegistryError as e:
                log.warning("ignoring a malformed expert record: %s", e)
                continue
            if expert.name != name:
                continue
            entry = found.setdefault(name, {}).setdefault(expert.sha256, Published(expert, []))
            entry.peers.append(peer)
            if not expert.optimizer:
                entry.without_optimizer.add(peer)
            elif not entry.expert.optimizer:  # (a version is its model: the records that carry more describe it)
                entry.expert = expert
        return {name: list(by_hash.values()) for name, by_hash in sorted(found.items())}

    def find(self, name: str, sha256: str | None = None) -> Published:
        """The version of expert `name` the swarm publishes now (`sha256`, a prefix, picks one where publishers
        disagree); RegistryError when nobody publishes it, or publishers disagree and `sha256` does not pick."""
        available = self.available()
        versions = available.get(name, [])
        if sha256:
            versions = [v for v in versions if v.expert.sha256.startswith(sha256)]
        if not versions:
            others = sorted(set(available) - {name})
            said = f"nobody in the swarm publishes expert {name!r}" + (f" with sha256 {sha256}" if sha256 else "")
            if others and not sha256:
                said += f" (it publishes {', '.join(others)})"
            elif not available:
                said += f" (nobody publishes any in run {self.peer.run!r}: is it the run they publish in?)"
            raise RegistryError(said)
        if len(versions) > 1:
            hashes = ", ".join(v.expert.sha256[:12] for v in versions)
            raise RegistryError(f"expert {name!r} is published with different contents ({hashes}): "
                                "pick one with --sha256")
        return versions[0]

    def fetch(self, name: str, *, sha256: str | None = None, with_optimizer: bool = True,
              progress: Callable[[int], None] | None = None) -> Expert:
        """Download expert `name` (the version `find` gives) into our registry: `download`."""
        return self.download(self.find(name, sha256), with_optimizer=with_optimizer, progress=progress)

    def download(self, published: Published, *, with_optimizer: bool = True,
                 progress: Callable[[int], None] | None = None) -> Expert:
        """Download a version `find` gave into our registry, checked against its record's hashes; returns it.
        Each file comes in pieces from all its publishers at once, then from one at a time, in random order,
        each going on from where the last stopped (`_fetch_file`). RegistryError, with each publisher's failure,
        when none is left; what arrived is kept for the next download of this version (`_partial_download`)."""
        expert, name, files = published.expert, published.expert.name, published.files(with_optimizer)
        if not with_optimizer:
            expert.optimizer = None  # (its expert.json then names none)
        peers = [p for p in published.peers if OPTIMIZER_FILE not in files or p not in published.without_optimizer]
        peers, errors = random.sample(peers, len(peers)), []
        with _partial_download(self.registry, name, files) as partial:
            for file, (digest, size) in files.items():
                if not self._fetch_file(peers, errors, name, file, partial / file, digest, size, progress):
                    kept = sum(path.stat().st_size for path in partial.iterdir() if path.name != ".lock")
                    if not kept:
                        shutil.rmtree(partial, ignore_errors=True)
                    raise RegistryError(f"could not fetch expert {name!r}: " + "; ".join(errors) + (
                        f" ({kept:,} bytes of it are kept in {partial}: fetch it again to go on from there)"
                        if kept else ""))
            with staging(self.registry.folder(name)) as tmp:
                for file in files:
                    os.replace(partial / file, tmp / file)
                write_meta(tmp, expert)
            shutil.rmtree(partial, ignore_errors=True)  # (while we hold its lock)
        return self.registry.get(name)

    def _fetch_file(self, peers: list[str], errors: list[str], name: str, file: str, path: Path, digest: str,
                    size: int, progress: Callable[[int], None] | None) -> bool:
        """Write file `file` of expert `name` to `path` with the record's `size` and `digest`, after the bytes an
        earlier download left there; whether that worked. With several `peers` the rest comes in pieces from all
        of them at once (`_download_pieces`); what that leaves comes from the first of `peers` that delivers it. A
        publisher that fails then is removed from `peers` (its failure added to `errors`), and the next goes on
        from the bytes it sent. A file whose bytes all came and are not the record's starts over: from the next
        publisher, or from the same one when it went on from others' bytes (those may be the wrong ones). When
        pieces from several added up to other bytes and the file then came right, the publishers whose pieces
        were not its bytes are named and removed from `peers` (`_drop_who_sent_other_bytes`)."""
        pieces: list[tuple[int, int, str, str]] = []  # of a download from several whose bytes were not the record's
        with _Part(path, size, progress) as part:
            if part.received > size:  # (not what an earlier download of this version left)
                part.restart()
            if len(peers) > 1 and size - part.received > CHUNK_BYTES:
                pieces = self.peer.call(self._download_pieces(peers, name, file, part, size)).result()
                if part.received == size and part.hexdigest() == digest:
                    return True
                if part.received == size:  # someone's pieces are not the record's bytes: whose, only the file says
                    log.warning("fetching %s: %s from several publishers does not match the record; fetching it "
                                "whole from one at a time", name, file)
                    part.restart()
                else:
                    pieces = []
            fetched = self._from_one_at_a_time(peers, errors, name, file, part, digest, size)
        if fetched and pieces:
            self._drop_who_sent_other_bytes(peers, errors, name, file, path, pieces)
        return fetched

    def _from_one_at_a_time(self, peers: list[str], errors: list[str], name: str, file: str, part: _Part,
                            digest: str, size: int) -> bool:
        """The rest of `part` from the first of `peers` that delivers it (see `_fetch_file`); whether one did."""
        while peers:
            peer, resumed = peers[0], part.received > 0
            try:
                self.peer.call(self._download_file(peer, name, file, part, size)).result()
                failure = None
            except Exception as e:
                failure = e
            if failure is None:  # the publisher says it sent it all
                if part.received == size and part.hexdigest() == digest:
                    return True
                failure = RegistryError(f"{name}/{file}: downloaded {part.received} bytes whose sha256 does not "
                                        "match the record")
                if part.received == size:  # not the record's bytes
                    part.restart()
                    if resumed:
                        log.warning("fetching %s: %s; fetching the whole file from %s", name, failure, peer[-8:])
                        continue
            errors.append(f"{peer[-8:]}: {failure}")
            peers.pop(0)
            if peers:
                log.warning("fetching %s from %s failed (%s); %s", name, peer[-8:], failure,
                            f"going on at byte {part.received:,} of {file} with another publisher"
                            if part.received else "trying another publisher")
        return False

    @staticmethod
    def _drop_who_sent_other_bytes(peers: list[str], errors: list[str], name: str, file: str, path: Path,
                                   pieces: list[tuple[int, int, str, str]]) -> None:
        """Each publisher among `pieces` (first byte, end, publisher, sha256) whose bytes differ from the file at
        `path`, which holds the record's: named in a warning and in `errors`, and removed from `peers` (it is
        not asked for the expert's other files)."""
        wrong: dict[str, int] = {}
        with open(path, "rb") as f:
            for start, end, peer, sha256 in pieces:
                f.seek(start)
                if hashlib.sha256(f.read(end - start)).hexdigest() != sha256:
                    wrong[peer] = wrong.get(peer, 0) + 1
        for peer, count in wrong.items():
            log.warning("fetching %s: %s sent %d piece(s) of %s that are not the record's bytes; not asking it for "
                        "more", name, peer[-8:], count, file)
            errors.append(f"{peer[-8:]}: sent pieces of {file} that are not the record's bytes")
            if peer in peers:
                peers.remove(peer)

    async def _download_pieces(self, peers: list[str], name: str, file: str, part: "_Part", size: int
                               ) -> list[tuple[int, int, str, str]]:
        """Fetch `file` from `part.received` to `size` in pieces from up to `PARALLEL_PUBLISHERS` of `peers` at
        once, each asking for the next piece when its last one came (a faster uplink carries more of them), and
        append them to `part` in order: one that comes before those ahead of it waits beside the file
        (`_Part.put_ahead`), where a fetch that stops leaves it for the next. A piece is as long as `piece_bytes`
        says for its publisher, and taken only within `PIECES_AHEAD` even shares per publisher of the first byte
        missing; a publisher with nothing left to take asks for the first missing piece too, and whichever copy
        comes first is kept, the other stopped (a slow publisher holds nobody up, and goes on to the next piece).
        A publisher that fails takes no more pieces (a warning says why); returns when the file is whole or every
        publisher failed, with the pieces this fetch took in: (first byte, end, publisher, sha256)."""
        publishers, kept = peers[:PARALLEL_PUBLISHERS], part.kept_ahead()
        free, at = [], part.received  # (first, end) of the bytes nobody asked for: between ours and those kept ahead
        for start, length in sorted(kept.items()):
            free.append((at, start))
            at = start + length
        free = [(first, end) for first, end in [*free, (at, size)] if first < end]
        even = -(-sum(end - first for first, end in free) // (PIECES_EACH * len(publishers)))  # (rounded up)
        largest = min(MAX_PIECE_BYTES, max(FIRST_PIECE_BYTES, even))
        ends: dict[int, int] = {}  # first byte -> end, of each piece asked for
        rates: dict[str, float] = {}  # publisher -> bytes per second its last piece came at
        answers: dict[str, float] = {}  # publisher -> the seconds its last piece's answer took to come
        asked: dict[int, int] = {}  # first byte -> how many publishers fetch that piece now
        came = set(kept)  # pieces that came ahead of the first one missing (in this fetch or an earlier one)
        copies: dict[int, set[asyncio.Future]] = {}  # first byte -> its downloads under way (one, or two)
        taken: list[tuple[int, int, str, str]] = []  # (first byte, end, publisher, sha256) of each piece taken in
        news = asyncio.Event()

        def next_piece(peer: str) -> int | None:
            if free and free[0][0] < part.received + PIECES_AHEAD * len(publishers) * largest:
                first, end = free.pop(0)
                left = end - first + sum(e - f for f, e in free)
                smallest = smallest_piece(rates.get(peer), answers.get(peer))
                cut = first + piece_bytes(largest, rates.get(peer), sum(rates.values()), left, smallest)
                if end - cut >= smallest:  # (else the rest comes along: no sliver of a piece)
                    free.insert(0, (cut, end))
                    end = cut
                ends[first] = end
                return first
            lagging = [start for start, count in asked.items() if count == 1 and start not in came]
            return min(lagging) if lagging and min(lagging) == part.received else None

        async def fetch_from(peer: str) -> None:
            while part.received < size:
                start = next_piece(peer)
                if start is None:
                    if not asked and not free:  # (nothing under way or left to ask for: no piece will come)
                        return
                    news.clear()
                    await news.wait()
                    continue
                asked[start] = asked.get(start, 0) + 1
                began, end = loop.time(), ends[start]
                download = asyncio.ensure_future(self._download_piece(peer, name, file, start, end))
                copies.setdefault(start, set()).add(download)
                try:
                    data, answers[peer] = await download
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():  # (the fetch is cancelled, not this copy)
                        raise
                    continue  # another copy of the piece came first: on to the next
                except Exception as e:
                    log.warning("fetching %s: %s stops sending pieces (%s)", name, peer[-8:], e)
                    rates.pop(peer, None)
                    answers.pop(peer, None)
                    return
                else:
                    rates[peer] = len(data) / max(loop.time() - began, 1e-3)
                    for other in copies.pop(start, set()) - {download}:
                        other.cancel()
                    if start >= part.received:
                        taken.append((start, start + len(data), peer, hashlib.sha256(data).hexdigest()))
                    if start == part.received:
                        part.append(data)
                        part.take_ahead()
                        came.difference_update([s for s in came if s < part.received])
                    elif start > part.received:
                        part.put_ahead(start, data)
                        came.add(start)
                    if part.received == size:  # (a copy of a piece still coming is not waited for)
                        for task in tasks:
                            if task is not asyncio.current_task():
                                task.cancel()
                finally:
                    copies.get(start, set()).discard(download)
                    asked[start] -= 1
                    if not asked[start]:
                        del asked[start]
                        if start >= part.received and start not in came:
                            bisect.insort(free, (start, end))  # (its publisher failed: another takes it)
                    news.set()

        loop = asyncio.get_running_loop()
        tasks = [asyncio.ensure_future(fetch_from(peer)) for peer in publishers]
        try:
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, Exception):  # not its publisher's failure (our disk's): said as it is
                    raise result
        finally:  # (when we are cancelled)
            for task in tasks:
                task.cancel()
        return taken

    async def _download_piece(self, peer: str, name: str, file: str, start: int, end: int) -> tuple[bytes, float]:
        """Bytes `start` to `end` of `file`, from `peer`; and the seconds its answer to the request took."""
        data = bytearray()
        with _publisher_errors(name, file, lambda: f"{len(data)} of the {end - start} bytes from byte {start:,}"):
            asked = asyncio.get_running_loop().time()
            reader, writer = await self._ask(peer, {"name": name, "file": file, "offset": start, "end": end})
            answer_s = asyncio.get_running_loop().time() - asked
            try:
                while len(data) < end - start:
                    chunk = await asyncio.wait_for(
                        read_frame(reader, self.peer.stats, min(CHUNK_BYTES, end - start - len(data))), CHUNK_TIMEOUT_S)
                    if not chunk:
                        raise ConnectionError("an early end")
                    data += chunk
            finally:
                writer.close()
        return bytes(data), answer_s

    async def _download_file(self, peer: str, name: str, file: str, part: "_Part", size: int) -> None:
        """Append what `peer` serves of `file` from `part.received` on to `part`, up to the recorded `size`. A
        publisher that answers from byte 0 (one from before offsets) starts the file over."""
        with _publisher_errors(name, file, lambda: f"{part.received} of {size} bytes"):
            reader, writer = await self._ask(peer, {"name": name, "file": file, "offset": part.received},
                                             from_the_start=part.restart)
            try:  # a piece longer than ours are, or past the recorded size, is refused unread
                while chunk := await asyncio.wait_for(
                        read_frame(reader, self.peer.stats, min(CHUNK_BYTES, size - part.received)), CHUNK_TIMEOUT_S):
                    part.append(chunk)
            finally:
                writer.close()

    async def _ask(self, peer: str, request: dict, from_the_start: Callable[[], None] | None = None
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A stream to `peer` on which it answered `request` with the bytes asked for to come. An answer from
        byte 0 to a request from elsewhere (a publisher from before offsets) calls `from_the_start`, else is
        refused."""
        reader, writer = await self.peer.open_stream_or_again(peer, "expert")
        try:
            await write_frame(writer, json.dumps(request).encode(), self.peer.stats)
            answer = await asyncio.wait_for(read_header(reader, self.peer.stats), CHUNK_TIMEOUT_S)
            if not answer.get("ok"):
                raise RegistryError(f"the publisher no longer serves {request['name']}/{request['file']}")
            if answer.get("offset", 0) != request["offset"]:
                if answer.get("offset", 0) != 0 or from_the_start is None:
                    raise WireError(f"it answered from byte {answer.get('offset')!r}, asked for {request['offset']}")
                from_the_start()
        except BaseException:
            writer.close()
            raise
        return reader, writer

    def close(self) -> None:
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(timeout=5)


@contextlib.contextmanager
def _publisher_errors(name: str, file: str, got: Callable[[], str]) -> Iterator[None]:
    """A publisher's failure to send bytes of `file` of expert `name` as a RegistryError that says how far it got
    (`got()`: "N of M bytes")."""
    try:
        yield
    except (asyncio.IncompleteReadError, ConnectionError):
        raise RegistryError(f"{name}/{file}: the publisher closed the connection after {got()} (it stopped, or its "
                            "copy is gone)") from None
    except WireError as e:
        raise RegistryError(f"{name}/{file}: the publisher's answer after {got()} is not one of ours: {e}") from None
    except TimeoutError:  # (asyncio.wait_for's: no message of its own)
        raise RegistryError(f"{name}/{file}: the publisher sent nothing for {CHUNK_TIMEOUT_S:g} s after {got()}"
                            ) from None


@contextlib.contextmanager
def _partial_download(registry: Registry, name: str, files: dict[str, tuple[str, int]]) -> Iterator[Path]:
    """The folder a download of `files` of expert `name` writes into, beside the registry's experts
    (`.NAME.partial-KEY`, KEY naming the files' hashes): kept when the download fails or is interrupted, so that
    the next one goes on from the bytes it holds; other versions' partial folders of that name are removed.
    RegistryError while another process downloads into it."""
    key = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:12]
    expert_folder = registry.folder(name)  # (a name fit for a folder)
    folder = expert_folder.parent / f".{expert_folder.name}.partial-{key}"
    for other in registry.root.glob(f".{expert_folder.name}.partial-*") if registry.root.is_dir() else []:
        if other != folder:
            with _locked(other) as held:
                if held:
                    shutil.rmtree(other, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder) as held:
        if not held:
            raise RegistryError(f"another process is fetching this version of expert {name!r} into {registry.root}")
        yield folder


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[bool]:
    """Whether we hold the lock of partial download `folder` (its .lock) for the block: False while another
    process does. A POSIX record lock, released when its holder ends, however it ends."""
    try:
        lock = open(folder / ".lock", "a")
    except OSError:  # (a folder another process removed meanwhile)
        yield False
        return
    with lock:
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True


def piece_bytes(largest: int, rate: float | None, total_rate: float, left: int, smallest: int) -> int:
    """How many bytes a publisher is asked for next: `FIRST_PIECE_BYTES` while its `rate` (bytes per second, its
    last piece's) is not known, then what that rate carries in `PIECE_SECONDS`, and its share `rate / total_rate`
    of the `left` bytes nobody has asked for, within `smallest` (`smallest_piece`) and `largest` (an even share of
    the file: 1/`PIECES_EACH` of it per publisher, at most `MAX_PIECE_BYTES`): a slow uplink's pieces are small,
    so the one it holds when the rest has come is little, and the last pieces shrink so that the publishers end
    together."""
    if rate is None:
        return FIRST_PIECE_BYTES
    return max(smallest, min(largest, int(rate * PIECE_SECONDS), int(left * rate / total_rate)))


def smallest_piece(rate: float | None, answer_s: float | None) -> int:
    """The fewest bytes worth asking a publisher for: what its `rate` carries in `REQUEST_SHARE` times the seconds
    its last answer took to come (asking then costs it at most that share of its time: on a link of long round
    trips, pieces stay large), within `MIN_PIECE_BYTES` and `FIRST_PIECE_BYTES` (this while neither is known)."""
    if rate is None or answer_s is None:
        return FIRST_PIECE_BYTES
    return min(FIRST_PIECE_BYTES, max(MIN_PIECE_BYTES, int(rate * answer_s * REQUEST_SHARE)))


class _Part:
    """A file of `size` bytes being downloaded: its bytes so far, written to `path` and hashed as they arrive, and
    counted by `progress` (bytes that are dropped, counted back); and pieces that came ahead of them."""

    def __init__(self, path: Path, size: int, progress: Callable[[int], None] | None = None):
        self.path, self.size, self.received, self._progress = path, size, 0, progress
        self._hasher = hashlib.sha256()

    def __enter__(self) -> "_Part":
        """Opened, after the bytes an earlier download left there (counted, and hashed again), and those it kept
        ahead that follow on from them (`take_ahead`)."""
        self._file = open(self.path, "ab+")
        self._file.seek(0)
        while chunk := self._file.read(CHUNK_BYTES):
            self._hasher.update(chunk)
            self.received += len(chunk)
        if self._progress and self.received:
            self._progress(self.received)
        self.take_ahead()
        at = self.received  # what no download of ours leaves: kept bytes within others, empty, or past the end
        for start, length in sorted(self.kept_ahead().items()):
            if start < at or not length or start + length > self.size:
                self._ahead(start).unlink()
            else:
                at = start + length
        return self

    def kept_ahead(self) -> dict[int, int]:
        """{first byte: length} of the pieces kept ahead of ours (`put_ahead`)."""
        found = {}
        for ahead in self.path.parent.glob(f"{glob.escape(self.path.name)}.from-*"):
            start = ahead.name.rpartition("-")[2]
            if start.isdigit():
                found[int(start)] = ahead.stat().st_size
        return found

    def _ahead(self, start: int) -> Path:
        return self.path.with_name(f"{self.path.name}.from-{start}")

    def put_ahead(self, start: int, data: bytes) -> None:
        """Keep `data`, the file's bytes from `start` on, which came before some of those between ours and
        them: in a file of their own beside ours (`FILE.from-START`), until `take_ahead` appends them."""
        self._ahead(start).write_bytes(data)

    def take_ahead(self) -> None:
        """Append, in order, the bytes kept ahead that follow on from ours (each such file then goes)."""
        while (ahead := self._ahead(self.received)).is_file():
            data = ahead.read_bytes()
            if data:
                self.append(data)
            ahead.unlink()
            if not data:
                return

    def __exit__(self, *exc) -> None:
        self._file.close()

    def append(self, chunk: bytes) -> None:
        self._file.write(chunk)
        self._hasher.update(chunk)
        self.received += len(chunk)
        if self._progress:
            self._progress(len(chunk))

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()

    def restart(self) -> None:
        """Drop what arrived, the bytes kept ahead too: the file starts over."""
        self._file.seek(0)
        self._file.truncate()
        for start in self.kept_ahead():
            self._ahead(start).unlink()
        if self._progress and self.received:
            self._progress(-self.received)
        self._hasher, self.received = hashlib.sha256(), 0
