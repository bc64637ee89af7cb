"""`decentral bench dht` on real peers: every kind of DHT call costs bytes, and a faster heartbeat costs more."""

import json
import sys

import pytest
from conftest import NETNS, refused_by_name


@pytest.mark.solo
def test_dht_bench_counts_each_call_and_the_idle_cost_of_a_heartbeat(tmp_path, prefork, lab_name):
    """In a network namespace of its own where it can have one: what else runs here sends on loopback too."""
    out = tmp_path / "dht"
    bench = ["bench", "dht", "--peers", "2", "--calls", "2", "--heartbeats", "0.25,5", "--seconds", "2",
             "--out", str(out)]
    if NETNS:
        bench = ["netlab", "--hosts", "1", "--bandwidth", "none", "--name", lab_name, "--mode", "netns", "--",
                 sys.executable, "-m", "decentral", *bench]
    done = prefork.run(bench, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    assert set(results["per_call"]) == {"heartbeat write", "peers lookup", "round announcement", "round lookup"}
    assert all(cost > 0 for cost in results["per_call"].values()), results
    fast, slow = (b["bytes_per_s"] for b in results["idle"])
    assert fast > 2 * slow, results["idle"]  # 20 times the beats
    assert (out / "dht.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "KiB per call" in done.stdout


def test_dht_bench_refuses_each_bad_argument_by_name(tmp_path, capsys):
    refused_by_name(capsys, ["bench", "dht"], (
        (["--peers", "1"], "--peers: must be at least 2"), (["--calls", "0"], "--calls: must be at "),
        (["--seconds", "0"], "--seconds: must be above 0"), (["--heartbeats", "2,,5"], "--heartbeats: not a number: ''"),
        (["--heartbeats", "2,-1"], "--heartbeats: must be above 0, got -1")), tmp_path / "dht")
    assert not (tmp_path / "dht").exists()
