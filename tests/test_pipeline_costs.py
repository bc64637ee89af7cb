"""The cost model's measured parts: backward and loss factors, and uplinks shared by a node's messages."""

from __future__ import annotations

import pytest

from decentral.pipeline.network import NetworkError, parse_network
from decentral.pipeline.simulator import simulate


def network(**extra):
    nodes = extra.pop("nodes", [{"name": "h", "compute_ms": 10}, {"name": "a", "compute_ms": 10}])
    return parse_network({"stages": 2, "skip": 0, "microbatches": 1, "activation_bytes": 5000,
                          "nodes": nodes, "default_link": {"latency_ms": 1, "bandwidth_mbps": 10}, **extra})


def test_measured_factors_set_the_backward_and_the_loss():
    # forward h 0-10, 4 ms on the link + 1 ms latency, forward a 15-25, back 25-30, loss 30-35 (0.5 x 10),
    # gradients 35-40, backward a 40-60 (2 x 10), gradients 60-65, backward h 65-85
    timeline = simulate(network(backward_factor=2.0, loss_factor=0.5), [(0, 1)])
    assert timeline.makespan_ms == pytest.approx(85.0)
    assert [(t.kind, t.start, t.end) for t in timeline.tasks if t.node == 0] == [
        ("forward", 0, 10), ("loss", 30, 35), ("backward", 65, 85)]
    assert simulate(network(), [(0, 1)]).makespan_ms == pytest.approx(10 + 5 + 10 + 5 + 2.5 + 5 + 15 + 5 + 15)
    again = parse_network(network(backward_factor=2.0, loss_factor=0.5).without([]).to_json())
    assert (again.backward_factor, again.loss_factor) == (2.0, 0.5)
    assert network(backward_factor=2.0).replace(microbatches=4).backward_factor == 2.0
    with pytest.raises(NetworkError, match="loss_factor must be a number >= 0"):
        network(loss_factor="fast")


def test_an_uplink_sends_one_message_at_a_time_whatever_the_destination():
    nodes = [{"name": "h", "compute_ms": 10}, {"name": "a", "compute_ms": 10, "stage": 1},
             {"name": "b", "compute_ms": 10, "stage": 1}]
    paths = [(0, 1), (0, 2)]  # the head sends to a, then to b, while its first message is still on the wire

    def arrivals(net):
        return [(t.target, t.start, t.end) for t in simulate(net, paths).transfers if t.source == 0][:2]

    slow = {"default_link": {"latency_ms": 1, "bandwidth_mbps": 1}}  # 40 ms per message
    assert arrivals(network(nodes=nodes, microbatches=2, **slow)) == [(1, 10, 51), (2, 20, 61)]
    nodes[0]["uplink_mbps"] = 1
    shared = network(nodes=nodes, microbatches=2, **slow)
    assert arrivals(shared) == [(1, 10, 51), (2, 50, 91)]
    nodes[0]["uplink_mbps"] = 0.5  # an uplink slower than the link sets the pace
    assert arrivals(network(nodes=nodes, microbatches=2, **slow))[0] == (1, 10, 91)
    assert parse_network(shared.to_json()).nodes[0].uplink_mbps == 1
    nodes[0]["uplink_mbps"] = 0
    with pytest.raises(NetworkError, match="uplink_mbps must be a positive number"):
        network(nodes=nodes)


def test_the_timing_benchmarks_network_is_what_netlab_emulates():
    from decentral.pipeline.recipe import parse_pipeline_recipe
    from decentral.pipeline.trainbench import calibrate, timing_network

    recipe = parse_pipeline_recipe({"pipeline": {"stages": 3, "skip": 0.0, "microbatches": 4},
                                    "train": {"batch_size": 2, "context": 16},
                                    "model": {"n_layer": 3, "n_head": 2, "d_model": 16, "context": 16}})
    costs = calibrate(recipe, reps=2)
    assert costs["forward_ms"][0] > 0 and costs["backward_factor"] > 0 and costs["loss_factor"] > 0
    net = parse_network(timing_network(recipe, costs, nodes=5, rate_mbps=20.0, latency_ms=20.0))
    assert all(node.uplink_mbps == 20.0 and node.stage is not None for node in net.nodes)
    assert {node.stage for node in net.nodes} == {0, 1, 2} and net.activation_bytes == 2 * 16 * 16 * 4
    assert (net.latency_ms[0, 1], net.bandwidth_mbps[0, 1]) == (20.0, 20.0)
    measured = net.with_measured_compute({net.nodes[0].name: {"forward": 4.0, "backward": 8.0, "loss": 1.0},
                                         net.nodes[1].name: {"forward": 2.0, "backward": 6.0}})
    assert [n.compute_ms for n in measured.nodes[:2]] == [4.0, 2.0] and measured.nodes[2] == net.nodes[2]
    assert (measured.backward_factor, measured.loss_factor) == (2.5, 0.25)
