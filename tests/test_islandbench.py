"""decentral.islandbench (`decentral bench islands`) and the netlab LANs its part B runs on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import needs_netns, refused_by_name
from decentral import islandbench
from decentral.codec import make_codec
from decentral.netlab import NetLab, cleanup_stale, measure_throughput


# connect to ADDR:PORT where nothing listens: a reachable host refuses (errno 111), an address without a
# route is unreachable at once (101), one routed to a link where nobody answers its ARP after 3 s (113)
CONNECT = ("import socket, sys\n"
           "try:\n"
           "    socket.create_connection((sys.argv[1], 9), timeout=5)\n"
           "except OSError as e:\n"
           "    print(e.errno)")


def connect_errno(lab: NetLab, src: int, address: str) -> int:
    return int(lab.hosts[src].run([sys.executable, "-c", CONNECT, address], timeout=30).stdout)


@needs_netns
def test_lans_are_uncapped_and_isolated_from_each_other(lab_name):
    with NetLab(3, "20mbit", name=lab_name, mode="netns", lans=[[0, 1], [2]]) as lab:
        h0, h1, h2 = lab.hosts
        assert (h0.lan_address, h1.lan_address, h2.lan_address) == ("10.214.0.1", "10.214.0.2", "10.214.1.3")
        assert connect_errno(lab, 0, h1.lan_address) == 111  # same LAN: h1 answers
        assert connect_errno(lab, 0, h2.lan_address) == 101  # another LAN: no route to it
        assert connect_errno(lab, 2, h0.lan_address) == 101
        assert connect_errno(lab, 0, h2.address) == 111  # the WAN still reaches everyone
        h0.run(["ip", "route", "add", "10.214.1.0/24", "dev", "lan0"], timeout=30)
        assert connect_errno(lab, 0, h2.lan_address) == 113  # even routed there: h2 is not on h0's LAN (no ARP answer)
        lan = measure_throughput(lab, 0, 1, seconds=1.0, lan=True)
        assert lan > 3 * lab.hosts[0].rate_bps, f"LAN {lan / 1e6:.0f} Mbit/s: capped like the 20 Mbit/s uplink?"
        removed = cleanup_stale(lab_name)  # as after a crash: the LANs' bridges and veths go too
    assert {f"link {lab_name}lb0", f"link {lab_name}lb1", f"link {lab_name}-l0", f"link {lab_name}-l2"} <= set(removed)
    assert cleanup_stale(lab_name) == []


def test_lans_in_loopback_mode_and_bad_lans():
    with NetLab(3, None, mode="loopback", name="tlb", lans=[[0, 1]]) as lab:
        assert [h.lan_address for h in lab.hosts] == ["127.0.0.1", "127.0.0.1", None]
    for bad in ([[0, 1], [1, 2]], [[0, 3]], [[]]):
        with pytest.raises(ValueError, match="lans"):
            NetLab(3, None, mode="loopback", name="tlb", lans=bad)


def test_part_a_runs_the_same_processes_flat_and_as_islands():
    with NetLab(2, "20mbit", mode="loopback", name="tla") as lab:
        recipe, out = Path("r.yaml"), Path("o")
        flat = [islandbench._a_launch("flat", lab, recipe, out, [], i, ["/boot"]) for i in range(4)]
        islands = [islandbench._a_launch("hierarchical", lab, recipe, out, [], i, ["/boot"]) for i in range(2)]
    assert [launch.host.index for launch in flat] == [0, 0, 1, 1]
    # loopback: a process paces itself, so a host's two flat members take half its uplink each (each had all of it)
    assert all(launch.env == {"DECENTRAL_LINK_RATE_BPS": "10000000"} for launch in flat)
    assert all(launch.cmd[launch.cmd.index("--num-workers") + 1] == "4" for launch in flat)
    assert all("--island-size" not in launch.cmd for launch in flat)
    for index, launch in enumerate(islands):
        cmd = launch.cmd
        assert launch.host.index == index and launch.env == {"GLOO_SOCKET_IFNAME": "lo"}
        assert cmd[cmd.index("--island-size") + 1] == "2" and cmd[cmd.index("--num-workers") + 1] == "2"
        assert cmd[cmd.index("--worker-index") + 1] == str(index) and cmd[cmd.index("--min-peers") + 1] == "2"
        assert cmd[cmd.index("--host") + 1] == launch.host.address
    assert "--maddr-file" in islands[0].cmd and "--join" in islands[1].cmd


def test_sharded_is_compared_with_the_leader_of_the_same_k():
    points = [{"k": 2, "mode": "leader", "ok": True, "sync_s": 1.0, "rank0_wan_bytes": 1000},
              {"k": 2, "mode": "sharded", "ok": True, "sync_s": 0.6, "mean_rank_wan_bytes": 520,
               "max_rank_wan_bytes": 540},
              {"k": 4, "mode": "sharded", "ok": True, "sync_s": 0.3, "mean_rank_wan_bytes": 250,
               "max_rank_wan_bytes": 260}]
    islandbench.compare_sync(points)
    assert points[1]["sync_ratio"] == pytest.approx(0.6) and points[1]["sync_target"] == pytest.approx(0.6)
    assert points[1]["wan_ratio"] == pytest.approx(0.52) and points[1]["wan_target"] == 0.5
    assert "sync_ratio" not in points[2]  # no leader run for k=4: nothing to compare with


@needs_netns
@pytest.mark.solo
def test_sharded_ranks_each_send_less_over_their_wan_than_the_leader(tmp_path, lab_name, prefork):
    """Part B, tiny: 2 islands of 2 ranks, each rank its own 50 Mbit/s uplink, the island's ranks on a LAN."""
    out = tmp_path / "islands"
    done = prefork.run(["bench", "islands", "--parts", "b", "--ks", "2", "--numel", "200000", "--rounds", "2",
                        "--bandwidth", "50mbit", "--mode", "netns", "--timeout", "120", "--lab-name", lab_name,
                        "--out", str(out)], tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    points = {p["mode"]: p for p in json.loads((out / "results.json").read_text())["b"]["points"]}
    leader, sharded = points["leader"], points["sharded"]
    assert leader["incomplete"] == sharded["incomplete"] == 0
    assert leader["connections"] == 1 and sharded["connections"] == 2
    r0 = leader["rank0_wan_bytes"]
    codec = json.loads((out / "results.json").read_text())["b"]["config"]["codec"]  # the DiLoCo recipe's
    assert r0 > make_codec(codec).size(200_000) * 0.9  # a pair average sends the whole tensor once
    assert max(leader["wan_bytes_per_round"][1::2]) < 0.05 * r0  # leader mode: rank 1 keeps off the WAN
    assert sharded["max_rank_wan_bytes"] < 0.8 * r0 and sharded["wan_ratio"] < 0.8
    assert (out / "islands.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wan_vs_leader_r0" in done.stdout


def test_bad_arguments_and_data_are_refused_before_any_lab_opens(tmp_path, capsys):
    """An empty or non-positive --ks (it ran and died with a KeyError), --rounds below 2 (its median of no
    round), a run time of 0: usage errors; a --data that does not exist: one line, before part A trains."""
    from decentral.cli import main as cli_main

    out = tmp_path / "out"
    refused_by_name(capsys, ["bench", "islands"], (
        (["--ks", ","], "--ks: not comma-separated integers"), (["--ks", "2,0"], "at least 1 rank"),
        (["--rounds", "1"], "--rounds: 1: at least 2"), (["--timeout", "0"], "--timeout: must be above 0"),
        (["--steps", "0"], "--steps: must be at least 1")), out)
    code = cli_main(["bench", "islands", "--parts", "a", "--data", str(tmp_path / "missing"), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "corpus path does not exist" in err and len(err.strip().splitlines()) == 1, err
    assert cli_main(["bench", "islands", "--parts", "a", "--steps", "10", "--out", str(out)]) == 2  # averages nothing
    assert capsys.readouterr().err.startswith("islands: --steps 10 is less than one DiLoCo round (every ")
    assert not out.exists()
