"""Shared fixtures: real swarm peers on loopback, and real `decentral train` worker processes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import pytest
import yaml

os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")

from decentral.loopback import LoopbackHub, LoopbackTransport  # noqa: E402
from decentral.metrics import read_metrics  # noqa: E402
from decentral.netlab import cleanup_stale, netns_available  # noqa: E402
from decentral.pipeline.launch import LAUNCHER, LocalPipeline  # noqa: E402
from decentral.swarm import SwarmTransport  # noqa: E402

TINY_MODEL = {"n_layer": 2, "n_head": 2, "d_model": 32, "context": 32}
TINY_TRAIN = {"batch_size": 8, "context": 32, "lr": 3.0e-3, "warmup_steps": 5, "eval_batches": 4, "eval_every": 10}


NETNS = netns_available("tprobe")
needs_netns = pytest.mark.skipif(not NETNS, reason="needs root and a working `ip netns` (network namespaces)")


def pytest_collection_modifyitems(config, items):
    """The `solo` tests last (in their order; the others keep theirs): pytest-xdist hands them out once every
    other test is handed out, so they run one after the other and neither worker waits, between them, for a
    long test of the other one to end (up to half a minute each, with the solo tests spread through the run);
    last, not first, so that no worker's session fixtures (the prefork server's imports) start beside one."""
    items.sort(key=lambda item: item.get_closest_marker("solo") is not None)


@pytest.fixture(autouse=True)
def _alone_when_solo(request, tmp_path_factory):
    """Under pytest-xdist (`-n 2`, pyproject's addopts), a test marked `solo` runs while no other test does: it
    measures bytes or time against a bound, which the other worker's load would move. A readers-writer lock on
    a file the workers share: every test holds it shared, a solo test exclusive. A POSIX record lock (lockf),
    which a process forked during the test does not inherit (flock's would stay held by a DHT process the test
    left running, and the next solo test would wait for it forever)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    solo = request.node.get_closest_marker("solo") is not None
    with open(tmp_path_factory.getbasetemp().parent / "solo.lock", "a+") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX if solo else fcntl.LOCK_SH)
        yield


@pytest.fixture
def lab_name():
    """A short netlab name unique to this test; the labs named after it (NAME, and NAMEa, NAMEb, the two
    labs of `bench islands`) and whatever they left behind are removed afterwards."""
    prefix = "t" + secrets.token_hex(2)
    yield prefix
    if NETNS:
        for lab in (prefix, prefix + "a", prefix + "b"):
            cleanup_stale(lab)
            Path(tempfile.gettempdir(), f"decentral-netlab-{lab}.lock").unlink(missing_ok=True)  # a crashed lab's


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for torch.distributed's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_in_threads(fns, timeout: float = 60.0) -> list:
    """Call each of `fns` in its own thread (peers must meet in a round at the same time); their results in order."""
    out = [None] * len(fns)

    def go(i):
        out[i] = fns[i]()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return out


def loss_step(protocol, x) -> None:
    """One inner step of `protocol`'s model on the loss mean(model(x)²), through its optimizer (and hooks)."""
    protocol.model(x).pow(2).mean().backward()
    protocol.optimizer.step()
    protocol.optimizer.zero_grad()


def wait_until(condition, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} never held within {timeout}s"
        time.sleep(0.01)  # polling another peer's state


def refused_by_name(capsys, command: list[str], cases, out: Path) -> None:
    """Each (args, said) of `cases`: `decentral COMMAND ARGS --out OUT` stops as a usage error (exit 2) whose
    message holds `said`."""
    from decentral.cli import main

    for args, said in cases:
        with pytest.raises(SystemExit) as exit:
            main([*command, *args, "--out", str(out)])
        assert exit.value.code == 2 and said in capsys.readouterr().err, args


def wait_until_senders_counted(senders, sent_before, receiver, received_before) -> None:
    """Wait until `senders`' byte counters (from `sent_before`) hold every byte `receiver` read since
    `received_before`: a sender counts a frame once its last piece has drained, which can be after the
    reader has it, so a test that compares senders' counts right after a download waits for this first."""
    wait_until(lambda: sum(s.bytes_sent for s in senders) - sum(sent_before)
               >= receiver.bytes_received - received_before, 10, "the senders counting every byte received")


def fail_to_open_once(peer, stream: str, monkeypatch) -> list[str]:
    """Make `peer`'s first open of a `stream` stream fail as libp2p's daemon can right after a reset between
    live peers ("Connect failed"); returns the list the failed target is put in (later opens go through)."""
    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

    opened, failed = peer.open_stream, []

    async def fails_once(target, name):
        if name == stream and not failed:
            failed.append(target)
            raise ControlFailure("Connect failed. msg=connection failed")
        return await opened(target, name)

    monkeypatch.setattr(peer, "open_stream", fails_once)
    return failed


def kill_leftovers(pids) -> None:
    """SIGKILL each of `pids` still there (a test's cleanup after processes it expected to end)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (Linux /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def timed_average(finished: dict, name: str, peer, x, group, tag, round: int | None = None):
    """peer.average(x) over `group` (for `round`), noting in finished[name] when it returned."""
    result = peer.average(x, sorted(group), tag, round=round)
    finished[name] = time.monotonic()
    return result


@pytest.fixture
def make_swarm():
    """make_swarm(n, **transport_kwargs) -> n SwarmTransports joined into one swarm, each seeing every
    other's heartbeat (so no test races a heartbeat's first trip through the DHT); all closed after the test."""
    made: list[SwarmTransport] = []

    def make(n: int, **kwargs) -> list[SwarmTransport]:
        kwargs.setdefault("timeout", 10.0)
        kwargs.setdefault("heartbeat_s", 0.5)
        run = made[0].peer.run if made else kwargs.pop("run", f"test-{time.monotonic_ns()}")
        first = made[0] if made else SwarmTransport(run, **kwargs)
        if not made:
            made.append(first)
        while len(made) < n:
            made.append(SwarmTransport(run, first.multiaddrs(), **kwargs))
        ids = {t.peer_id for t in made[:n]}
        wait_until(lambda: all(ids <= set(t.progress()) for t in made[:n]), 30, "every peer seeing every heartbeat")
        return made[:n]

    yield make
    for t in made:
        t.close()


@pytest.fixture
def make_loopback():
    """make_loopback(n) -> n LoopbackTransports of one hub (decentral.loopback); closed after the test."""
    hub, made = LoopbackHub(timeout_s=10.0), []

    def make(n: int) -> list[LoopbackTransport]:
        while len(made) < n:
            made.append(hub.transport())
        return made[:n]

    yield make
    for t in made:
        t.close()


@pytest.fixture(params=["loopback", "swarm"])
def make_peers(request):
    """make_loopback or make_swarm: a protocol's rules, checked in milliseconds and over the real swarm."""
    return request.getfixturevalue(f"make_{request.param}")


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """A folder of real text: 60 modules of the Python standard library."""
    src = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("corpus")
    files = sorted(p for p in src.glob("*.py") if p.stat().st_size > 4000)[:60]
    for p in files:
        shutil.copy(p, out / p.name)
    return out


def write_recipe(path: Path, protocol: dict, steps: int, timeout: float = 10.0) -> Path:
    recipe = {
        "protocol": protocol,
        "train": {**TINY_TRAIN, "steps": steps},
        "model": TINY_MODEL,
        "swarm": {"timeout": timeout, "heartbeat_s": 0.5, "run": f"t{time.monotonic_ns()}"},
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


class ForkedWorker:
    """A worker that `tests/prefork.py` forked, with the part of subprocess.Popen's interface tests use;
    `returncode` is set when the server reports its end."""

    def __init__(self, server: "Prefork", pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        with self.server.ended:
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.server.ended:
            if not self.server.ended.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            return self.returncode

    def send_signal(self, sig: int) -> None:
        with self.server.ended:  # not reported as ended: not reaped, so the pid is still this worker's
            if self.returncode is None:
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Prefork:
    """`tests/prefork.py`, started once per session: `decentral` workers forked after their imports."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("prefork.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ended = threading.Condition()
        self.running: dict[int, ForkedWorker] = {}
        self.started: list[ForkedWorker] = []
        self.lock = threading.Lock()  # one request at a time: its "started" line is the next one
        threading.Thread(target=self._read, daemon=True, name="prefork").start()

    def _read(self) -> None:
        """The server's lines, in order: a pid is reported ended before the kernel can give it again."""
        for line in self.proc.stdout:
            kind, pid, *code = line.split()
            with self.ended:
                if kind == "started":
                    self.running[int(pid)] = worker = ForkedWorker(self, int(pid))
                    self.started.append(worker)
                elif int(pid) in self.running:
                    self.running.pop(int(pid)).returncode = int(code[0])
                self.ended.notify_all()

    def spawn(self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None,
              err: Path | None = None) -> ForkedWorker:
        """`python -m decentral ARGV` in `cwd` (default: ours) with stdout appended to `log` and stderr to `err`
        (default: `log` too), forked from the server; its environment ours and `env`."""
        request = {"argv": list(argv), "cwd": str(cwd or os.getcwd()), "env": {**os.environ, **(env or {})},
                   "log": str(log), **({"err": str(err)} if err else {})}
        with self.lock, self.ended:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            assert self.ended.wait_for(lambda: self.started or self.proc.poll() is not None, 120), "prefork silent"
            assert self.started, f"the prefork server exited with {self.proc.returncode}"
            return self.started.pop()

    def run(self, argv: Sequence[str], cwd: Path, timeout: float = 300.0) -> subprocess.CompletedProcess:
        """`decentral ARGV` run to its end in `cwd`, as `subprocess.run(..., capture_output=True, text=True)`
        reports it: its exit code, stdout and stderr apart."""
        out, err = (Path(tempfile.mkstemp(prefix="decentral-", suffix=suffix, dir=cwd)[1])
                    for suffix in (".out", ".err"))
        try:
            code = self.spawn(argv, out, cwd=cwd, err=err).wait(timeout)
            return subprocess.CompletedProcess(list(argv), code, out.read_text(), err.read_text())
        finally:
            out.unlink()
            err.unlink()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def prefork():
    server = Prefork()
    yield server
    server.close()


class ForkedPipeline(LocalPipeline):
    """A pipeline run on loopback whose nodes are forked from `server` (as Workers' are)."""

    def __init__(self, server: Prefork, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server = server

    def _start(self, cmd: list[str], log: Path, host) -> subprocess.Popen | ForkedWorker:
        if host is None:
            return self.server.spawn(cmd[len(LAUNCHER):], log, self.env)
        return super()._start(cmd, log, host)


@pytest.fixture
def local_pipeline(prefork) -> Callable[..., LocalPipeline]:
    """LocalPipeline's constructor, for runs whose nodes are forked from `prefork`."""
    return lambda *args, **kwargs: ForkedPipeline(prefork, *args, **kwargs)


DECENTRAL = (sys.executable, "-m", "decentral")  # a worker's default launcher (forked from `prefork` instead)


class Workers:
    """`decentral train` processes of one swarm, started like a user starts them (by default forked from
    `prefork` once its imports are done: a process of its own that runs `python -m decentral`'s code)."""

    def __init__(self, root: Path, recipe: Path, data: Path, num_workers: int, server: Prefork):
        self.root, self.recipe, self.data, self.num_workers, self.server = root, recipe, data, num_workers, server
        self.procs: dict[int, subprocess.Popen | ForkedWorker] = {}
        self.bootstrap: list[str] = []

    def start(self, index: int, steps: int | None = None, min_peers: int | None = None, extra: Sequence[str] = (),
              launcher: Sequence[str] = DECENTRAL, join: Sequence[str] | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen | ForkedWorker:
        """Start worker `index` with `launcher` (e.g. torchrun), `extra` arguments and environment variables
        `env`; unless `min_peers` says otherwise, it waits for all `num_workers` to be up. It joins `join`,
        by default the first worker."""
        out = self.root / f"w{index}"
        cmd = [*launcher, "train", "--protocol", str(self.recipe), "--out", str(out),
               "--name", f"w{index}", "--data", str(self.data), "--worker-index", str(index),
               "--num-workers", str(self.num_workers), "--min-peers", str(min_peers or self.num_workers), *extra]
        if steps:
            cmd += ["--steps", str(steps)]
        maddr_file = self.root / f"w{index}.maddrs"
        cmd += ["--maddr-file", str(maddr_file)]
        for m in self.bootstrap if join is None else join:
            cmd += ["--join", m]
        log = self.root / f"w{index}.log"  # a restarted worker's log goes on in the same file
        if tuple(launcher) == DECENTRAL:
            proc = self.server.spawn(cmd[len(launcher):], log, env)
        else:
            proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=open(log, "a"),
                                    stderr=subprocess.STDOUT)
        self.procs[index] = proc
        if not self.bootstrap:
            self.bootstrap = wait_for_file(maddr_file, proc, 120).split()
        return proc

    def wait(self, timeout: float) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        return {i: p.wait(timeout=max(1, deadline - time.monotonic())) for i, p in self.procs.items()}

    def metrics(self, index: int, rank: int = 0) -> list[dict]:
        """Worker `index`'s metrics records (of its island's rank `rank`); [] before it wrote any. A live worker
        may be writing its last line: `read_metrics` skips an unterminated one."""
        path = self.root / f"w{index}" / (f"rank{rank}" if rank else "") / "metrics.jsonl"
        return read_metrics(path) if path.exists() else []

    def log(self, index: int) -> str:
        return (self.root / f"w{index}.log").read_text()

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text()
        assert proc.poll() is None, f"worker exited with {proc.returncode} before writing {path}"
        time.sleep(0.1)  # polling a file that another process writes
    raise TimeoutError(f"{path} did not appear within {timeout}s")


@pytest.fixture
def workers(tmp_path, small_corpus, prefork):
    made: list[Workers] = []

    def make(protocol: dict, steps: int, num_workers: int, timeout: float = 10.0) -> Workers:
        w = Workers(tmp_path, write_recipe(tmp_path / "recipe.yaml", protocol, steps, timeout), small_corpus,
                    num_workers, prefork)
        made.append(w)
        return w

    yield make
    for w in made:
        w.kill_all()
