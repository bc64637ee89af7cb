"""`decentral bench fetch` with real publisher processes: each count of publishers timed, the expert hash checked."""

import json

import pytest

from conftest import NETNS, refused_by_name
from decentral.cli import main


def test_fetch_bench_times_a_fetch_from_each_count_of_publishers(tmp_path, prefork, lab_name):
    """On netlab hosts: network namespaces where this machine has them, else loopback."""
    out = tmp_path / "fetch"
    lab = ["--mode", "netns", "--lab-name", lab_name] if NETNS else ["--mode", "loopback"]
    done = prefork.run(["bench", "fetch", "--publishers", "2", "--size-mib", "0.5", "--bandwidth", "400mbit,200mbit",
                        "--repeats", "2", *lab, "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["mode"] == ("netns" if NETNS else "loopback")
    assert [row["publishers"] for row in results["rows"]] == [1, 2]
    assert all(len(row["seconds"]) == 2 and row["median_s"] > 0 for row in results["rows"]), results
    # each publisher's uplink its own: the first one's time for the bytes, then the two's together
    assert [row["link_bound_s"] for row in results["rows"]] == pytest.approx(
        [results["bytes"] * 8 / 400e6, results["bytes"] * 8 / 600e6])
    assert results["config"]["uplinks"] == "p1 400 Mbit/s, p2 200 Mbit/s"
    assert results["rows"][0]["speedup"] == 1.0 and results["bytes"] > 2**20  # one layer, the least it makes
    assert (out / "fetch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "s per fetch" in done.stdout
    assert not (out / "fetched" / "bench").exists(), "each fetched copy is removed once timed"
    assert "MiB from 2 publisher(s), 2 fetches ..." in done.stdout


def test_fetch_bench_refuses_each_bad_argument_by_name(tmp_path, capsys):
    refused_by_name(capsys, ["bench", "fetch"], (
        (["--publishers", "0"], "--publishers: must be at least 1"),
        (["--bandwidth", "fast"], "--bandwidth: not a link rate: 'fast'"),
        (["--size-mib", "0"], "--size-mib: must be above 0"), (["--repeats", "0"], "--repeats: must be at least 1")),
        tmp_path / "fetch")
    assert main(["bench", "fetch", "--bandwidth", "8mbit,1mbit", "--out", str(tmp_path / "fetch")]) == 2
    assert "'8mbit,1mbit' gives 2 rates for 4 publishers: give one rate, or one for each" in capsys.readouterr().err
    assert not (tmp_path / "fetch").exists()
