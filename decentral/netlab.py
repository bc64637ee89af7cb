"""Emulated hosts on one machine, each behind an uplink capped at a chosen rate.

`NetLab(hosts, bandwidth)` gives N hosts that applications address by IP, so a
multi-peer training run can be exercised against a slow network on one box; `bandwidth` may give each host an
uplink of its own ("20mbit,20mbit,5mbit": the machines of a commodity cluster seldom have one).

Modes
-----
netns
    Root only. One Linux bridge ``{name}br`` plus, per host ``i``, a network
    namespace ``{name}-h{i}`` joined to the bridge by a veth pair (``eth0``
    inside, ``{name}-v{i}`` on the bridge) and addressed ``10.213.0.{i+1}/24``.
    The root namespace gets no address on the bridge (not even an IPv6
    link-local one), so lab traffic cannot be routed anywhere else. Each host's
    egress (its uplink) is capped with ``tc ... tbf``.
    With ``lans`` (groups of host indices, e.g. ``[[0, 1], [2, 3]]``), the hosts
    of group ``g`` also share an uncapped LAN: a second veth ``lan0`` on a bridge
    ``{name}lb{g}`` of their own, addressed ``10.214.{g}.{i+1}/24`` (`Host.lan_address`),
    the fast links between the machines of one rack. A LAN reaches no other
    LAN (no route, no forwarding); its hosts still reach everyone over eth0.
loopback
    No isolation: every host is ``127.0.0.1`` and the kernel enforces nothing.
    ``lab.app_shaping`` is True and applications are expected to pace their own
    sends at ``DECENTRAL_LINK_RATE_BPS``.
auto
    netns when running as root and a probe ``ip netns add``/``del`` succeeds,
    loopback otherwise.

Latency is never applied by the kernel (this kernel has no ``netem``): it only
reaches applications through ``DECENTRAL_LINK_LATENCY_MS`` and our own link
layer adds it.

Only one lab per name may exist at a time: opening one removes the leftovers of
any earlier lab with the same name (see `cleanup_stale`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import ipaddress
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from decentral.cpu import descendants

SUBNET = ipaddress.ip_network("10.213.0.0/24")
LAN_SUBNETS = ipaddress.ip_network("10.214.0.0/16")  # LAN g (of `lans`) is 10.214.g.0/24
MAX_HOSTS = 253  # .1 .. .253; .254 is left for a bridge address nobody gets
_BURST_FLOOR = 16 * 1024  # bytes
_TBF_LATENCY = "50ms"  # longest a packet may wait in the tbf queue before it is dropped
_KILL_GRACE_S = 1.0
RECV_SILENCE_S = 5.0  # a measured stream (`measure_throughput`) silent this long is over

_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(bit|bps)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


class NetLabError(RuntimeError):
    """A lab could not be set up or torn down; the message names the failing command."""


class LabSettingsError(NetLabError, ValueError):
    """A lab asked for with settings it cannot have: a rate, host count, LAN, name, mode or latency."""


MAX_RATE_BPS = 10**12  # 1tbit: a 10 ms token bucket (`tbf_burst_bytes`) above it exceeds tc's 32-bit burst


def parse_rate(text: str) -> int:
    """Parse a link rate such as "20mbit", "100Mbit", "512kbit" or "1gbit" into bits per second.

    Prefixes are decimal as in tc (k = 10^3, m = 10^6, g = 10^9, t = 10^12) and
    case-insensitive. Unlike tc, a "bps" suffix ("10mbps") also means *bits*
    per second, as in everyday networking use. A bare number has no unit and is
    rejected, as is anything below 8 bit/s, the least tc can shape (it counts bytes per second), or above
    MAX_RATE_BPS, beyond what its token bucket holds (LabSettingsError, a ValueError).
    """
    match = _RATE_RE.match(text) if isinstance(text, str) else None
    if match is None:
        raise LabSettingsError(f"not a link rate: {text!r} (expected e.g. '20mbit', '512kbit', '1gbit', '10mbps')")
    bps = round(float(match.group(1)) * _SCALE[match.group(2).lower()])
    if bps < 8:
        raise LabSettingsError(f"link rate must be at least 8 bit/s (tc shapes whole bytes per second), got {text!r}")
    if bps > MAX_RATE_BPS:
        raise LabSettingsError(f"link rate must be at most 1tbit (tc's token bucket holds no more), got {text!r}: "
                               "'none' leaves the links uncapped")
    return bps


def human_rate(bps: float) -> str:
    """`20e6` -> `20 Mbit/s`, `512e3` -> `512 kbit/s`, `8` -> `8 bit/s` (three significant digits)."""
    for scale, unit in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def rate_argument(text: str) -> str:
    """argparse type of a link rate that must be one (`--netlab RATE`): a `parse_rate` string."""
    try:
        parse_rate(text)
    except LabSettingsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


BANDWIDTH_HELP = ("uplink cap per host, in bits per second: 20mbit, 512kbit, 1gbit (20Mbps is 20 Mbit/s too, where tc "
                  "reads mbps as bytes), or 'none' (default: %(default)s)")
BANDWIDTHS_HELP = BANDWIDTH_HELP.replace(" (default", "; or one per host, comma-separated: 20mbit,20mbit,5mbit "
                                         "(default")
MODE_HELP = ("netns: a network namespace per host, uplinks capped by tc (root); loopback: every host on 127.0.0.1, "
             "the applications pace their own sends; auto: netns where root can (default)")
LAB_MODES = ("auto", "netns", "loopback")


def mode_note(mode: str | None) -> str:
    """What a result measured in lab mode `mode` (a run's config.mode) rests on, in a few words for its table."""
    return {"netns": "netns mode: every host's traffic capped by tc",
            "loopback": "loopback mode: only the swarm's own streams paced to the rate, each process alone; bytes are "
                        "what those streams counted"}.get(mode or "", f"lab mode {mode or 'not recorded'}")


def add_mode_argument(parser: argparse.ArgumentParser) -> None:
    """A command's `--mode` of its lab (default auto); netns refused when parsed where it cannot run."""
    parser.add_argument("--mode", type=_mode_argument, choices=LAB_MODES, default="auto", help=MODE_HELP)


def _mode_argument(text: str) -> str:
    if text == "netns" and (os.geteuid() != 0 or shutil.which("ip") is None):
        raise argparse.ArgumentTypeError("netns mode needs root and `ip` (iproute2): run as root, or give --mode "
                                         "loopback (or leave --mode out: auto runs loopback here)")
    return text


def bandwidth_argument(text: str) -> str | None:
    """argparse type of a `--bandwidth` of one rate for every host: a `parse_rate` string, or None for 'none'
    (uncapped links)."""
    if "," in text:
        raise argparse.ArgumentTypeError(f"one rate for every host here, got {text!r} (a rate per host: "
                                         "`decentral netlab`, `bench`, `bench fetch` and `bench soak`)")
    if text.strip().lower() == "none":
        return None
    try:
        return rate_argument(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}, or 'none' for uncapped links") from None


def bandwidths_argument(text: str) -> str | None:
    """argparse type of a `--bandwidth` that may give each host its own uplink: `bandwidth_argument`'s one rate,
    or a comma-separated rate (or 'none') per host ("20mbit,20mbit,5mbit"), checked against the host count by
    `parse_rates`."""
    if "," not in text:
        return bandwidth_argument(text)
    rates = [rate.strip() for rate in text.split(",")]
    for rate in rates:
        bandwidth_argument(rate)
    return ",".join(rates)


def parse_rates(bandwidth: str | None, hosts: int, what: str = "hosts") -> list[int | None]:
    """Each of `hosts` hosts' uplink in bits per second (None: uncapped) from a `bandwidths_argument` string:
    one rate for all, or one per host in host order (LabSettingsError for another count, naming them `what`)."""
    rates = [None if rate.strip().lower() == "none" else parse_rate(rate)
             for rate in ("none" if bandwidth is None else bandwidth).split(",")]
    if len(rates) == 1:
        return rates * hosts
    if len(rates) != hosts:
        raise LabSettingsError(f"bandwidth {bandwidth!r} gives {len(rates)} rates for {hosts} {what}: give one rate, "
                               "or one for each")
    return rates


def describe_rates(rates: list[int | None], prefix: str = "h", first: int = 0) -> str:
    """`[20e6] * 3 + [5e6]` -> "h0-h2 20 Mbit/s, h3 5 Mbit/s" (named `prefix` and a number from `first`); one rate
    for all -> "20 Mbit/s" (or "uncapped")."""
    shown = ["uncapped" if rate is None else human_rate(rate) for rate in rates]
    if len(set(shown)) == 1:
        return shown[0]
    runs: list[list] = []  # [first host, last host, rate] of consecutive hosts of one rate
    for i, rate in enumerate(shown):
        if runs and runs[-1][2] == rate:
            runs[-1][1] = i
        else:
            runs.append([i, i, rate])
    return ", ".join(f"{prefix}{first + a}{'' if a == b else f'-{prefix}{first + b}'} {rate}" for a, b, rate in runs)


def tbf_burst_bytes(rate_bps: int) -> int:
    """Token-bucket size for a cap: 10 ms of traffic at the rate, at least 16 KiB.

    tbf can only reach its rate if the bucket holds at least one timer tick of
    traffic (rate/HZ, and HZ may be as low as 100, hence 10 ms); the floor keeps
    slow caps from stalling on a run of full-size (or GSO) frames. Ten ms of
    burst is negligible against the multi-second transfers being shaped.
    """
    return max(rate_bps // 8 // 100, _BURST_FLOOR)


def _cmd(args: list[str]) -> str:
    """Run a system command (ip, tc); return its stdout or raise NetLabError with its stderr."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetLabError(f"`{' '.join(args)}` failed: {exc}") from exc
    if done.returncode != 0:
        raise NetLabError(f"`{' '.join(args)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _stale_names(name: str) -> tuple[list[str], list[str]]:
    """Namespaces and root-namespace links that belong to a lab called `name` (a probe of `netns_available` only
    when the process that made it is gone: a live one deletes its own)."""
    prefix = re.escape(name)
    ns_re = re.compile(rf"^{prefix}-(?:h\d+|(\d+)-probe)$")
    link_re = re.compile(rf"^({prefix}-[vl]\d+|{prefix}br|{prefix}lb\d+)$")
    namespaces = [line.split()[0] for line in _cmd(["ip", "netns", "list"]).splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in _cmd(["ip", "-o", "link", "show"]).splitlines()]
    ours = [(ns, found.group(1)) for ns in namespaces if (found := ns_re.match(ns))]
    return ([ns for ns, pid in ours if pid is None or not os.path.exists(f"/proc/{pid}")],
            [ln for ln in links if link_re.match(ln)])


def _netns_pids(namespace: str) -> list[int]:
    return [int(p) for p in _cmd(["ip", "netns", "pids", namespace]).split() if int(p) != os.getpid()]


def _kill_namespace_processes(namespaces: list[str]) -> None:
    """SIGTERM every process inside `namespaces`, then SIGKILL whatever outlives a short grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [pid for ns in namespaces for pid in _netns_pids(ns)]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _KILL_GRACE_S
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = [pid for ns in namespaces for pid in _netns_pids(ns)]
        if not pids:
            return


def cleanup_stale(name: str = "dcl") -> list[str]:
    """Remove every leftover of a lab called `name` and return what was removed.

    Kills the processes still inside its namespaces ``{name}-h*``, deletes the
    root ends of its veths ``{name}-v*`` and ``{name}-l*``, its bridges
    ``{name}br`` and ``{name}lb*``, the namespaces, and the probes ``{name}-PID-probe``
    of processes gone. Removes nothing else. Items that cannot be removed are tried all
    the same and reported together in one NetLabError afterwards.
    """
    namespaces, links = _stale_names(name)
    _kill_namespace_processes(namespaces)
    removed: list[str] = []
    errors: list[str] = []
    for kind, item, args in [("link", ln, ["ip", "link", "del", ln]) for ln in links] + [
        ("netns", ns, ["ip", "netns", "del", ns]) for ns in namespaces
    ]:
        try:
            _cmd(args)
            removed.append(f"{kind} {item}")
        except NetLabError as exc:
            errors.append(str(exc))
    if errors:
        raise NetLabError("cleanup of lab %r incomplete: %s" % (name, "; ".join(errors)))
    return removed


def netns_available(name: str = "dcl") -> bool:
    """True when running as root and a throw-away namespace ``{name}-{pid}-probe`` can be created and deleted
    (our process id in it: two processes that check at once, as two test processes do, would otherwise each
    find the other's probe there, or gone, and take namespaces for unavailable)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"{name}-{os.getpid()}-probe"
    try:
        _cmd(["ip", "netns", "add", probe])
    except NetLabError:
        return False
    try:
        _cmd(["ip", "netns", "del", probe])
    except NetLabError:
        return False
    return True


@dataclass
class Host:
    """One emulated host: `address` is where the others reach it; `namespace` is None in loopback mode;
    `rate_bps`: its uplink's cap in bits per second (None: uncapped); `lan_address`: its address on its LAN (the
    lab's `lans`), None when it is in none."""

    index: int
    address: str
    namespace: str | None
    env: dict[str, str] = field(repr=False)  # the DECENTRAL_* variables every process on this host gets
    rate_bps: int | None = None
    _procs: list[subprocess.Popen] = field(repr=False, default_factory=list)
    lan_address: str | None = None

    def popen(self, cmd: list[str], *, env: dict[str, str] | None = None, **popen_kwargs) -> subprocess.Popen:
        """Start `cmd` on this host (inside its namespace) and return the Popen.

        The child's environment is the current one, plus DECENTRAL_HOST_INDEX,
        DECENTRAL_HOST_ADDR, DECENTRAL_LINK_RATE_BPS (the cap in bits/s, empty
        when uncapped), DECENTRAL_LINK_LATENCY_MS and DECENTRAL_NETLAB_MODE,
        updated with `env` (which may set one of those for this process alone).
        The lab kills the process on teardown if it is still running.
        """
        full_env = {**os.environ, **self.env, **(env or {})}
        argv = list(cmd) if self.namespace is None else [shutil.which("ip") or "ip", "netns", "exec", self.namespace, *cmd]
        proc = subprocess.Popen(argv, env=full_env, **popen_kwargs)
        self._procs.append(proc)
        return proc

    def run(self, cmd: list[str], timeout: float = 60.0, *, env: dict[str, str] | None = None,
            **popen_kwargs) -> subprocess.CompletedProcess:
        """Run `cmd` on this host to completion, like `subprocess.run` (captures text output unless told otherwise).

        Raises subprocess.TimeoutExpired (after killing the process) when it runs past `timeout` seconds.
        """
        popen_kwargs.setdefault("stdout", subprocess.PIPE)
        popen_kwargs.setdefault("stderr", subprocess.PIPE)
        popen_kwargs.setdefault("text", True)
        with self.popen(cmd, env=env, **popen_kwargs) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class NetLab:
    """N emulated hosts behind capped uplinks; a context manager that always tears itself down.

    `bandwidth` is a `parse_rate` string or None for uncapped links, or a comma-separated rate (or 'none') per
    host (`parse_rates`; each host's is its `rate_bps`). `mode` is
    "auto", "netns" or "loopback" (see the module docstring); `lab.mode` says
    which one ran and a one-line notice on stderr says what it means.
    `name` prefixes every system object the lab creates (at most 10 chars).
    `lans`: groups of host indices that also share an uncapped LAN of their own
    (netns mode; in loopback mode a host's LAN address is 127.0.0.1 too).

    Teardown (kill the hosts' processes, delete namespaces, veths and bridges)
    runs on `close()` (idempotent), on leaving the `with` block, at interpreter
    exit, and on SIGINT/SIGTERM while the lab is open (handlers installed from
    the main thread only; the previous handler runs after cleanup, so Ctrl-C
    still raises KeyboardInterrupt). A set-up failure removes everything
    created so far before the NetLabError propagates.
    """

    def __init__(self, hosts: int, bandwidth: str | None = "20mbit", *, latency_ms: float = 0.0,
                 name: str = "dcl", mode: str = "auto", lans: list[list[int]] | None = None) -> None:
        if not 1 <= hosts <= MAX_HOSTS:
            raise LabSettingsError(f"hosts must be in 1..{MAX_HOSTS}, got {hosts}")
        self.lans = [list(group) for group in lans or []]
        members = [i for group in self.lans for i in group]
        if any(not isinstance(i, int) or not 0 <= i < hosts for i in members) or len(set(members)) != len(members):
            raise LabSettingsError(f"lans must be disjoint groups of host indices in 0..{hosts - 1}, got {lans}")
        if len(self.lans) > 256 or any(not group for group in self.lans):
            raise LabSettingsError(f"lans must be at most 256 non-empty groups, got {lans}")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", name) or len(f"{name}-v{hosts - 1}") > 15:
            raise LabSettingsError(f"lab name must be alphanumeric and short enough for '{name}-v{hosts - 1}' to fit 15 chars")
        if mode not in LAB_MODES:
            raise LabSettingsError(f"mode must be auto, netns or loopback, got {mode!r}")
        if latency_ms < 0:
            raise LabSettingsError(f"latency_ms must be >= 0, got {latency_ms}")
        self.name = name
        self.rates_bps = parse_rates(bandwidth, hosts)
        self.latency_ms = float(latency_ms)
        if mode == "auto":
            mode = "netns" if netns_available(name) else "loopback"
        elif mode == "netns" and os.geteuid() != 0:
            raise NetLabError("netns mode needs root (use mode='loopback' or 'auto')")
        self.mode = mode
        self.app_shaping = mode == "loopback" and any(rate is not None for rate in self.rates_bps)
        self.hosts: list[Host] = []
        self._closed = self._signalled = False
        self._prev_handlers: dict[int, object] = {}
        self._name_lock = None
        if mode == "netns":
            self._name_lock = _hold_lab_name(name)  # before anything of a lab of that name is removed
            try:
                self._setup_netns(hosts)
            except BaseException as exc:
                try:
                    cleanup_stale(name)
                except NetLabError as cleanup_exc:
                    exc.add_note(str(cleanup_exc))
                _release_lab_name(self._name_lock)
                raise
        else:
            self.hosts = [self._host(i, "127.0.0.1", None) for i in range(hosts)]
            for i in members:
                self.hosts[i].lan_address = "127.0.0.1"
        atexit.register(self.close)
        self._install_signal_handlers()
        print(self.notice(), file=sys.stderr, flush=True)

    def _host(self, index: int, address: str, namespace: str | None) -> Host:
        env = {
            "DECENTRAL_HOST_INDEX": str(index),
            "DECENTRAL_HOST_ADDR": address,
            "DECENTRAL_LINK_RATE_BPS": "" if self.rates_bps[index] is None else str(self.rates_bps[index]),
            "DECENTRAL_LINK_LATENCY_MS": f"{self.latency_ms:g}",
            "DECENTRAL_NETLAB_MODE": self.mode,
        }
        return Host(index, address, namespace, env, self.rates_bps[index])

    def _setup_netns(self, hosts: int) -> None:
        cleanup_stale(self.name)
        for line in _cmd(["ip", "-4", "-o", "addr", "show"]).splitlines():
            dev, inet = line.split()[1], line.split()[3]
            for subnet in [SUBNET] + [self._lan_subnet(g) for g in range(len(self.lans))]:
                if ipaddress.ip_interface(inet).network.overlaps(subnet):
                    raise NetLabError(f"{subnet} is already in use on this machine ({dev}: {inet}); netlab needs it free")
        bridge = f"{self.name}br"
        _cmd(["ip", "link", "add", bridge, "type", "bridge"])
        _cmd(["ip", "link", "set", bridge, "addrgenmode", "none"])
        _cmd(["ip", "link", "set", bridge, "up"])
        for i in range(hosts):
            ns, veth, address = f"{self.name}-h{i}", f"{self.name}-v{i}", str(SUBNET[i + 1])
            _cmd(["ip", "netns", "add", ns])
            _cmd(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _cmd(["ip", "link", "set", veth, "addrgenmode", "none"])
            _cmd(["ip", "link", "set", veth, "master", bridge])
            _cmd(["ip", "link", "set", veth, "up"])
            _cmd(["ip", "-n", ns, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0"])
            _cmd(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
            if (rate := self.rates_bps[i]) is not None:
                _cmd(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", f"{rate}bit",
                      "burst", str(tbf_burst_bytes(rate)), "latency", _TBF_LATENCY])
            self.hosts.append(self._host(i, address, ns))
        for g, group in enumerate(self.lans):
            self._setup_lan(g, group)

    @staticmethod
    def _lan_subnet(g: int) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"{LAN_SUBNETS[g * 256]}/24")

    def _setup_lan(self, g: int, group: list[int]) -> None:
        """LAN `g`: an uncapped bridge of its own and, in each host of `group`, a veth lan0 on it."""
        bridge, subnet = f"{self.name}lb{g}", self._lan_subnet(g)
        _cmd(["ip", "link", "add", bridge, "type", "bridge"])
        _cmd(["ip", "link", "set", bridge, "addrgenmode", "none"])
        _cmd(["ip", "link", "set", bridge, "up"])
        for i in group:
            host, veth, address = self.hosts[i], f"{self.name}-l{i}", str(subnet[i + 1])
            _cmd(["ip", "link", "add", veth, "type", "veth", "peer", "name", "lan0", "netns", host.namespace])
            _cmd(["ip", "link", "set", veth, "addrgenmode", "none"])
            _cmd(["ip", "link", "set", veth, "master", bridge])
            _cmd(["ip", "link", "set", veth, "up"])
            _cmd(["ip", "-n", host.namespace, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", "lan0"])
            _cmd(["ip", "-n", host.namespace, "link", "set", "lan0", "up"])
            host.lan_address = address

    def notice(self) -> str:
        """One line saying which mode ran and what it enforces."""
        cap = describe_rates(self.rates_bps)
        latency = f"latency {self.latency_ms:g} ms is only passed to apps (DECENTRAL_LINK_LATENCY_MS; no netem here)"
        if self.lans:
            latency += "; uncapped LANs " + ", ".join(
                "+".join(f"h{i}" for i in group) + (f" on {self._lan_subnet(g)}" if self.mode == "netns" else "")
                for g, group in enumerate(self.lans))
        if self.mode == "netns":
            uplinks = ("uncapped" if cap == "uncapped" else f"capped at {cap} by tc tbf"
                       if len(set(self.rates_bps)) == 1 else f"capped by tc tbf ({cap})")
            where = (f"host {self.hosts[0].address}" if len(self.hosts) == 1 else
                     f"hosts {self.hosts[0].address}..{self.hosts[-1].address}")
            return f"netlab: netns mode, {len(self.hosts)} {where} on bridge {self.name}br, uplinks {uplinks}; {latency}"
        shaping = ("NOT enforced by the kernel, apps must pace themselves (DECENTRAL_LINK_RATE_BPS)"
                   if self.app_shaping else "no isolation")
        where = "host on 127.0.0.1" if len(self.hosts) == 1 else "hosts all on 127.0.0.1"
        return f"netlab: loopback mode, {len(self.hosts)} {where}, bandwidth {cap}, {shaping}; {latency}"

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is signal.SIG_IGN:  # e.g. SIGINT in a background job: keep ignoring it
                continue
            self._prev_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        previous = self._prev_handlers.get(signum, signal.SIG_DFL)
        self._signalled = True  # the signal that closes the lab is handed on below; a second one is dropped
        self.close()
        if callable(previous):
            previous(signum, frame)  # default SIGINT handler: raises KeyboardInterrupt
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def close(self) -> None:
        """Tear the lab down: kill the hosts' processes and remove every system object. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        # A second Ctrl-C (or a SIGINT sent to the child and then its group, as `timeout` does) must not
        # cut the teardown short and leave namespaces behind: hold such signals until it is done.
        held: list[int] = []
        ours = [sig for sig in self._prev_handlers if signal.getsignal(sig) == self._on_signal]
        for sig in ours:
            signal.signal(sig, lambda signum, frame: held.append(signum))
        try:
            self._teardown()
        finally:
            for sig in ours:
                signal.signal(sig, self._prev_handlers[sig])
            if held and not self._signalled:  # a signal during an ordinary close: deliver it now
                signal.raise_signal(held[0])

    def _teardown(self) -> None:
        procs = [proc for host in self.hosts for proc in host._procs]
        # What they started (a worker's DHT process and its libp2p daemon): once their parent is killed they
        # would live on, orphaned, until they notice (netns mode kills whatever is left in the namespaces).
        started = {child for proc in procs if not _exited(proc) for child in descendants(proc.pid)}
        # Never Popen.wait() here: close() also runs from the signal handler, which may have interrupted a
        # wait() on one of these processes in the main thread, whose lock a second wait() would block on forever
        # (Ctrl-C on `netlab -- CMD` hung so). poll() and waitid(WNOWAIT) never block.
        for stop in (subprocess.Popen.terminate, subprocess.Popen.kill):
            for proc in procs:
                if not _exited(proc):
                    stop(proc)
            deadline = time.monotonic() + _KILL_GRACE_S
            while any(not _exited(proc) for proc in procs) and time.monotonic() < deadline:
                time.sleep(0.05)  # the signalled processes exiting (after SIGKILL: milliseconds)
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + _KILL_GRACE_S
        while any(map(_running, started)) and time.monotonic() < deadline:
            time.sleep(0.05)  # (SIGKILL takes effect once the process is scheduled again)
        if self.mode == "netns":
            try:
                cleanup_stale(self.name)
            finally:
                _release_lab_name(self._name_lock)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _running(pid: int) -> bool:
    """Whether process `pid` is alive: not gone, nor a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _hold_lab_name(name: str):
    """The open lock file of lab name `name`, locked (flock) while this process's lab of that name runs: a second
    lab of the name is refused (its set-up would remove the first's namespaces and kill its processes, as
    what a crashed lab left). Released by `_release_lab_name`, or when the process ends, however it ends."""
    path = os.path.join(tempfile.gettempdir(), f"decentral-netlab-{name}.lock")
    while True:
        lock = open(path, "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise NetLabError(f"a lab named {name!r} is running on this machine (another `decentral netlab`, or a "
                              "bench: each kind of bench names its lab itself, so two of a kind cannot run at once): "
                              "wait for it to end (`netlab --name` and `bench islands --lab-name` name a lab "
                              "otherwise)") from None
        held = os.fstat(lock.fileno())
        with contextlib.suppress(FileNotFoundError):
            there = os.stat(path)
            if (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino):
                return lock
        lock.close()  # its last holder removed it as we locked it: lock the file at the path now


def _release_lab_name(lock) -> None:
    """Remove a lab name's lock file (while it is locked: a lab that opened it meanwhile sees it gone and takes the
    path anew), then release it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock.name)
    lock.close()


def _exited(proc: subprocess.Popen) -> bool:
    """Whether `proc` has exited, without blocking and without reaping it behind a wait() in progress."""
    if proc.poll() is not None:
        return True
    try:  # poll() says "running" while another frame holds the Popen's wait lock: ask the kernel, reaping nothing
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """Next stdout line of `proc` (text mode, line-buffered), or "" if none arrives within `timeout`."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


def measure_throughput(lab: NetLab, src: int, dst: int, seconds: float = 3.0, *, lan: bool = False) -> float:
    """Stream TCP bytes from host `src` to host `dst` for `seconds`; return the goodput in bits/s seen by dst
    (to dst's LAN address with `lan`: over their uncapped LAN).

    A receiver (``python -m decentral.netlab _recv``) runs on dst, on a port the system gives it (a fixed one
    collided with another measurement, or anything else there), and times the stream from its first byte for
    `seconds`; a sender runs on src. In loopback
    mode with a cap the sender paces itself at the cap (app shaping). Every
    step has a hard timeout; both processes are gone when this returns.
    """
    src_host, dst_host = lab.hosts[src], lab.hosts[dst]
    address = dst_host.lan_address if lan else dst_host.address
    if address is None:
        raise ValueError(f"h{dst} is on no LAN")
    helper = [sys.executable, "-m", "decentral.netlab"]
    pace = (src_host.rate_bps or 0) if lab.app_shaping and not lan else 0
    recv = dst_host.popen([*helper, "_recv", address, str(seconds)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    send = None
    try:
        ready, _, port = _read_line(recv, 10.0).strip().partition(" ")
        if ready != "ready":
            said = recv.stderr.read().strip().splitlines() if recv.poll() is not None else []
            raise NetLabError(f"receiver on h{dst} did not start: {said[-1] if said else 'no word within 10 s'}")
        send = src_host.popen([*helper, "_send", address, str(port), str(seconds + 10), str(pace)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out, err = recv.communicate(timeout=seconds + 15)
        if recv.returncode != 0:
            said = err.strip().splitlines()
            raise NetLabError(f"receiver on h{dst} failed (exit {recv.returncode}): {said[-1] if said else 'no word'}")
        result = json.loads(out)
        return result["bytes"] * 8 / result["seconds"]
    finally:
        for proc in (recv, send):
            if proc is not None:
                _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Kill `proc` if it still runs, reap it and close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _recv_main(address: str, seconds: float) -> None:
    """Receiver: say `ready PORT` (a free one), accept one stream, time it from its first byte for `seconds`, print
    {"bytes", "seconds"}.
    A stream silent for RECV_SILENCE_S ends the measurement, its silence counted (a cap too low to carry
    a packet in that time measures as about 0)."""
    with socket.create_server((address, 0)) as server:
        server.settimeout(10.0)
        print(f"ready {server.getsockname()[1]}", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(RECV_SILENCE_S)
            start = last = time.monotonic()
            total = 0
            try:
                conn.recv(1 << 16)  # the first chunk only starts the clock
                start = last = time.monotonic()
                while last - start < seconds:
                    chunk = conn.recv(1 << 16)
                    if not chunk:
                        break
                    total += len(chunk)
                    last = time.monotonic()
            except TimeoutError:
                last = time.monotonic()
    print(json.dumps({"bytes": total, "seconds": max(last - start, 1e-9)}), flush=True)


def _send_main(address: str, port: int, max_seconds: float, pace_bps: int) -> None:
    """Sender: stream zeros until the receiver hangs up or `max_seconds` pass; pace at `pace_bps` if non-zero."""
    deadline = time.monotonic() + max_seconds
    while True:
        try:
            sock = socket.create_connection((address, port), timeout=5.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    # A small send buffer keeps little in flight once the receiver stops listening.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 * 1024)
    block = bytes(1 << 16)
    start, sent = time.monotonic(), 0
    with sock:
        try:
            while time.monotonic() < deadline:
                sent += sock.send(block)
                if pace_bps:
                    time.sleep(max(0.0, start + sent * 8 / pace_bps - time.monotonic()))
        except OSError:  # receiver closed: the measurement is over
            pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `decentral netlab`."""
    from decentral.cli import number_type

    parser.add_argument("--hosts", type=int, default=2, help="number of emulated hosts")
    parser.add_argument("--bandwidth", type=bandwidths_argument, default="20mbit", help=BANDWIDTHS_HELP)
    parser.add_argument("--latency-ms", type=number_type(float, 0), default=0.0,
                        help="link latency passed to apps (not kernel-enforced)")
    add_mode_argument(parser)
    parser.add_argument("--name", default="dcl", help="prefix of the namespaces, veths and bridge")
    parser.add_argument("--measure", action="store_true", help="measure host0 -> host1 throughput against the cap")
    parser.add_argument("--seconds", type=number_type(float, 0, strict=True), default=3.0, help="duration of --measure")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- CMD ...: run in every host; {i}, {addr} and {addr0} are replaced per host")


def _substitute(cmd: list[str], host: Host, lab: NetLab) -> list[str]:
    values = {"{i}": str(host.index), "{addr}": host.address, "{addr0}": lab.hosts[0].address}
    out = []
    for arg in cmd:
        for key, value in values.items():
            arg = arg.replace(key, value)
        out.append(arg)
    return out


def _run_everywhere(lab: NetLab, cmd: list[str]) -> int:
    """Run `cmd` on every host at once, stream output as "[h{i}] ...", return 0 if all succeeded."""
    lock = threading.Lock()

    def pump(index: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            with lock:
                print(f"[h{index}] {line}", end="" if line.endswith("\n") else "\n", flush=True)

    procs = [host.popen(_substitute(cmd, host, lab), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, bufsize=1) for host in lab.hosts]
    pumps = [threading.Thread(target=pump, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for thread in pumps:
        thread.start()
    codes = [proc.wait() for proc in procs]
    for thread in pumps:
        thread.join()
    failed = [(i, code) for i, code in enumerate(codes) if code != 0]
    for i, code in failed:
        print(f"netlab: h{i} exited with {code}", file=sys.stderr)
    return 1 if failed else 0


def main(args: argparse.Namespace) -> int:
    """`decentral netlab`: open a lab, optionally measure it and/or run a command on every host, tear down."""
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.measure and args.hosts < 2:
        raise LabSettingsError("--measure needs at least 2 hosts")
    try:
        with NetLab(args.hosts, args.bandwidth, latency_ms=args.latency_ms, name=args.name, mode=args.mode) as lab:
            for host in lab.hosts:
                print(f"h{host.index} {host.address} {host.namespace or '-'}")
            status = 0
            if args.measure:
                rate = measure_throughput(lab, 0, 1, seconds=args.seconds)
                cap_bps = lab.hosts[0].rate_bps
                cap = "uncapped" if cap_bps is None else f"cap {human_rate(cap_bps)} ({rate / cap_bps:.0%})"
                paced = " (loopback mode: the sender's own pacing, not a kernel's cap)" if lab.app_shaping else ""
                print(f"h0 -> h1: {human_rate(rate)}, {cap}{paced}", flush=True)
            if cmd:
                status = _run_everywhere(lab, cmd)
            elif not args.measure:
                print("netlab: the lab was set up and is torn down; give --measure to measure a link, or -- CMD to "
                      "run a command on every host", file=sys.stderr, flush=True)
            return status
    except KeyboardInterrupt:
        print("netlab: interrupted; the lab is torn down", file=sys.stderr, flush=True)
        return 130


def _helper_main(argv: list[str]) -> int:
    """Entry of `python -m decentral.netlab _recv|_send ...` (the halves of `measure_throughput`)."""
    if argv[:1] == ["_recv"] and len(argv) == 3:
        _recv_main(argv[1], float(argv[2]))
        return 0
    if argv[:1] == ["_send"] and len(argv) == 5:
        _send_main(argv[1], int(argv[2]), float(argv[3]), int(argv[4]))
        return 0
    print("usage: python -m decentral.netlab _recv ADDR PORT SECONDS | _send ADDR PORT MAX_SECONDS PACE_BPS",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_helper_main(sys.argv[1:]))
