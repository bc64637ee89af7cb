"""Network files for the SkipPipe planner: parsing, errors that name the field, the synthetic generator."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from decentral.pipeline.network import SHAPE_KEYS, NetworkError, load_network, parse_network, regions_network

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "networks"


def small(**changes) -> dict:
    data = {"stages": 2, "skip": 0, "microbatches": 4, "activation_bytes": 1_000_000,
            "nodes": [{"name": f"n{i}", "compute_ms": 100} for i in range(4)],
            "default_link": {"latency_ms": 10, "bandwidth_mbps": 100}}
    data.update(changes)
    return data


def test_links_defaults_and_directions():
    network = parse_network(small(links=[{"from": "n0", "to": "n1", "latency_ms": 1, "bandwidth_mbps": 1000},
                                         {"from": "n2", "to": "n3", "latency_ms": 2, "bandwidth_mbps": 800,
                                          "both_ways": True}]))
    # 1 MB = 8 Mb: 8 ms at 1000 Mb/s, 10 ms at 800, 80 ms at 100
    assert network.transfer_ms[0, 1] == pytest.approx(1 + 8)
    assert network.transfer_ms[1, 0] == pytest.approx(10 + 80)  # one direction only: the other takes the default
    assert network.transfer_ms[2, 3] == network.transfer_ms[3, 2] == pytest.approx(2 + 10)
    assert network.transfer_ms[0, 0] == 0
    assert [node.memory for node in network.nodes] == [3, 3, 3, 3]


@pytest.mark.parametrize("change, message", [
    ({"nodes": [{"name": "a", "compute_ms": 1}, {"name": "b", "compute_ms": 1}, {"name": "c", "compute_ms": 1},
                {"name": "d", "compute_ms": -1}]}, "net.json: nodes[3].compute_ms must be a positive number, got -1"),
    ({"nodes": [{"name": "a", "compute_ms": 1, "memory": 0}]}, "nodes[0].memory must be a positive integer, got 0"),
    ({"nodes": [{"name": "a", "compute_ms": 1, "stage": 2}]},
     "nodes[0] ('a') is pinned to stage 2, but the pipeline has 2 stages (0 to 1)"),
    ({"nodes": [{"name": "a", "compute_ms": 1, "stage": -1}]}, "nodes[0].stage must be an integer >= 0, got -1"),
    ({"skip": None, "activation_bytes": None}, "skip, activation_bytes missing: the training shape"),
    ({"nodes": [{"name": "a", "compute_ms": 1}, {"name": "a", "compute_ms": 2}]},
     "nodes[1].name 'a' is already used by nodes[0]"),
    ({"nodes": [{"name": "a", "compute_ms": 1, "speed": 2}]}, "nodes[0]: unknown field 'speed'"),
    ({"nodes": []}, "nodes must be a non-empty list, got an empty one"),
    ({"nodes": [{"name": "a"}]}, "nodes[0].compute_ms must be a positive number, got nothing"),  # missing, not None
    ({"stages": 1}, "stages must be an integer >= 2, got 1"),
    ({"skip": 1.0}, "skip must be a number in [0, 1), got 1.0"),
    ({"microbatches": "8"}, "microbatches must be a positive integer, got '8'"),
    ({"default_link": {"latency_ms": 1, "bandwidth_mbps": 0}}, "default_link.bandwidth_mbps must be a positive number"),
    ({"links": [{"from": "n0", "to": "zz", "latency_ms": 1, "bandwidth_mbps": 1}]},
     "links[0].to must name a node, got 'zz'"),
    ({"links": [{"from": ["n0"], "to": "n1", "latency_ms": 1, "bandwidth_mbps": 1}]},  # (a TypeError traceback)
     "links[0].from must name a node"),
    ({"nodes": [{"name": "a", "compute_ms": 10 ** 400}]}, "nodes[0].compute_ms must be a positive number"),  # Overflow
    ({"links": [{"from": "n0", "to": "n1", "latency_ms": -3, "bandwidth_mbps": 1}]},
     "links[0].latency_ms must be a number >= 0, got -3"),
    ({"default_link": None}, "no link from 'n0' to 'n1' and no default_link"),
    ({"stagez": 3}, "unknown field 'stagez'"),
])
def test_errors_name_the_field(tmp_path, change, message):
    path = tmp_path / "net.json"
    path.write_text(json.dumps(small(**change)))
    with pytest.raises(NetworkError, match=re.escape(message)):
        load_network(path)


def test_a_shape_the_command_gives_replaces_the_files_and_need_not_be_in_it(tmp_path):
    path = tmp_path / "net.json"
    path.write_text(json.dumps({key: value for key, value in small().items() if key not in SHAPE_KEYS}))
    shape = {"stages": 3, "skip": 0.5, "microbatches": 5, "activation_bytes": 7}
    network = load_network(path, shape)
    assert {key: getattr(network, key) for key in SHAPE_KEYS} == shape
    path.write_text(json.dumps(small()))
    assert load_network(path, {**shape, "skip": None}).skip == small()["skip"]  # None keeps the file's
    assert load_network(path, shape).microbatches == 5


def test_unreadable_files(tmp_path):
    with pytest.raises(NetworkError, match="no such file"):
        load_network(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"stages": 2,\n "nodes": [}')
    with pytest.raises(NetworkError, match=r"broken.json: not valid JSON \(line 2"):
        load_network(broken)


def test_examples_load():
    two_sites = load_network(EXAMPLES / "two_sites.json")
    assert (len(two_sites), two_sites.stages, two_sites.skip) == (7, 4, 0.25)
    regions = load_network(EXAMPLES / "regions20.json")
    assert len(regions) == 20 and regions.stages == 6


def test_regions_network_links():
    network = regions_network(nodes=20, regions=5, seed=3)
    region = np.array([node.region for node in network.nodes])
    same = (region[:, None] == region[None, :]) & ~np.eye(20, dtype=bool)
    across = region[:, None] != region[None, :]
    assert len(set(region)) == 5
    assert np.all((network.latency_ms[same] >= 0.9) & (network.latency_ms[same] <= 1.1))
    assert np.all((network.bandwidth_mbps[same] >= 1800) & (network.bandwidth_mbps[same] <= 2200))
    assert np.all((network.latency_ms[across] >= 4.5) & (network.latency_ms[across] <= 130 * 1.1))
    assert np.all(network.bandwidth_mbps[across] >= 75 * 0.9)
    speeds = [node.compute_ms for node in network.nodes]
    assert min(speeds) >= 1760 * 0.7 and max(speeds) <= 1760 * 1.5 and len(set(speeds)) == 20


def test_saved_network_reads_back(tmp_path):
    network = regions_network(nodes=6, regions=2, seed=1)
    again = load_network(network.save(tmp_path / "six.json"))
    assert [n.name for n in again.nodes] == [n.name for n in network.nodes]
    np.testing.assert_allclose(again.transfer_ms, network.transfer_ms, rtol=1e-3)


def test_without_and_replace():
    network = parse_network(small())
    fewer = network.without(["n1"])
    assert [n.name for n in fewer.nodes] == ["n0", "n2", "n3"] and fewer.transfer_ms.shape == (3, 3)
    assert network.replace(stages=3, skip=None).stages == 3
    with pytest.raises(NetworkError, match="skip must be"):
        network.replace(skip=-0.1)
    with pytest.raises(NetworkError, match="no node named 'zz'"):
        network.without(["zz"])


def test_a_runs_network_file_may_leave_the_shape_to_its_recipe(tmp_path):
    from decentral.pipeline.launch import node_network
    from decentral.pipeline.recipe import SHIPPED_RECIPE, load_pipeline_recipe, network_shape

    recipe = load_pipeline_recipe(SHIPPED_RECIPE)
    path = tmp_path / "net.json"
    path.write_text(json.dumps({"nodes": [{"name": f"n{i}", "compute_ms": 100} for i in range(recipe.pipeline.stages)],
                                "default_link": {"latency_ms": 10, "bandwidth_mbps": 100}}))
    network = node_network(recipe, path)
    assert {key: getattr(network, key) for key in SHAPE_KEYS} == network_shape(recipe)
