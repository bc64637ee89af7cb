"""One member of a swarm: a hivemind DHT node, plus our own message streams over its libp2p daemon.

The DHT (hivemind) holds membership records; tensors travel over direct libp2p streams that we
open ourselves (no hivemind matchmaking). All network work runs on a background event loop thread,
so the training thread only ever waits on futures.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import ipaddress
import logging
import multiprocessing
import os
import random
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from hivemind.dht import DHT
from hivemind.p2p import P2PDaemonError, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture, SharedBytes
from hivemind.utils.multiaddr import Multiaddr

from decentral.cpu import descendants
from decentral.swarm.admission import TOKEN_BYTES, SignedRecords, SwarmKey, ensure_identity
from decentral.swarm.reach import ip_and_port, plain_dial, serve_reach_checks
from decentral.swarm.wire import TrafficStats, WireError, read_frame, write_frame

log = logging.getLogger(__name__)


class SwarmError(RuntimeError):
    """The swarm could not be started or reached."""


def check_multiaddrs(maddrs: Sequence[str]) -> None:
    """SwarmError naming the first of `maddrs` that is not a peer's multiaddr (/ip4/HOST/tcp/PORT/p2p/ID)."""
    for maddr in maddrs:
        try:
            names = [p.name for p in Multiaddr(str(maddr)).protocols()]
        except ValueError as e:  # multiaddr's ParseError
            raise SwarmError(f"{maddr!r} is not a multiaddr ({e}); a member prints its own as "
                             "/ip4/HOST/tcp/PORT/p2p/PEER_ID") from None
        if "p2p" not in names:
            raise SwarmError(f"{maddr!r} names no peer: a peer's multiaddr ends with /p2p/PEER_ID, as a member "
                             "prints it")


def check_reachable_back(maddrs: Sequence[str], host: str, announce_host: str | None) -> None:
    """SwarmError when we would listen on loopback only (`host`, no `announce_host`) but one of `maddrs` is on
    another machine: its peers could not reach us (they would dial 127.0.0.1, their own machine)."""
    try:
        if announce_host or not ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:  # not an IP address: starting the peer says so
        return
    for maddr in maddrs:
        ip, _ = ip_and_port(maddr)
        if ip is None or ipaddress.ip_address(ip).is_loopback:
            continue
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as probe:
            try:
                probe.bind((ip, 0))  # an address of this machine: its peers reach our loopback
                continue
            except OSError:
                pass
        raise SwarmError(f"--host {host} listens on this machine only, but {ip} (--join) is another machine, whose "
                         "peers could not reach us: give --host 0.0.0.0 (and --announce-host behind a NAT)")


def check_listenable(host: str, port: int) -> None:
    """OSError (EADDRINUSE when something listens there) unless we can listen on `host`:`port`; port 0 (any
    free one) always can. p2pd's listener takes its port with SO_REUSEPORT, so a second p2pd on a port
    another one listens on comes up beside it (and the first is no longer reached) instead of failing: a
    plain bind, with SO_REUSEADDR (a port whose past connections wait out TIME_WAIT is free) but not
    SO_REUSEPORT, is refused on a port anything listens on. Released at once."""
    if port:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))


def check_dht_alive(dht: DHT) -> None:
    """SwarmError when DHT process `dht` is gone."""
    if not dht.is_alive():
        raise SwarmError(f"this peer's DHT process (pid {dht.pid}) is gone (exit code {dht.exitcode}): the peer "
                         "cannot reach the swarm any more")


def dht_result(dht: DHT, future: MPFuture) -> Any:
    """The result of `future`, a call to DHT process `dht`. SwarmError when the process is dead or dies during
    the call: its answer would never come, and the caller would hang."""
    while True:
        try:
            return future.result(timeout=DHT_CHECK_S)
        except TimeoutError:
            check_dht_alive(dht)


def _run_alone(coroutine: Awaitable[Any]) -> Any:
    """asyncio.run(`coroutine`), also where an event loop runs already (a notebook's cell): in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, coroutine).result()


def startup_error(error: Exception, initial_peers: Sequence[str], host: str, port: int) -> str:
    """Why our DHT process did not start, in one line (p2pd's last log line, without its timestamp, or the
    OSError of `check_listenable`)."""
    text = re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", str(error))
    if "address already in use" in text.lower():
        return f"cannot listen on {host}:{port}: the port is in use (choose another --port, or 0 for any free one)"
    if "cannot assign requested address" in text.lower():
        return f"cannot listen on {host}: it is not an address of this machine (--host)"
    if "failed to connect to bootstrap peers" in text or "bootstrap failed" in text:
        addresses = [(ip, port) for ip, port in map(ip_and_port, initial_peers) if ip and port]
        if _run_alone(plain_dial(addresses)) == "accepted":
            return (f"could not join through {', '.join(map(str, initial_peers))}: a process answers there, but not "
                    "as that peer (is the peer id right? copy the whole address a member prints; a peer restarted "
                    "with another --out has a new id)")
        return (f"could not reach any peer at {', '.join(map(str, initial_peers))}: nothing answered there "
                "(is the address right, and is that peer still running?)")
    if "torch_shm_manager" in text:  # hivemind's futures share memory through torch's manager, whose Unix
        tmp, why = tempfile.gettempdir(), re.split(r"\s+Exception raised", text)[0]  # socket lives under TMPDIR
        return (f"could not start a swarm peer: torch's shared-memory manager, which hivemind's DHT uses, failed "
                f"to start ({why}); it makes its socket under the temporary folder "
                f"{tmp} ({len(tmp)} characters), and a socket's path fails past 107: if that is the cause, set "
                "TMPDIR to a shorter path, such as /tmp")
    skew = re.search(r"local time must be within ([\d.]+) seconds.*local: ([\d.]+), peer: ([\d.]+)", text)
    if skew:  # hivemind's DHT pings the peers it joins through and compares their clocks with ours
        allowed, ours, theirs = map(float, skew.groups())
        return (f"this machine's clock is {abs(ours - theirs):.0f} s {'behind' if ours < theirs else 'ahead of'} "
                f"the clock of a peer it joins through ({', '.join(map(str, initial_peers))}), and hivemind's DHT "
                f"allows {allowed:g} s: set the clock right (NTP: `timedatectl set-ntp true`), then join again")
    if "already taken" in text:
        return (f"could not start a swarm peer: {text} (is another process using this identity, e.g. the same "
                "--out? a killed one's daemon lets go of it within seconds)")
    return f"could not start a swarm peer{f' through {list(initial_peers)}' if initial_peers else ''}: {text}"


class DialHeldBack(Exception):
    """libp2p holds back new dials to a peer for a few seconds after one failed (its dial backoff), yet the
    peer's address does not refuse connections: it may well be alive (a failed dial between live
    processes is seen while a reset closes their connections), only not reachable through a new libp2p
    connection yet. `accepted`: its address accepted a plain TCP connection (its host and daemon are up);
    else it did not answer at all (a host cut off or powered down looks so)."""

    def __init__(self, message: str, accepted: bool):
        super().__init__(message)
        self.accepted = accepted


_BACKOFF_ADDRESS = re.compile(r"\[/ip[46]/([^/\]]+)/tcp/(\d+)\] dial backoff")  # a direct address, not a relay
class NotServing(Exception):
    """The peer is up but serves no such stream: a process still starting (its handlers not yet
    registered), or one of another run."""


ADMIT_TIMEOUT_S = 10.0  # an incoming stream must present its swarm-key token within this time
CLOCK_PEERS = 4  # how many neighbours a clock reading pings (decentral.swarm.clocks)
DHT_CHECK_S = 1.0  # how often a waiting DHT call looks whether the DHT process is still alive
DHT_RPC_TIMEOUT_S = 3.0  # a DHT request to a node that does not answer is given up after this (hivemind's
# default, named here): a frozen peer's DHT node stops answering too (see Membership), so others' calls wait it out
ORPHAN_CHECK_S = 1.0  # how often the DHT process looks whether the process that started it is still there
REOPEN_AFTER_S = 0.5  # the pause before asking libp2p again for a stream it failed to open
IDENTITY_RELEASE_S = 20.0  # how long a restarted peer waits for its killed life's daemon to let go of its id
LOCK_HELD_S = 2.0  # a lock hivemind shares across processes, taken this long by none alive, was a killed process's


class _DHTProcess(DHT):
    """hivemind's DHT child process (which also runs the peer's libp2p daemon, p2pd), made to shut down
    when the process that started it dies, and to end when its own shutdown is stuck (`shutdown`).

    hivemind's child outlives a parent killed by SIGKILL or the OOM killer, leaving a stray DHT node and
    daemon behind for good. Here a thread in the child watches its parent; once the parent is gone, it
    asks the child's own loop to shut down exactly as `DHT.shutdown` does, which also stops p2pd. A
    parent killed while it was shutting the child down already sent that request, and a shutdown whose
    daemon went first can hang for good (the loop awaits it and spins on the unread second request): after
    `orphan_grace_s` the thread ends the child's own processes (p2pd) and the child itself.
    """

    orphan_grace_s = 10.0
    kill_grace_s = 3.0  # after hivemind's shutdown ends with a SIGTERM, how long the child has to act on it

    def start(self) -> None:
        self._owner_pid = os.getpid()  # set before the fork, so the child knows whom to watch
        super().start()

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as hivemind does once its loop runs: Ctrl-C is the parent's
        signal.signal(signal.SIGTERM, _interrupt_between_callbacks)  # a SIGTERM (to the process group: `timeout`, a
        # scheduler's cancel; hivemind's own shutdown "the hard way") unwinds the loop, releasing the locks hivemind
        # shares with the parent (a process killed outright may hold one for good), and ends quietly below
        threading.Thread(target=self._shut_down_when_orphaned, name="orphan-watch", daemon=True).start()
        try:
            super().run()
        except KeyboardInterrupt:
            pass

    def shutdown(self) -> None:
        """hivemind's shutdown (ask, wait, then SIGTERM), and then, when the child is alive `kill_grace_s` after
        that SIGTERM (stuck in a callback, or stopped), its processes (p2pd) and itself are killed: it went on
        living beside the process that started it."""
        super().shutdown()
        if self.pid is None:  # never started
            return
        self.join(self.kill_grace_s)
        if self.is_alive():
            log.warning("the DHT process did not end %.0f s after its SIGTERM: killing it", self.kill_grace_s)
            _kill([*descendants(self.pid), self.pid])
            self.join(self.kill_grace_s)
        if self.exitcode is not None and self.exitcode < 0:  # killed by a signal: by us above, the OOM killer...
            _replace_locks_left_held()

    def _shut_down_when_orphaned(self) -> None:
        while os.getppid() == self._owner_pid:
            time.sleep(ORPHAN_CHECK_S)  # no event announces a parent's death; polling getppid is the portable way
        self._outer_pipe.send(("_shutdown", [], {}))  # the child still holds the sending end of its command pipe
        time.sleep(self.orphan_grace_s)  # a shutdown that finishes ends the process, and this thread with it
        log.warning("the DHT process's shutdown hangs %.0f s after its parent died: ending it", self.orphan_grace_s)
        _kill(descendants(os.getpid()))
        os._exit(1)


def _replace_locks_left_held() -> None:
    """(After a DHT process was killed by a signal) Each of hivemind's cross-process MPFuture locks (module-level, so
    shared with every process forked after import) that stays taken for `LOCK_HELD_S` is replaced by a new one: the
    killed process may have died holding it (sending an answer, or starting up), and every DHT process started
    after would wait on it for good. A process forked before keeps the old lock: only new ones are spared."""
    for owner, name in ((MPFuture, "_update_lock"), (MPFuture, "_initialization_lock"), (SharedBytes, "_lock")):
        lock = getattr(owner, name)
        if lock.acquire(timeout=LOCK_HELD_S):
            lock.release()
        else:
            log.warning("hivemind's %s.%s stayed taken after a DHT process was killed: replacing it", owner.__name__,
                        name)
            setattr(owner, name, multiprocessing.Lock())


def _kill(pids) -> None:
    """SIGKILL each of `pids` (a DHT process's, whose shutdown hangs); one that has ended already is passed over.
    The unix sockets of a libp2p daemon among them go too (hivemind removes them only in a shutdown that runs:
    each killed peer left two in /tmp)."""
    sockets = [path for pid in pids for path in _daemon_sockets(pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for path in sockets:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _daemon_sockets(pid: int) -> list[str]:
    """The unix sockets of p2pd process `pid` (its `-listen=/unix/DIR/hivemind-p2pd-ID.sock`, and hivemind's client
    socket of the same ID beside it); [] for another process."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []
    for arg in args:
        if arg.startswith("-listen=/unix/") and "hivemind-p2pd-" in arg:
            daemon = arg.removeprefix("-listen=/unix")
            return [daemon, daemon.replace("hivemind-p2pd-", "hivemind-p2pclient-")]
    return []


def _interrupt_between_callbacks(signum, frame) -> None:
    """SIGTERM in the DHT process: KeyboardInterrupt, raised by its running loop between two callbacks, or here
    when no loop runs. Raised here, at whatever line the main thread is at, it could land in one of uvloop's
    protocol callbacks, which logs it as a fatal transport error, traceback and all, and goes on (2 stops in
    37 where SIGTERM reached the worker, its DHT process and p2pd together: p2pd's pipe closing was the
    callback under way)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise KeyboardInterrupt from None
    loop.call_soon_threadsafe(_raise_interrupt)


def _raise_interrupt() -> None:
    raise KeyboardInterrupt


def announced_maddr(host: str, port: int) -> str:
    """The multiaddr others reach us at, `host` (an IP address: what a NAT or a public interface forwards to us)
    on our fixed `port`; SwarmError when either cannot be announced."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise SwarmError(f"--announce-host {host!r} is not an IP address: give the address other machines reach "
                         "us at, e.g. 203.0.113.5") from None
    if not port:
        raise SwarmError(f"--announce-host {host} needs a fixed --port: the port others reach us at there")
    return f"/ip{address.version}/{address}/tcp/{port}"


class SwarmPeer:
    """Start a new swarm (no `initial_peers`) or join one through any member's multiaddr.

    `run` names the training run: records and streams of other runs in the same DHT are ignored.
    `host`/`port` choose where the libp2p daemon listens (`0.0.0.0` to accept other machines).
    `identity_path`: a private key file (created when missing) that fixes the peer id, so a peer that
    restarts comes back as itself instead of leaving a ghost of its old id in the swarm (without one, a
    fresh identity whose key file is deleted once the daemon has read it). Its key signs our DHT records (see
    `admission`).
    `swarm_key`: admit only peers holding the same key, on the DHT records and on every stream.
    """

    def __init__(
        self,
        run: str,
        initial_peers: Sequence[str] = (),
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        announce_host: str | None = None,
        startup_timeout: float = 60.0,
        identity_path: str | Path | None = None,
        swarm_key: SwarmKey | None = None,
    ):
        check_multiaddrs(initial_peers)
        check_reachable_back(initial_peers, host, announce_host)
        announce = [announced_maddr(announce_host, port)] if announce_host else None
        self.run = run
        self.stats = TrafficStats()
        self.swarm_key = swarm_key
        fresh_dir = None if identity_path else tempfile.mkdtemp(prefix="decentral-identity-")
        identity_path = Path(identity_path or Path(fresh_dir) / "identity.key")
        # an identity of an earlier life may still be in use (its daemon shutting down): hivemind checks that
        # with a daemon of its own, a second start's CPU seconds; one made just now is nobody else's
        earlier_life = identity_path.exists()
        ensure_identity(identity_path)
        self._refused: set[str] = set()  # peers whose keyless stream we logged already
        try:
            self.dht = self._start_dht(initial_peers, host, port, announce, startup_timeout, identity_path,
                                       earlier_life)
        finally:  # the daemon has read a fresh key by now: none is left behind, even by a process killed later
            if fresh_dir:
                shutil.rmtree(fresh_dir, ignore_errors=True)
        self.peer_id = str(self.dht.peer_id)
        self._entries = [str(m) for m in initial_peers]  # what `keep_in_touch` dials again when they fall out of view
        self._pinging: MPFuture | None = None  # keep_in_touch's pings under way
        self._dht_lock = threading.Lock()  # the DHT's command pipe is not thread-safe
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"swarm-{self.peer_id[-6:]}", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._p2p = self.call(self.dht.replicate_p2p()).result(timeout=startup_timeout)
            serve_reach_checks(self)  # a peer joining through us asks whether we can reach it
        except BaseException:  # (Ctrl-C too) a peer that did not start leaves no DHT process behind
            self.shutdown()
            raise

    def _start_dht(self, initial_peers: Sequence[str], host: str, port: int, announce: list[str] | None,
                   startup_timeout: float, identity_path: Path, earlier_life: bool) -> "_DHTProcess":
        """Our DHT node and libp2p daemon, started and ready; an identity or port an earlier life of ours
        still holds is waited for up to IDENTITY_RELEASE_S."""
        deadline, told = time.monotonic() + IDENTITY_RELEASE_S, False
        while True:
            try:
                check_listenable(host, port)
                return _DHTProcess(
                    initial_peers=list(initial_peers),
                    start=True,
                    host_maddrs=[f"/ip4/{host}/tcp/{port}"],
                    announce_maddrs=announce,
                    startup_timeout=startup_timeout,
                    await_ready=True,
                    identity_path=str(identity_path),
                    check_if_identity_free=earlier_life,
                    record_validators=[SignedRecords(identity_path, self.swarm_key)],
                    wait_timeout=DHT_RPC_TIMEOUT_S,
                )
            except Exception as e:  # hivemind raises several types for an unreachable bootstrap peer
                port_held = earlier_life and getattr(e, "errno", None) == errno.EADDRINUSE
                if ("already taken" in str(e) or port_held) and time.monotonic() < deadline:
                    if not told:  # said once, and not only at --verbose: a port another program holds costs the wait
                        log.warning("%s is still in use (an earlier run of this --out shutting down?): waiting up to "
                                    "%.0f s for it", f"port {port}" if port_held else f"identity {identity_path}",
                                    IDENTITY_RELEASE_S)
                        told = True
                    time.sleep(1.0)  # the killed process's DHT child notices its parent is gone within ORPHAN_CHECK_S
                    continue
                raise SwarmError(startup_error(e, initial_peers, host, port)) from e

    # ----- event loop -----
    def call(self, coro: Awaitable[Any]) -> Future:
        """Run a coroutine on the swarm's loop; returns a concurrent Future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # ----- addresses and records -----
    def _dht_send(self, send: Callable[[], MPFuture]) -> MPFuture:
        """Start the DHT call that `send` makes: only the send holds the DHT lock, so a call that waits out
        a node that hangs does not hold up the others (a record's renewal behind a lookup lapsed)."""
        with self._dht_lock:
            check_dht_alive(self.dht)
            return send()

    def _dht_call(self, send: Callable[[], MPFuture]) -> Any:
        """The result of the DHT call that `send` starts (`dht_result`)."""
        return dht_result(self.dht, self._dht_send(send))

    def multiaddrs(self) -> list[str]:
        maddrs = self._dht_call(lambda: self.dht.run_coroutine(DHT._get_visible_maddrs, return_future=True))
        return [str(m) for m in maddrs]

    def publish(self, key: str, subkey: str, value: Any, ttl: float) -> bool:
        """Store `value` under `run/key` for `ttl` seconds, one entry per `subkey`."""
        return bool(self._dht_call(self._store(key, subkey, value, ttl)))

    def publish_nowait(self, key: str, subkey: str, value: Any, ttl: float) -> None:
        """`publish`, returning once the store is sent: for a record renewed on a schedule, which a store
        must not hold up (one waits out the RPC timeout of each DHT node that hangs, twice: finding the
        key's nodes, then storing on them; the record lands on this node after the first)."""
        self._dht_send(self._store(key, subkey, value, ttl))

    def _store(self, key: str, subkey: str, value: Any, ttl: float) -> Callable[[], MPFuture]:
        return lambda: self.dht.store(f"{self.run}/{key}", value, expiration_time=get_dht_time() + ttl, subkey=subkey,
                                      return_future=True)

    def keep_in_touch(self) -> None:
        """Ping each peer we joined through that our DHT node no longer counts as a neighbour. hivemind drops a
        node from the routing table at its first request that goes unanswered (one timeout: a busy peer's), and
        two nodes that dropped each other never talk again: each sees only its own records, for good (a swarm of
        two is then two swarms of one). Answering a ping puts each back in the other's table. Call it now and
        then (the membership's heartbeat does); it returns once the pings are sent, and sends none while the
        last ones are under way (a frozen peer's take two RPC timeouts: the dial, the ping)."""
        if not self._entries or (self._pinging is not None and not self._pinging.done()):
            return
        self._pinging = self._dht_send(lambda: self.dht.run_coroutine(partial(_ping_absent, self._entries),
                                                                      return_future=True))

    def read_clocks(self, peers: int = CLOCK_PEERS) -> MPFuture:
        """Start reading the clocks of up to `peers` of our DHT node's neighbours, picked at random; returns once
        the reading is sent. Its result: {peer id: (least, most) seconds its clock is ahead of ours}, for those
        that answered within the DHT's RPC timeout (decentral.swarm.clocks)."""
        return self._dht_send(lambda: self.dht.run_coroutine(partial(_read_clocks, peers), return_future=True))

    def lookup(self, key: str) -> dict[str, Any]:
        """All unexpired entries under `run/key`, as {subkey: value}."""
        found = self._dht_call(lambda: self.dht.get(f"{self.run}/{key}", latest=True, return_future=True))
        if found is None or not isinstance(found.value, dict):
            return {}
        return {str(sub): item.value for sub, item in found.value.items()}

    # ----- streams -----
    def _proto(self, name: str) -> str:
        return f"/decentral/{self.run}/{name}"

    def add_handler(self, name: str, handler: Callable[..., Awaitable[None]], *, with_address: bool = False) -> None:
        """Serve stream `name`: `handler(sender_peer_id, reader, writer)` runs on the loop per incoming stream;
        `with_address`: `handler(sender_peer_id, address, reader, writer)`, where `address` is the multiaddr the
        stream's connection comes from."""

        async def serve(info, reader, writer):
            try:
                if not await self._admit(str(info.peer_id), self._proto(name), reader):
                    return
                where = (str(info.addr),) if with_address else ()
                await handler(str(info.peer_id), *where, reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                log.debug("stream %s from %s ended early: %s", name, info.peer_id, e)
            except (WireError, ValueError, OverflowError, TimeoutError) as e:  # its request: not JSON, too big, late
                log.warning("dropping a malformed or late request on %s from %s: %r", name, info.peer_id, e)
            except asyncio.CancelledError:  # we are shutting down. Ended quietly: Python 3.11's stream callback
                log.debug("stream %s from %s cut off: we are leaving", name, info.peer_id)  # logs an ERROR for
                # a handler task that ends cancelled (3.12 checks `task.cancelled()` first)
            except Exception:
                log.exception("handler %s failed on a stream from %s", name, info.peer_id)
            finally:
                writer.close()

        self.call(self._p2p.add_binary_stream_handler(self._proto(name), serve)).result(timeout=30)

    async def open_stream(self, peer: str, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A stream to `peer`'s handler `name`. ConnectionRefusedError when `peer`'s address refuses the
        connection (its process is gone, not merely slow). When libp2p holds back dials to it because one
        failed in the last seconds (its dial backoff, 5 s and more: our DHT node may have dialled the dead
        peer first, or a reset between live peers failed one), a plain TCP dial to its addresses tells
        which: ConnectionRefusedError when they refuse it, DialHeldBack when one accepts or is silent.
        NotServing when it answers but has no handler `name`; other failures as hivemind raises them."""
        try:
            _, reader, writer = await self._p2p.call_binary_stream_handler(PeerID.from_base58(peer), self._proto(name))
        except P2PDaemonError as e:
            if "connection refused" in str(e):
                raise ConnectionRefusedError(f"{peer} refuses connections: {e}") from e
            if "dial backoff" in str(e):
                found = await plain_dial(_BACKOFF_ADDRESS.findall(str(e)))
                if found == "refused":
                    raise ConnectionRefusedError(f"{peer} refuses connections (libp2p's dial backoff, and a plain "
                                                 f"dial to its address is refused): {e}") from e
                raise DialHeldBack(f"libp2p holds back dials to {peer} after one failed; its address "
                                   + ("accepts a plain connection" if found == "accepted" else "does not answer"),
                                   accepted=found == "accepted") from e
            if "protocols not supported" in str(e):
                raise NotServing(f"{peer} serves no {name!r} stream (yet)") from e
            raise
        if self.swarm_key is not None:
            await write_frame(writer, self.swarm_key.stream_token(self.peer_id, peer, self._proto(name)), self.stats)
        return reader, writer

    async def open_stream_or_again(self, peer: str, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """`open_stream`, asked once more after REOPEN_AFTER_S when libp2p fails to open it for a reason
        `open_stream` does not name ("Connect failed", seen right after a reset between live peers). For one
        request a stream: the averager's pushes handle such failures their own way."""
        try:
            return await self.open_stream(peer, name)
        except P2PDaemonError as e:
            log.info("stream %s to %s: %s; asking again in %.1fs", name, peer[-8:], e, REOPEN_AFTER_S)
            await asyncio.sleep(REOPEN_AFTER_S)
            return await self.open_stream(peer, name)

    async def _admit(self, sender: str, protocol: str, reader: asyncio.StreamReader) -> bool:
        """Whether an incoming stream carries `sender`'s token for our swarm key (always, without a key)."""
        if self.swarm_key is None:
            return True
        try:
            token = await asyncio.wait_for(read_frame(reader, self.stats, TOKEN_BYTES), ADMIT_TIMEOUT_S)
        except Exception as e:  # closed or silent before its token: its process may have died mid-dial
            log.debug("a %s stream from %s ended before its token: %r", protocol, sender, e)
            return False
        if hmac.compare_digest(token, self.swarm_key.stream_token(sender, self.peer_id, protocol)):
            return True
        if sender not in self._refused:
            self._refused.add(sender)
            log.warning("refused streams from %s: it does not hold this swarm's key", sender)
        return False

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.call(self._p2p.shutdown()).result(timeout=10)
        except Exception as e:
            log.debug("p2p replica shutdown: %s", e)
        try:  # as asyncio.run ends a loop: what is still running (an average in flight) ends now, not at exit
            self.call(_cancel_pending()).result(timeout=10)
        except Exception as e:
            log.debug("cancelling the loop's tasks: %s", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        # a call holds the lock only while it sends; one sending to a DHT process that is alive but stuck (its
        # pipe full) may hold it for good: shut down without it then
        held = self._dht_lock.acquire(timeout=10)
        try:
            self.dht.shutdown()
        finally:
            if held:
                self._dht_lock.release()


async def _ping_absent(maddrs: list[str], dht: DHT, node) -> None:
    """(In the DHT process) ping each peer of `maddrs` that `node`'s routing table lacks, dialling its address
    first (libp2p may have dropped the connection); one that answers is in the table again."""
    for maddr in maddrs:
        peer_id = PeerID.from_base58(maddr.rsplit("/p2p/", 1)[1])
        if node.protocol.routing_table.get(peer_id=peer_id) is not None:
            continue
        with contextlib.suppress(Exception):  # unreachable now: the next call tries again
            await asyncio.wait_for(node.p2p._client.connect(peer_id, [Multiaddr(maddr)]), DHT_RPC_TIMEOUT_S)
        await node.protocol.call_ping(peer_id)


async def _read_clocks(peers: int, dht: DHT, node) -> dict[str, tuple[float, float]]:
    """(In the DHT process) ping up to `peers` random neighbours of `node`: hivemind's answer to a ping carries
    the clock of the peer that answers, read between our request and its answer."""
    neighbours = list(node.protocol.routing_table.peer_id_to_uid)
    request = dht_pb2.PingRequest(peer=node.protocol.node_info)

    async def read(peer_id: PeerID) -> tuple[str, tuple[float, float]] | None:
        sent = get_dht_time()
        with contextlib.suppress(Exception):  # gone, or slow: read another time
            answer = await node.protocol.get_stub(peer_id).rpc_ping(request, timeout=DHT_RPC_TIMEOUT_S)
            if answer.dht_time:  # 0: a peer that does not say
                return str(peer_id), (answer.dht_time - get_dht_time(), answer.dht_time - sent)
        return None

    found = await asyncio.gather(*map(read, random.sample(neighbours, min(peers, len(neighbours)))))
    return dict(filter(None, found))


async def _cancel_pending() -> None:
    """Cancel every other task of the running loop and wait until they have ended (their `finally` blocks run
    while the loop still runs; a loop stopped under them leaves them to be destroyed pending at exit)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
