"""Publish experts to a swarm and fetch them from it: a DHT record per expert, files over direct streams.

A publisher stores `experts` → `{name}/{peer id}` → the expert's `expert.json` record in the swarm's
DHT (refreshed while it serves; gone within `RECORD_TTL_S` after it stops) and answers `expert`
streams: a request names an expert, a file and where in it to start, the answer is the rest of the file in
chunks. A fetcher reads the records, picks a publisher, downloads each file into a partial folder while
hashing it (going on with the next publisher from where one stopped), and installs the expert in its
registry only when every file has the size and sha256 of the record; anything else (publishers that died
mid-transfer, bytes that do not match) leaves the registry as it was, and the bytes that came in the partial
folder for the next fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
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
        """A request names an expert, one of its files and where in it to start ("offset", default 0: a fetch
        that another publisher left mid-file goes on from there); the answer says it starts there ({"ok": true,
        "offset": n}) and sends the rest in chunks, then an empty one."""
        request = await asyncio.wait_for(read_header(reader, self.peer.stats), CHUNK_TIMEOUT_S)
        expert = self._published.get(str(request.get("name")))
        name, offset = request.get("file"), request.get("offset", 0)
        if (expert is None or not isinstance(name, str) or name not in expert.files()
                or type(offset) is not int or not 0 <= offset <= expert.files()[name][1]):
            await write_frame(writer, json.dumps({"ok": False}).encode(), self.peer.stats)
            return
        await write_frame(writer, json.dumps({"ok": True, "offset": offset}).encode(), self.peer.stats)
        loop = asyncio.get_running_loop()
        with open(expert.folder / name, "rb") as f:
            f.seek(offset)
            while chunk := await loop.run_in_executor(None, f.read, CHUNK_BYTES):
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
        Asks its publishers in random order; a file one of them stops sending midway comes from the next one
        from where it stopped (`_fetch_file`). RegistryError, with each publisher's failure, when none is left;
        what arrived is kept for the next download of this version (`_partial_download`)."""
        expert, name, files = published.expert, published.expert.name, published.files(with_optimizer)
        if not with_optimizer:
            expert.optimizer = None  # (its expert.json then names none)
        peers = [p for p in published.peers if OPTIMIZER_FILE not in files or p not in published.without_optimizer]
        peers, errors = random.sample(peers, len(peers)), []
        with _partial_download(self.registry, name, files) as partial:
            for file, (digest, size) in files.items():
                if not self._fetch_file(peers, errors, name, file, partial / file, digest, size, progress):
                    kept = sum(path.stat().st_size for path in partial.iterdir() if path.name in files)
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
        """Write file `file` of expert `name` to `path` from the first of `peers` that delivers it with the
        record's `size` and `digest`, after the bytes an earlier download left there; whether one did. A
        publisher that fails is removed from `peers` (its failure added to `errors`), and the next goes on from
        the bytes it sent. A file whose bytes all came and are not the record's starts over: from the next
        publisher, or from the same one when it went on from another's bytes (those may be the wrong ones)."""
        with _Part(path, progress) as part:
            if part.received > size:  # (not what an earlier download of this version left)
                part.restart()
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

    async def _download_file(self, peer: str, name: str, file: str, part: "_Part", size: int) -> None:
        """Append what `peer` serves of `file` from `part.received` on to `part`, up to the recorded `size`. A
        publisher that answers from byte 0 (one from before offsets) starts the file over."""
        reader, writer = await self.peer.open_stream_or_again(peer, "expert")
        try:
            request = {"name": name, "file": file, "offset": part.received}
            await write_frame(writer, json.dumps(request).encode(), self.peer.stats)
            answer = await asyncio.wait_for(read_header(reader, self.peer.stats), CHUNK_TIMEOUT_S)
            if not answer.get("ok"):
                raise RegistryError(f"the publisher no longer serves {name}/{file}")
            if answer.get("offset", 0) != part.received:
                if answer.get("offset", 0) != 0:
                    raise WireError(f"it answered from byte {answer.get('offset')!r}, asked for {part.received}")
                part.restart()
            # a piece longer than ours are, or past the recorded size, is refused unread
            while chunk := await asyncio.wait_for(
                    read_frame(reader, self.peer.stats, min(CHUNK_BYTES, size - part.received)), CHUNK_TIMEOUT_S):
                part.append(chunk)
        except (asyncio.IncompleteReadError, ConnectionError):
            raise RegistryError(f"{name}/{file}: the publisher closed the connection after {part.received} of {size} "
                                "bytes (it stopped, or its copy is gone)") from None
        except WireError as e:
            raise RegistryError(f"{name}/{file}: the publisher's answer after {part.received} of {size} bytes is not "
                                f"one of ours: {e}") from None
        except TimeoutError:  # (asyncio.wait_for's: no message of its own)
            raise RegistryError(f"{name}/{file}: the publisher sent nothing for {CHUNK_TIMEOUT_S:g} s after "
                                f"{part.received} of {size} bytes") from None
        finally:
            writer.close()

    def close(self) -> None:
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(timeout=5)


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


class _Part:
    """A file being downloaded: its bytes so far, written to `path` and hashed as they arrive, and counted by
    `progress` (bytes that are dropped, counted back)."""

    def __init__(self, path: Path, progress: Callable[[int], None] | None = None):
        self.path, self.received, self._progress = path, 0, progress
        self._hasher = hashlib.sha256()

    def __enter__(self) -> "_Part":
        """Opened, after the bytes an earlier download left there (counted, and hashed again)."""
        self._file = open(self.path, "ab+")
        self._file.seek(0)
        while chunk := self._file.read(CHUNK_BYTES):
            self._hasher.update(chunk)
            self.received += len(chunk)
        if self._progress and self.received:
            self._progress(self.received)
        return self

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
        """Drop what arrived: the file starts over."""
        self._file.seek(0)
        self._file.truncate()
        if self._progress and self.received:
            self._progress(-self.received)
        self._hasher, self.received = hashlib.sha256(), 0
