"""decentral.netlab on real network namespaces (root only) and in loopback mode."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import needs_netns
from decentral import netlab
from decentral.netlab import NetLab, NetLabError, cleanup_stale, measure_throughput, parse_rate


def signalled(proc: subprocess.Popen, sig: int) -> tuple[str, str]:
    """Send `sig` to `proc` and return its (stdout, stderr) once it exits; fail if it has not within 30 s."""
    proc.send_signal(sig)
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"no exit within 30 s of signal {sig!r}; stdout {out!r}, stderr:\n{err}")


def leftovers(prefix: str) -> list[str]:
    """Namespaces and links in the root namespace whose lab_name starts with `prefix`."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    names = [line.split()[0] for line in namespaces.splitlines() if line.strip()]
    names += [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()]
    return [n for n in names if n.startswith(prefix)]


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


PRINT_ENV = ("import os; print(' '.join(os.environ[k] for k in ('DECENTRAL_HOST_INDEX', 'DECENTRAL_HOST_ADDR', "
             "'DECENTRAL_LINK_RATE_BPS', 'DECENTRAL_LINK_LATENCY_MS', 'DECENTRAL_NETLAB_MODE', 'EXTRA')))")


@pytest.mark.parametrize("text, bps", [
    ("20mbit", 20_000_000), ("100Mbit", 100_000_000), ("512kbit", 512_000), ("1gbit", 1_000_000_000),
    ("10mbps", 10_000_000), ("1.5mbit", 1_500_000), (" 64 kbit ", 64_000), ("300bit", 300), ("1tbit", 10**12),
])
def test_parse_rate(text, bps):
    assert parse_rate(text) == bps


def test_rates_are_said_in_a_unit_that_fits_them():
    """An 8bit cap was said as "cap 8e-06 Mbit/s"."""
    assert [netlab.human_rate(bps) for bps in (8, 512e3, 1.5e6, 19.24e6, 959.5e6, 1e9, 1e12)] == [
        "8 bit/s", "512 kbit/s", "1.5 Mbit/s", "19.2 Mbit/s", "960 Mbit/s", "1 Gbit/s", "1 Tbit/s"]


@pytest.mark.parametrize("text", ["", "20", "fast", "20mb", "-5mbit", "0mbit", "20 mbits", "1e3mbit", "mbit", "7bit",
                                  "1.1tbit"])  # (100tbit was tc's "illegal value for burst" at set-up)
def test_parse_rate_rejects_junk(text):
    with pytest.raises(ValueError, match="rate"):
        parse_rate(text)


def test_rates_one_for_every_host_or_one_per_host():
    assert netlab.parse_rates("20mbit", 3) == [20_000_000] * 3 and netlab.parse_rates(None, 2) == [None, None]
    rates = netlab.parse_rates("20mbit,20mbit,none,5mbit", 4)
    assert rates == [20_000_000, 20_000_000, None, 5_000_000]
    assert netlab.describe_rates(rates) == "h0-h1 20 Mbit/s, h2 uncapped, h3 5 Mbit/s"
    assert netlab.describe_rates(rates[:2], "p", 1) == "20 Mbit/s"
    assert netlab.describe_rates([8_000_000, 1_000_000], "p", 1) == "p1 8 Mbit/s, p2 1 Mbit/s"
    with pytest.raises(netlab.LabSettingsError, match="'20mbit,5mbit' gives 2 rates for 3 hosts"):
        netlab.parse_rates("20mbit,5mbit", 3)
    with pytest.raises(netlab.LabSettingsError, match="not a link rate: 'fast'"):
        netlab.parse_rates("20mbit,fast", 2)


def test_each_host_of_a_loopback_lab_paces_to_its_own_uplink(lab_name):
    with NetLab(3, "20mbit,none,5mbit", name=lab_name, mode="loopback") as lab:
        assert lab.app_shaping and [host.rate_bps for host in lab.hosts] == [20_000_000, None, 5_000_000]
        assert [host.env["DECENTRAL_LINK_RATE_BPS"] for host in lab.hosts] == ["20000000", "", "5000000"]
        assert "bandwidth h0 20 Mbit/s, h1 uncapped, h2 5 Mbit/s" in lab.notice()
        paced = measure_throughput(lab, 2, 0, seconds=1.0)
        assert 0.7 * 5e6 < paced < 1.05 * 5e6, f"{paced / 1e6:.1f} Mbit/s from h2 (5 Mbit/s)"


def test_loopback_mode_exposes_rate_to_apps(lab_name):
    with NetLab(3, "20mbit", latency_ms=25, name=lab_name, mode="loopback") as lab:
        assert lab.mode == "loopback" and lab.app_shaping and lab.hosts[2].rate_bps == 20_000_000
        assert [h.address for h in lab.hosts] == ["127.0.0.1"] * 3
        assert all(h.namespace is None for h in lab.hosts)
        out = lab.hosts[2].run([sys.executable, "-c", PRINT_ENV], timeout=30, env={"EXTRA": "x"}).stdout
        assert out.split() == ["2", "127.0.0.1", "20000000", "25", "loopback", "x"]
        out = lab.hosts[2].run([sys.executable, "-c", PRINT_ENV], timeout=30,
                               env={"EXTRA": "y", "DECENTRAL_LINK_RATE_BPS": "5"}).stdout  # (one process's own)
        assert out.split() == ["2", "127.0.0.1", "5", "25", "loopback", "y"]
        with socket.socket() as held:  # (iperf3's port, where the receiver listened: anything there failed it)
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            held.bind(("127.0.0.1", 5201))
            held.listen()
            paced = measure_throughput(lab, 0, 1, seconds=1.0)
        assert 0.7 * lab.hosts[0].rate_bps < paced < 1.05 * lab.hosts[0].rate_bps
    with NetLab(1, None, name=lab_name, mode="loopback") as lab:
        assert not lab.app_shaping and lab.hosts[0].env["DECENTRAL_LINK_RATE_BPS"] == ""


@needs_netns
@pytest.mark.solo
def test_capped_link_measures_near_its_cap(lab_name):
    """Each host's uplink is its own: h0's 20 Mbit/s, h1's 200 Mbit/s."""
    with NetLab(2, "20mbit,200mbit", name=lab_name, mode="netns") as lab:
        capped = measure_throughput(lab, 0, 1, seconds=2.0)
        fast = measure_throughput(lab, 1, 0, seconds=2.0)
    print(f"20mbit cap: {capped / 1e6:.1f} Mbit/s, 200mbit cap: {fast / 1e6:.1f} Mbit/s")
    assert 0.7 * 20e6 <= capped <= 1.05 * 20e6
    assert fast > 4 * capped


def test_a_measured_stream_that_falls_silent_ends_the_measurement_with_what_arrived(monkeypatch, capsys):
    """A cap too low to carry a packet in RECV_SILENCE_S (`--bandwidth 8bit --measure`): the receiver timed out
    and `netlab` ended in its flattened traceback. Now the silence ends the measurement, counted in its time."""
    monkeypatch.setattr(netlab, "RECV_SILENCE_S", 0.5)
    receiver = threading.Thread(target=netlab._recv_main, args=("127.0.0.1", 30.0))
    receiver.start()
    said, deadline = "", time.monotonic() + 10
    while not said.startswith("ready "):  # the port it listens on, once it does
        assert time.monotonic() < deadline
        said += capsys.readouterr().out
        time.sleep(0.01)
    with socket.create_connection(("127.0.0.1", int(said.split()[1])), timeout=1) as sender:
        sender.sendall(b"x" * 1000)  # starts the clock
        sender.sendall(b"y" * 3000)
        receiver.join(timeout=10)
        assert not receiver.is_alive()
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["bytes"] <= 3000 and result["seconds"] >= 0.5, result


@needs_netns
def test_hosts_reach_each_other_and_objects_exist_while_open(lab_name):
    server = textwrap.dedent("""
        import socket, sys
        with socket.create_server((sys.argv[1], 7000)) as s:
            s.settimeout(20)
            print("ready", flush=True)
            conn, peer = s.accept()
            print(conn.recv(100).decode(), peer[0], flush=True)
    """)
    client = "import socket, sys; socket.create_connection((sys.argv[1], 7000), timeout=10).sendall(b'hello')"
    with NetLab(2, "50mbit", name=lab_name, mode="netns") as lab:
        h0, h1 = lab.hosts
        assert (h0.address, h1.address) == ("10.213.0.1", "10.213.0.2")
        assert sorted(leftovers(lab_name)) == sorted([f"{lab_name}-h0", f"{lab_name}-h1", f"{lab_name}-v0", f"{lab_name}-v1", f"{lab_name}br"])
        root_addrs = subprocess.run(["ip", "addr"], capture_output=True, text=True, check=True).stdout
        assert "10.213." not in root_addrs
        srv = h1.popen([sys.executable, "-c", server, h1.address], stdout=subprocess.PIPE, text=True)
        assert srv.stdout.readline().strip() == "ready"
        assert h0.run([sys.executable, "-c", client, h1.address], timeout=20).returncode == 0
        assert srv.communicate(timeout=20)[0].split() == ["hello", "10.213.0.1"]
    assert leftovers(lab_name) == []


@needs_netns
def test_a_second_lab_of_a_running_labs_name_is_refused_and_the_first_goes_on(lab_name):
    """Its set-up removed what a lab of that name left, as after a crash: the running lab's namespaces and
    processes (two benches at once each killed the other's workers)."""
    with NetLab(2, None, name=lab_name, mode="netns") as first:
        sleeper = first.hosts[1].popen(["sleep", "30"])
        with pytest.raises(NetLabError, match=f"a lab named '{lab_name}' is running on this machine"):
            NetLab(2, None, name=lab_name, mode="netns")
        assert sleeper.poll() is None
        assert sorted(leftovers(lab_name)) == sorted([f"{lab_name}-h0", f"{lab_name}-h1", f"{lab_name}-v0",
                                                      f"{lab_name}-v1", f"{lab_name}br"])
    with NetLab(1, None, name=lab_name, mode="netns"):  # the name is free once the first lab ended
        pass
    assert not list(Path(tempfile.gettempdir()).glob(f"decentral-netlab-{lab_name}.lock"))  # (each lab left one)


@needs_netns
def test_popen_passes_env_inside_namespace(lab_name):
    with NetLab(2, "20mbit", latency_ms=12.5, name=lab_name, mode="netns") as lab:
        out = lab.hosts[1].run([sys.executable, "-c", PRINT_ENV], timeout=30, env={"EXTRA": "y"}).stdout
        assert out.split() == ["1", "10.213.0.2", "20000000", "12.5", "netns", "y"]
        addrs = lab.hosts[1].run(["ip", "-4", "-o", "addr", "show", "dev", "eth0"], timeout=30).stdout
        assert "10.213.0.2/24" in addrs


@needs_netns
def test_exception_inside_with_tears_down_and_kills(lab_name):
    with pytest.raises(RuntimeError, match="boom"):
        with NetLab(2, "20mbit", name=lab_name, mode="netns") as lab:
            sleeper = lab.hosts[0].popen(["sleep", "60"])
            raise RuntimeError("boom")
    assert sleeper.poll() is not None
    assert leftovers(lab_name) == []
    lab.close()  # idempotent


@needs_netns
@pytest.mark.parametrize("fail_at", [4, 8, 15, 17])
def test_setup_failure_halfway_removes_everything(lab_name, monkeypatch, fail_at):
    real_cmd, calls = netlab._cmd, []

    def flaky(args):
        calls.append(args)
        if len(calls) == fail_at:
            return real_cmd([*args, "bogus-argument"])  # the real tool fails with a real stderr
        return real_cmd(args)

    monkeypatch.setattr(netlab, "_cmd", flaky)
    with pytest.raises(NetLabError) as err:
        NetLab(2, "20mbit", name=lab_name, mode="netns")
    failed = calls[fail_at - 1]
    assert " ".join(failed) in str(err.value) and "exit" in str(err.value)
    assert leftovers(lab_name) == []


@needs_netns
def test_cleanup_stale_removes_a_crashed_lab(lab_name):
    crash = textwrap.dedent(f"""
        import os, subprocess
        from decentral.netlab import NetLab
        lab = NetLab(2, "20mbit", name={lab_name!r}, mode="netns")
        sleeper = lab.hosts[1].popen(["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(sleeper.pid, flush=True)
        os._exit(1)  # no close(), no atexit: leaves everything behind
    """)
    done = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, timeout=60)
    sleeper = int(done.stdout)
    assert len(leftovers(lab_name)) == 5 and not process_gone(sleeper)
    removed = cleanup_stale(lab_name)
    assert sorted(removed) == sorted([f"netns {lab_name}-h0", f"netns {lab_name}-h1", f"link {lab_name}-v0", f"link {lab_name}-v1",
                                      f"link {lab_name}br"])
    assert leftovers(lab_name) == [] and process_gone(sleeper)
    assert cleanup_stale(lab_name) == []


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_tears_down(lab_name, sig):
    script = textwrap.dedent(f"""
        import signal, time
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal; a background job
        signal.signal(signal.SIGTERM, signal.SIG_DFL)             # (like CI's) inherits SIGINT ignored
        from decentral.netlab import NetLab
        lab = NetLab(2, "20mbit", name={lab_name!r}, mode="netns")
        print("up", flush=True)
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    assert len(leftovers(lab_name)) == 5
    out, err = signalled(proc, sig)
    if sig == signal.SIGINT:
        assert proc.returncode == 0 and "interrupted" in out, err
    else:
        assert proc.returncode == -signal.SIGTERM
    assert leftovers(lab_name) == []


@needs_netns
def test_cli_runs_command_in_every_host(lab_name, capsys):
    parser = argparse.ArgumentParser()
    netlab.add_arguments(parser)
    code = "import sys; print('{i}', '{addr}', '{addr0}'); sys.exit(int('{i}') == 2)"
    args = parser.parse_args(["--hosts", "3", "--name", lab_name, "--mode", "netns", "--", sys.executable, "-c", code])
    assert netlab.main(args) == 1  # h2 exits 1
    lines = capsys.readouterr().out.splitlines()
    for i in range(3):
        assert f"[h{i}] {i} 10.213.0.{i + 1} 10.213.0.1" in lines
    assert leftovers(lab_name) == []


def test_ctrl_c_on_a_command_in_the_lab_says_so_in_one_line(lab_name):
    """It exited 130 without a word (the exit codes' table says an interrupt is said in one line)."""
    proc = subprocess.Popen([sys.executable, "-m", "decentral", "netlab", "--hosts", "1", "--name", lab_name,
                             "--mode", "loopback", "--", sys.executable, "-c", "print('up', flush=True); "
                             "import time; time.sleep(60)"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while "[h0] up" not in proc.stdout.readline():
        assert proc.poll() is None, proc.stderr.read()
    out, err = signalled(proc, signal.SIGINT)
    assert proc.returncode == 130 and err.endswith("netlab: interrupted; the lab is torn down\n"), err


def test_cli_with_nothing_to_run_says_so(lab_name, capsys):
    """A lab with neither a command nor --measure is set up and torn down: said, not done silently."""
    parser = argparse.ArgumentParser()
    netlab.add_arguments(parser)
    assert netlab.main(parser.parse_args(["--hosts", "2", "--name", lab_name, "--mode", "loopback"])) == 0
    out, err = capsys.readouterr()
    assert out.startswith("h0 ") and "give --measure to measure a link, or -- CMD" in err, (out, err)


@needs_netns
def test_a_signal_the_process_ignores_stays_ignored(lab_name):
    """A background job starts with SIGINT ignored; a lab must not turn that SIGINT into a teardown
    while the process itself goes on running."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with NetLab(1, None, name=lab_name, mode="netns"):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # this one still tears down
    finally:
        signal.signal(signal.SIGINT, previous)
    assert leftovers(lab_name) == []


@pytest.mark.parametrize("mode", ["loopback", pytest.param("netns", marks=needs_netns)])
def test_ctrl_c_while_the_hosts_run_a_command_ends_the_lab(lab_name, mode):
    """Ctrl-C on `decentral netlab -- CMD` lands while the main thread waits for a host's process: the
    teardown must not wait on that process again (it hung forever on the Popen's wait lock)."""
    script = textwrap.dedent(f"""
        import signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
        from decentral.cli import main
        sys.argv = ["decentral", "netlab", "--hosts", "2", "--name", {lab_name!r}, "--mode", {mode!r}, "--",
                    sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
        sys.exit(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = 0
    while started < 2:  # the hosts' list first, then each host's command says it runs
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        started += line.strip().endswith("started")
    out, err = signalled(proc, signal.SIGINT)
    assert proc.returncode == 130, err
    if mode == "netns":
        assert leftovers(lab_name) == []


@needs_netns
def test_cleanup_stale_removes_a_dead_processs_probe_and_keeps_a_live_ones(lab_name):
    """A probe namespace (`netns_available`'s `NAME-PID-probe`) that its process died before deleting was never
    removed: the pattern looked for `NAME-probe`, the probe's name before our process id went into it."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead, live = f"{lab_name}-{gone.pid}-probe", f"{lab_name}-{os.getpid()}-probe"
    for probe in (dead, live):
        subprocess.run(["ip", "netns", "add", probe], check=True)
    try:
        assert cleanup_stale(lab_name) == [f"netns {dead}"]
        assert live in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        for probe in (dead, live):
            subprocess.run(["ip", "netns", "del", probe], capture_output=True)


@pytest.mark.parametrize("mode", ["loopback", pytest.param("netns", marks=needs_netns)])
def test_closing_the_lab_ends_what_its_processes_started(lab_name, mode):
    """A bench's worker killed at teardown left its DHT process and libp2p daemon running, orphaned, for 10-20 s
    in loopback mode (netns mode kills all that is left in its namespaces)."""
    starts_one = ("import subprocess, sys, time; child = subprocess.Popen(['sleep', '600']); "
                  "print(child.pid, flush=True); time.sleep(600)")
    with NetLab(1, None, name=lab_name, mode=mode) as lab:
        parent = lab.hosts[0].popen([sys.executable, "-c", starts_one], stdout=subprocess.PIPE, text=True)
        child = int(parent.stdout.readline())
    assert process_gone(parent.pid) and process_gone(child)
