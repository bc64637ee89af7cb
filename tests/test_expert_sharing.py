"""Experts published on one real swarm peer and fetched by another, hash-checked."""

import asyncio
import contextlib
import json
import re
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from decentral.experts.registry import Registry, RegistryError, verify_expert
from decentral.experts import sharing as sharing_module
from decentral.experts.sharing import ExpertSharing
from decentral.swarm import SwarmPeer
from decentral.swarm.wire import read_frame, write_frame
from conftest import wait_until
from test_experts import tiny_expert


@pytest.fixture
def sharing(tmp_path):
    """(publisher, fetcher): ExpertSharing on two real swarm peers, with registries tmp/a and tmp/b."""
    run = f"experts-{os.getpid()}"
    first = SwarmPeer(run)
    second = SwarmPeer(run, first.multiaddrs())
    publisher, fetcher = ExpertSharing(first, Registry(tmp_path / "a")), ExpertSharing(second, Registry(tmp_path / "b"))
    yield publisher, fetcher
    for side in (publisher, fetcher):
        side.close()
        side.peer.shutdown()


@contextlib.contextmanager
def publishers_of_code(tmp_path, *kinds):
    """(expert, state, [one publisher of a copy of expert "code" per kind], fetcher), each on a real peer."""
    run = f"experts-{os.getpid()}-{time.monotonic_ns()}"
    expert, state = tiny_expert(tmp_path / "original", name="code")
    sides = []
    try:
        for i, kind in enumerate(kinds):
            joined = sides[0].peer.multiaddrs() if sides else ()
            sides.append(kind(SwarmPeer(run, joined), Registry(tmp_path / f"p{i}")))
            shutil.copytree(expert.folder, tmp_path / f"p{i}" / "code")
            sides[-1].publish(["code"])
        fetcher = ExpertSharing(SwarmPeer(run, sides[0].peer.multiaddrs()), Registry(tmp_path / "b"))
        sides.append(fetcher)
        wait_until(lambda: len(fetcher.available().get("code", [None])[0].peers) == len(kinds), 20,
                   "every publisher's record")
        yield expert, state, sides[:-1], fetcher
    finally:
        for side in sides:
            side.close()
            side.peer.shutdown()


def check_installed(got, expert, state) -> None:
    verify_expert(got)
    assert got.sha256 == expert.sha256
    assert all(torch.equal(load_file(got.model_file)[k], v) for k, v in state.items())


def ask_in_order(monkeypatch, *sides) -> None:
    """A fetch asks the publishers `sides` first, in this order (that module's only use of random)."""
    ids = [side.peer.peer_id for side in sides]
    monkeypatch.setattr(sharing_module, "random", SimpleNamespace(
        sample=lambda peers, k: sorted(peers, key=lambda p: ids.index(p) if p in ids else len(ids))))


def test_publish_on_one_peer_fetch_on_the_other(tmp_path, sharing):
    publisher, fetcher = sharing
    expert, state = tiny_expert(tmp_path / "a", name="legal")
    publisher.publish(["legal"])
    listed = fetcher.available()
    assert list(listed) == ["legal"] and listed["legal"][0].peers == [publisher.peer.peer_id]
    assert listed["legal"][0].expert.sha256 == expert.sha256
    sizes = []
    got = fetcher.fetch("legal", progress=sizes.append)
    assert sum(sizes) == expert.size
    verify_expert(got)
    assert got.sha256 == expert.sha256 and got.folder == tmp_path / "b" / "legal"
    assert all(torch.equal(load_file(got.model_file)[k], v) for k, v in state.items())
    with pytest.raises(RegistryError, match=r"nobody in the swarm publishes expert 'code' \(it publishes legal\)"):
        fetcher.fetch("code")


def test_bytes_that_do_not_match_the_record_are_refused(tmp_path, sharing):
    publisher, fetcher = sharing
    expert, _ = tiny_expert(tmp_path / "a", name="code")
    publisher.publish(["code"])
    data = bytearray(expert.model_file.read_bytes())
    data[-1] ^= 0xFF  # the file changes under the publisher after it announced its hash
    expert.model_file.write_bytes(bytes(data))
    with pytest.raises(RegistryError, match="sha256 does not match the record"):
        fetcher.fetch("code")
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())  # nothing installed, no temp folder


def test_a_publisher_whose_copy_is_gone_mid_fetch_is_said_plainly_and_nothing_is_installed(tmp_path, sharing):
    """Its stream closed after the answer: asyncio's "0 bytes read on a total of 8 expected bytes" was the message."""
    publisher, fetcher = sharing
    expert, _ = tiny_expert(tmp_path / "a", name="code")
    publisher.publish(["code"])
    expert.model_file.unlink()  # removed under the publisher after it announced it
    with pytest.raises(RegistryError, match=r"code/model.safetensors: the publisher closed the connection after 0 of "
                                            r"\d+ bytes \(it stopped, or its copy is gone\)"):
        fetcher.fetch("code")
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


def test_fetch_checks_every_name_is_published_before_fetching_any(tmp_path, sharing, prefork):
    publisher, _ = sharing
    tiny_expert(tmp_path / "a", name="code")
    publisher.publish(["code"])
    join = ["--join", str(publisher.peer.multiaddrs()[0]), "--run", publisher.peer.run]
    done = prefork.run(["experts", "fetch", "code", "nosuch", *join, "--registry", "c"], tmp_path, timeout=120)
    assert done.returncode == 2 and "nobody in the swarm publishes expert 'nosuch' (it publishes code)" in done.stderr
    done = prefork.run(["experts", "fetch", "code", *join[:2], "--run", "typo", "--registry", "c"], tmp_path,
                       timeout=120)
    assert done.returncode == 2 and ("nobody publishes any in run 'typo': is it the run they publish in?"
                                     in done.stderr), done.stderr
    assert "Traceback" not in done.stderr and "fetched" not in done.stdout
    assert not (tmp_path / "c" / "code").exists()  # nothing installed
    done = prefork.run(["experts", "fetch", "code", "code", *join, "--registry", "c"], tmp_path, timeout=120)
    assert done.returncode == 2 and "fetch: 'code' is given twice" in done.stderr, done.stderr
    done = prefork.run(["experts", "fetch", "code", *join, "--registry", "c"], tmp_path, timeout=120)
    assert done.returncode == 0 and "fetched code" in done.stdout, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("fetch code: ")]  # not a terminal: a
    assert said[0].startswith("fetch code: 0B of") and "\r" not in done.stderr, done.stderr  # line at each tenth
    done_bytes, total = said[-1].removeprefix("fetch code: ").split(" of ")
    assert total.endswith("B") and total[:-1].replace(".", "").rstrip("kMG").isdigit(), said  # "1.59MB"
    assert done_bytes == total, done.stderr


def test_a_version_published_with_and_without_its_optimizer_is_fetched_whole_from_who_has_it(tmp_path, sharing):
    """Versions were told apart by the model's sha256 alone: a peer that fetched with --no-optimizer and published
    again made the swarm's version look optimizer-less (whose record came first decided), or was asked for the
    optimizer state it does not have."""
    from decentral.experts.registry import write_expert

    publisher, fetcher = sharing
    expert, state = tiny_expert(tmp_path / "plain", name="legal")
    optimizer = ({"exp_avg": torch.ones(3)}, [{"lr": 0.1}])
    write_expert(tmp_path / "a" / "legal", lambda path: path.write_bytes((expert.folder / "model.safetensors")
                                                                         .read_bytes()), expert, optimizer=optimizer)
    publisher.publish(["legal"])
    fetcher.fetch("legal", with_optimizer=False)
    fetcher.publish(["legal"])
    third = ExpertSharing(SwarmPeer(publisher.peer.run, publisher.peer.multiaddrs()), Registry(tmp_path / "c"))
    try:
        wait_until(lambda: len(third.available().get("legal", [None])[0].peers) == 2, 20, "both publishers' records")
        [version] = third.available()["legal"]
        assert version.expert.optimizer is not None and version.without_optimizer == {fetcher.peer.peer_id}
        for _ in range(4):  # (publishers are tried in random order: each time from the one that has it all)
            got = third.fetch("legal")
            assert got.optimizer is not None and (got.folder / "optimizer.safetensors").is_file()
            shutil.rmtree(got.folder)
    finally:
        third.close()
        third.peer.shutdown()


class Oversending(ExpertSharing):
    """A publisher that answers a fetch with the file and then `extra`: raw bytes on the stream."""

    extra = b""

    async def _serve(self, sender, reader, writer):
        await read_frame(reader, self.peer.stats)
        await write_frame(writer, b'{"ok": true}', self.peer.stats)
        await write_frame(writer, self._published["code"].model_file.read_bytes(), self.peer.stats)
        writer.write(self.extra)
        await writer.drain()
        await reader.read()  # until the fetcher hangs up


@pytest.mark.parametrize("extra", [
    (1 << 31).to_bytes(8, "big") + b"x" * 1000,  # one piece of 2 GiB announced, 1000 bytes of it sent
    (1).to_bytes(8, "big") + b"x",  # one byte past the recorded size
], ids=["a-2GiB-piece", "a-byte-past"])
def test_a_publisher_that_sends_more_than_the_record_is_refused_before_it_is_read(tmp_path, extra):
    """Each piece was read whole, as long as the publisher said, before its size was compared with the record's: one
    announcing 2 GiB was waited for (and buffered) until the fetch timed out. A piece longer than ours are, or past
    the recorded size, is refused as its length arrives, and nothing is installed."""
    run = f"experts-{os.getpid()}"
    publisher = Oversending(SwarmPeer(run), Registry(tmp_path / "a"))
    publisher.extra = extra
    fetcher = ExpertSharing(SwarmPeer(run, publisher.peer.multiaddrs()), Registry(tmp_path / "b"))
    try:
        tiny_expert(tmp_path / "a", name="code")
        publisher.publish(["code"])
        with pytest.raises(RegistryError, match=r"code/model.safetensors: the publisher's answer after \d+ of \d+ "
                                                r"bytes is not one of ours: frame length \d+ exceeds the \d+-byte"):
            fetcher.fetch("code")
        assert Registry(tmp_path / "b").names() == []  # nothing installed (the file's bytes are kept for the next)
    finally:
        for side in (publisher, fetcher):
            side.close()
            side.peer.shutdown()


class StoppingMidFile(ExpertSharing):
    """A publisher that sends the first half of a file (with its bytes flipped when `lies`) and then stops."""

    lies = False

    async def _serve(self, sender, reader, writer):
        await read_frame(reader, self.peer.stats)
        if "code" not in self._published:
            await write_frame(writer, b'{"ok": false}', self.peer.stats)
            return
        await write_frame(writer, b'{"ok": true, "offset": 0}', self.peer.stats)
        data = self._published["code"].model_file.read_bytes()[:self._published["code"].size // 2]
        await write_frame(writer, bytes(b ^ 0xFF for b in data) if self.lies else data, self.peer.stats)


class FromTheStart(ExpertSharing):
    """A publisher from before offsets: it sends every file whole, whatever the request asks."""

    async def _serve(self, sender, reader, writer):
        await read_frame(reader, self.peer.stats)
        await write_frame(writer, b'{"ok": true}', self.peer.stats)
        await write_frame(writer, self._published["code"].model_file.read_bytes(), self.peer.stats)
        await write_frame(writer, b"", self.peer.stats)


@pytest.mark.parametrize("second, lies, sends", [
    (ExpertSharing, False, "the second half"),
    (FromTheStart, False, "the whole file"),  # (the fetch starts the file over)
    (ExpertSharing, True, "the second half, then the whole file"),  # the halves' sha256 fails: whole from it
], ids=["goes-on", "an-older-publisher", "the-first-half-was-wrong"])
def test_a_file_a_publisher_stops_sending_midway_comes_from_the_next_from_where_it_stopped(tmp_path, monkeypatch,
                                                                                          second, lies, sends):
    """A publisher that stopped mid-file (it left, its link broke) cost the fetch the whole expert: the next
    publisher was asked for every file from byte 0, over a slow link minutes again. It goes on from the bytes
    that came, and the expert installed is the record's, byte for byte."""
    with publishers_of_code(tmp_path, StoppingMidFile, second) as (expert, state, (first, other), fetcher):
        first.lies = lies
        ask_in_order(monkeypatch, first)
        before, counted = other.peer.stats.bytes_sent, []
        got = fetcher.fetch("code", progress=counted.append)
        sent = other.peer.stats.bytes_sent - before
        assert sum(counted) == expert.size  # what the progress bar shows: bytes that were dropped counted back
        check_installed(got, expert, state)
        half, whole = expert.size - expert.size // 2, expert.size
        expected = {"the second half": half, "the whole file": whole, "the second half, then the whole file":
                    half + whole}[sends]
        assert expected <= sent < expected + 1000, (sent, expected)  # (and a few frames' headers)


def test_a_fetch_that_failed_midway_goes_on_from_the_bytes_it_kept_when_run_again(tmp_path):
    """A fetch whose only publisher stopped mid-file (it restarted, its link broke) failed and dropped what had
    come: the next fetch began at byte 0 again. What came is kept beside the registry (the message says where),
    the next fetch of that version goes on from there, and one that another process runs meanwhile is refused."""
    run = f"experts-{os.getpid()}"
    first = StoppingMidFile(SwarmPeer(run), Registry(tmp_path / "a"))
    fetcher = ExpertSharing(SwarmPeer(run, first.peer.multiaddrs()), Registry(tmp_path / "b"))
    other = ExpertSharing(SwarmPeer(run, first.peer.multiaddrs()), Registry(tmp_path / "c"))
    try:
        expert, state = tiny_expert(tmp_path / "a", name="code")
        first.publish(["code"])
        half = expert.size // 2
        with pytest.raises(RegistryError, match=rf"\({half:,} bytes of it are kept in .*/\.code\.partial-\w+: fetch it "
                                                r"again to go on from there\)"):
            fetcher.fetch("code")
        assert Registry(tmp_path / "b").names() == []
        [partial] = (tmp_path / "b").glob(".code.partial-*")
        holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a'); "
                                   "fcntl.lockf(f, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
                                   str(partial / ".lock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline() == "held\n"
            with pytest.raises(RegistryError, match="another process is fetching this version of expert 'code'"):
                fetcher.fetch("code")
        finally:
            holder.kill()
            holder.wait()
        shutil.copytree(expert.folder, tmp_path / "c" / "code")
        other.publish(["code"])
        first._published.clear()  # it serves nothing from now on
        wait_until(lambda: len(fetcher.available().get("code", [None])[0].peers) == 2, 20, "both publishers' records")
        before, counted = other.peer.stats.bytes_sent, []
        got = fetcher.fetch("code", progress=counted.append)
        sent = other.peer.stats.bytes_sent - before
        assert expert.size - half <= sent < expert.size - half + 1000, sent  # the second half (and frames' headers)
        assert sum(counted) == expert.size  # the kept half counted as the fetch starts
        verify_expert(got)
        assert all(torch.equal(load_file(got.model_file)[k], v) for k, v in state.items())
        assert not list((tmp_path / "b").glob(".code.partial-*"))  # gone once the expert is in
    finally:
        for side in (first, other, fetcher):
            side.close()
            side.peer.shutdown()


@pytest.mark.parametrize("request_bytes, answer", [
    (b"[1]", b""),  # dropped with a warning
    (b'{"name": "code", "file": ["model.safetensors"]}', b'{"ok": false}'),  # a file name that is no string
], ids=["a-list", "a-list-for-a-name"])
def test_a_fetch_request_that_is_no_object_is_one_warning_not_a_traceback(tmp_path, sharing, caplog, request_bytes,
                                                                          answer):
    """Such requests failed the handler with AttributeError or TypeError, logged with their traceback as a bug of
    ours would be."""
    publisher, fetcher = sharing
    tiny_expert(tmp_path / "a", name="code")
    publisher.publish(["code"])

    async def ask_in_garbage():
        reader, writer = await fetcher.peer.open_stream(publisher.peer.peer_id, "expert")
        await write_frame(writer, request_bytes, fetcher.peer.stats)
        answered = await reader.read()
        writer.close()
        return answered

    with caplog.at_level(logging.WARNING, logger="decentral.swarm.peer"):
        answered = fetcher.peer.call(ask_in_garbage()).result(timeout=30)
        if not answer:
            wait_until(lambda: "dropping a malformed or late request on expert" in caplog.text, 10, "the warning")
    assert answered[8:] == answer and "failed on a stream" not in caplog.text, caplog.text


def test_published_experts_stay_in_view_while_a_dht_member_is_frozen(tmp_path, monkeypatch):
    """A frozen DHT member (SIGSTOP) makes every store wait out its RPC timeout: renewals that waited for each
    expert's stores in turn took longer than a record's lifetime with a few experts, and the records lapsed.
    With records of 6 s renewed every 2 s, three experts stay in view for 12 s of the freeze."""
    monkeypatch.setattr(sharing_module, "RECORD_TTL_S", 6.0)
    run = f"experts-{os.getpid()}-frozen"
    frozen = SwarmPeer(run)
    publisher = ExpertSharing(SwarmPeer(run, frozen.multiaddrs()), Registry(tmp_path / "a"))
    viewer = ExpertSharing(SwarmPeer(run, frozen.multiaddrs()), Registry(tmp_path / "b"))
    names = ["code", "legal", "manuals"]
    try:
        for i, name in enumerate(names):
            tiny_expert(tmp_path / "a", name=name, seed=i)
        publisher.publish(names)
        wait_until(lambda: sorted(viewer.available()) == names, 30, "every expert's record")
        os.kill(frozen.dht.pid, signal.SIGSTOP)
        began, lapses = time.monotonic(), []
        while time.monotonic() < began + 12:
            seen = sorted(viewer.available())  # (a lookup: itself slowed by the frozen member)
            if seen != names:
                lapses.append((round(time.monotonic() - began, 1), seen))
            time.sleep(0.1)  # sampling the view through the freeze
        assert not lapses, lapses
    finally:
        os.kill(frozen.dht.pid, signal.SIGCONT)
        for side in (publisher, viewer):
            side.close()
            side.peer.shutdown()
        frozen.shutdown()


@pytest.fixture
def small_pieces(monkeypatch):
    """Frames of 1 KiB and pieces of 256 bytes to 4 KiB (both sides: one module), so a tiny expert comes in pieces."""
    monkeypatch.setattr(sharing_module, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(sharing_module, "FIRST_PIECE_BYTES", 256)
    monkeypatch.setattr(sharing_module, "MIN_PIECE_BYTES", 256)
    monkeypatch.setattr(sharing_module, "MAX_PIECE_BYTES", 4096)


def test_a_file_comes_in_pieces_from_every_publisher_at_once(tmp_path, small_pieces):
    """A file came from one publisher at a time: with three publishing it, one uplink carried all of it while the
    other two idled. Each of the three now sends pieces of it, and they add up to the file, byte for byte."""
    with publishers_of_code(tmp_path, ExpertSharing, ExpertSharing, ExpertSharing) as (expert, state, publishers,
                                                                                        fetcher):
        before, counted = [p.peer.stats.bytes_sent for p in publishers], []
        got = fetcher.fetch("code", progress=counted.append)
        sent = [p.peer.stats.bytes_sent - b for p, b in zip(publishers, before)]
        check_installed(got, expert, state)
        assert sum(counted) == expert.size
        assert all(s > 0 for s in sent), sent
        assert expert.size <= sum(sent) < expert.size + 3 * 4096 + 2000, (sent, expert.size)  # (one piece each twice)


class Frozen(ExpertSharing):
    """A publisher that, asked for anything, answers that it sends it and then sends nothing until `thaw` is set;
    `asked` lists the first byte of each request."""

    thaw: threading.Event
    asked: list[int]

    async def _serve(self, sender, reader, writer):
        request = json.loads(await read_frame(reader, self.peer.stats))
        self.asked.append(request["offset"])
        await write_frame(writer, json.dumps({"ok": True, "offset": request["offset"]}).encode(), self.peer.stats)
        await asyncio.get_running_loop().run_in_executor(None, self.thaw.wait)


def test_a_publisher_that_stops_sending_mid_piece_holds_nobody_up(tmp_path, small_pieces, monkeypatch):
    """The piece a frozen publisher holds is asked of the other one too, once it has nothing else to fetch: the
    fetch ends without waiting for the frozen one (whose silence is given up on only after CHUNK_TIMEOUT_S). Its
    copy is stopped once the other came, and it is asked for the next piece (a slow publisher went on sending a
    piece that had come, its uplink wasted)."""
    monkeypatch.setattr(sharing_module, "CHUNK_TIMEOUT_S", 600.0)
    Frozen.thaw, Frozen.asked = threading.Event(), []
    with publishers_of_code(tmp_path, Frozen, ExpertSharing) as (expert, state, publishers, fetcher):
        ask_in_order(monkeypatch, publishers[0])
        with ThreadPoolExecutor(1) as pool:
            try:
                got = pool.submit(fetcher.fetch, "code").result(timeout=60)
            finally:
                Frozen.thaw.set()
        check_installed(got, expert, state)
    assert len(Frozen.asked) >= 2 and Frozen.asked[0] == 0, Frozen.asked


class Slow(ExpertSharing):
    """A publisher that sends what it is asked for in frames of 1 KiB, one every 0.25 s (4 KiB/s at most)."""

    async def _serve(self, sender, reader, writer):
        request = json.loads(await read_frame(reader, self.peer.stats))
        data = (self._published["code"].folder / request["file"]).read_bytes()[request["offset"]:request["end"]]
        await write_frame(writer, json.dumps({"ok": True, "offset": request["offset"]}).encode(), self.peer.stats)
        for start in range(0, len(data), 1024):
            await asyncio.sleep(0.25)
            await write_frame(writer, data[start:start + 1024], self.peer.stats)
        await write_frame(writer, b"", self.peer.stats)


def test_a_publishers_next_piece_follows_its_rate_and_its_share_of_what_is_left():
    """Every piece was an even share of the file: a slow uplink held a whole one while the rest came, and the
    fetch waited for it or asked another for all of it again (a 1 Mbit/s publisher beside an 8 Mbit/s one: 7.6 s
    where their uplinks need 6.2)."""
    largest, mib, first = 2**20, 2**20, sharing_module.FIRST_PIECE_BYTES
    assert sharing_module.piece_bytes(largest, None, 0.0, 6 * mib, first) == first  # (no rate yet)
    slow, fast = 125_000.0, 1_000_000.0  # 1 and 8 Mbit/s
    assert sharing_module.piece_bytes(largest, slow, slow + fast, 6 * mib, first) == first
    assert sharing_module.piece_bytes(largest, 200_000.0, 200_000.0 + fast, 6 * mib, first) == 400_000  # (2 s of it)
    assert sharing_module.piece_bytes(largest, fast, slow + fast, 6 * mib, first) == largest
    assert sharing_module.piece_bytes(largest, fast, 4 * fast, 4 * largest, first) == largest  # four alike: one each
    assert sharing_module.piece_bytes(largest, fast, 4 * fast, 2 * largest, first) == largest // 2  # and end together


def test_the_last_pieces_shrink_to_what_a_request_is_worth_so_that_the_publishers_end_together():
    """Four publishers at 8 Mbit/s with 348 KiB left that nobody asked for: one of them took it all (pieces were
    256 KiB at least, and the rest came along), and the three others idled while it came (2.02 s a fetch where
    their uplinks need 1.74). A quarter each now: a piece need only be worth its request, what its publisher's
    rate carries in REQUEST_SHARE times the wait for its last answer."""
    fast, kib = 1_000_000.0, 1024
    smallest = sharing_module.smallest_piece(fast, 0.003)  # an answer in 3 ms: 24 kB are worth asking for
    assert smallest == sharing_module.REQUEST_SHARE * 3_000 == 24_000
    assert sharing_module.piece_bytes(2**20, fast, 4 * fast, 348 * kib, smallest) == 87 * kib
    assert sharing_module.piece_bytes(2**20, fast, 4 * fast, 32 * kib, smallest) == smallest  # (no smaller)
    assert sharing_module.smallest_piece(fast, 0.1) == sharing_module.FIRST_PIECE_BYTES  # long round trips: large
    assert sharing_module.smallest_piece(1_000.0, 0.001) == sharing_module.MIN_PIECE_BYTES  # (the floor)
    assert sharing_module.smallest_piece(None, None) == sharing_module.smallest_piece(fast, None) == (
        sharing_module.FIRST_PIECE_BYTES)  # (not known yet)


def test_a_slow_publisher_is_asked_for_small_pieces_and_a_fast_one_for_larger_ones(tmp_path, small_pieces,
                                                                                   monkeypatch):
    monkeypatch.setattr(sharing_module, "PIECE_SECONDS", 0.5)
    with publishers_of_code(tmp_path, Slow, ExpertSharing) as (expert, state, publishers, fetcher):
        ask_in_order(monkeypatch, *publishers)
        pieces, download = [], fetcher._download_piece

        async def recorded(peer, name, file, start, end):
            pieces.append((peer, end - start))
            return await download(peer, name, file, start, end)

        monkeypatch.setattr(fetcher, "_download_piece", recorded)
        got = fetcher.fetch("code")
        check_installed(got, expert, state)
    slow, fast = ([size for peer, size in pieces if peer == side.peer.peer_id] for side in publishers)
    assert slow[0] == fast[0] == 256, pieces  # (no rate known yet)
    assert all(size <= 2048 for size in slow), slow  # (4 KiB/s for 0.5 s at most)
    assert max(fast) > 2048 and sum(fast) > 2 * sum(slow), pieces


class Flipping(ExpertSharing):
    """A publisher that serves what it is asked for, every byte flipped."""

    async def _serve(self, sender, reader, writer):
        request = json.loads(await read_frame(reader, self.peer.stats))
        data = (self._published["code"].folder / request["file"]).read_bytes()
        await write_frame(writer, json.dumps({"ok": True, "offset": request["offset"]}).encode(), self.peer.stats)
        for start in range(request["offset"], request.get("end", len(data)), 1024):
            piece = data[start:min(start + 1024, request.get("end", len(data)))]
            await write_frame(writer, bytes(b ^ 0xFF for b in piece), self.peer.stats)
        await write_frame(writer, b"", self.peer.stats)


def test_pieces_that_add_up_to_another_file_are_dropped_and_the_file_comes_whole_from_one_at_a_time(
        tmp_path, small_pieces, caplog):
    """Whose pieces were wrong, the file's sha256 cannot say: it is fetched again whole from one publisher after
    another, and the one whose bytes are the record's is installed. Then the file says whose pieces were not its
    bytes: that publisher is named (and asked for nothing more), the other is not."""
    with publishers_of_code(tmp_path, Flipping, ExpertSharing) as (expert, state, publishers, fetcher):
        with caplog.at_level(logging.WARNING, logger="decentral.experts.sharing"):
            got = fetcher.fetch("code")
        check_installed(got, expert, state)
        assert "model.safetensors from several publishers does not match the record" in caplog.text
        flipping, honest = (side.peer.peer_id[-8:] for side in publishers)
        assert re.search(rf"{flipping} sent \d+ piece\(s\) of model.safetensors that are not the record's bytes",
                         caplog.text), caplog.text
        assert f"{honest} sent" not in caplog.text


class RefusingTheStart(ExpertSharing):
    """A publisher that serves every piece but the file's first: asked for that, it hangs up."""

    async def _serve(self, sender, reader, writer):
        request = json.loads(await read_frame(reader, self.peer.stats))
        if request["offset"] == 0:
            return
        data = (self._published["code"].folder / request["file"]).read_bytes()[request["offset"]:request["end"]]
        await write_frame(writer, json.dumps({"ok": True, "offset": request["offset"]}).encode(), self.peer.stats)
        for start in range(0, len(data), 1024):
            await write_frame(writer, data[start:start + 1024], self.peer.stats)
        await write_frame(writer, b"", self.peer.stats)


def test_pieces_that_came_ahead_of_a_missing_one_are_kept_for_the_next_fetch(tmp_path, small_pieces, monkeypatch):
    """Pieces that came while one before them was missing waited in memory: a fetch that stopped lost them.
    They wait beside the file now, the message counts them, and the next fetch takes them in and asks for the
    rest alone. (Two publishers, each asked first for 256 bytes, then for 4 KiB at a time: the first publisher
    froze on bytes 0-255, the other sent the pieces from 256 up to the window's end, 16 KiB past byte 0, and
    refused byte 0.)"""
    monkeypatch.setattr(sharing_module, "CHUNK_TIMEOUT_S", 3.0)
    monkeypatch.setattr(sharing_module, "PIECE_SECONDS", 1000.0)  # (however slow the machine: pieces of 4 KiB)
    Frozen.thaw, Frozen.asked = threading.Event(), []
    with publishers_of_code(tmp_path, Frozen, RefusingTheStart) as (expert, state, publishers, fetcher):
        ask_in_order(monkeypatch, *publishers)
        try:
            with pytest.raises(RegistryError, match=r"\(16,640 bytes of it are kept in .*\.code\.partial-"):
                fetcher.fetch("code")
        finally:
            Frozen.thaw.set()
        [partial] = (tmp_path / "b").glob(".code.partial-*")
        assert {path.name for path in partial.iterdir() if ".from-" in path.name} == {
            f"model.safetensors.from-{start}" for start in (256, 512, 4608, 8704, 12800)}
        for publisher in publishers:
            publisher._published.clear()  # they serve nothing from now on
        honest = ExpertSharing(SwarmPeer(fetcher.peer.run, fetcher.peer.multiaddrs()), Registry(tmp_path / "c"))
        try:
            shutil.copytree(expert.folder, tmp_path / "c" / "code")
            honest.publish(["code"])
            wait_until(lambda: len(fetcher.available()["code"][0].peers) == 3, 20, "the third publisher's record")
            got = fetcher.fetch("code")
            sent = honest.peer.stats.bytes_sent
        finally:
            honest.close()
            honest.peer.shutdown()
        check_installed(got, expert, state)
        assert expert.size - 16640 <= sent < expert.size - 16640 + 2000, sent  # (and frames' headers)
