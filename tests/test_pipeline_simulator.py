"""The SkipPipe simulator against timelines computed by hand."""

from __future__ import annotations

import pytest

from decentral.pipeline.network import parse_network
from decentral.pipeline.simulator import Deadlock, simulate

# a -> b: 5 ms + 1000 bytes at 8 Mb/s (1 ms) = 6 ms; b -> a: 3 ms + 1000 bytes at 16 Mb/s (0.5 ms) = 3.5 ms
W_A, W_B = 10.0, 20.0
AB, BA = 6.0, 3.5


def two_nodes(memory_a: int = 3, memory_b: int = 3):
    return parse_network({
        "stages": 2, "skip": 0, "microbatches": 1, "activation_bytes": 1000,
        "nodes": [{"name": "a", "compute_ms": W_A, "memory": memory_a},
                  {"name": "b", "compute_ms": W_B, "memory": memory_b}],
        "links": [{"from": "a", "to": "b", "latency_ms": 5, "bandwidth_mbps": 8},
                  {"from": "b", "to": "a", "latency_ms": 3, "bandwidth_mbps": 16}],
    })


def spans(timeline, node=None):
    return [(t.microbatch, t.kind, t.start, t.end) for t in timeline.tasks if node is None or t.node == node]


def test_one_microbatch_over_two_nodes():
    timeline = simulate(two_nodes(), [[0, 1]])
    forward_a = (0.0, W_A)                                   # 0 - 10
    forward_b = (forward_a[1] + AB, forward_a[1] + AB + W_B)  # 16 - 36
    loss = (forward_b[1] + BA, forward_b[1] + BA + 0.25 * W_A)  # 39.5 - 42
    backward_b = (loss[1] + AB, loss[1] + AB + 1.5 * W_B)      # 48 - 78
    backward_a = (backward_b[1] + BA, backward_b[1] + BA + 1.5 * W_A)  # 81.5 - 96.5
    assert spans(timeline) == [(0, "forward", *forward_a), (0, "forward", *forward_b), (0, "loss", *loss),
                               (0, "backward", *backward_b), (0, "backward", *backward_a)]
    assert [(t.source, t.target, t.kind, t.end) for t in timeline.transfers] == [
        (0, 1, "activations", 16.0), (1, 0, "activations", 39.5), (0, 1, "gradients", 48.0), (1, 0, "gradients", 81.5)]
    assert timeline.makespan_ms == 96.5 == timeline.finish_ms[0]


def test_two_microbatches_take_turns_on_a_node():
    timeline = simulate(two_nodes(), [[0, 1], [0, 1]])
    # a: forwards 0-10 (mb 0, lower id first), 10-20 (mb 1)
    # b: mb 0 arrives 16 -> 16-36; mb 1 arrives 26 but b is busy -> 36-56
    # a: loss 0 at 36 + 3.5 = 39.5-42; b gets its gradient at 48 but runs mb 1's forward until 56
    # b: backward 0 56-86; mb 1's activations reach a at 59.5 -> loss 1 59.5-62, gradient at b 68 -> backward 1 86-116
    # a: backward 0 at 89.5-104.5, backward 1 at 119.5-134.5
    assert spans(timeline, node=1) == [(0, "forward", 16, 36), (1, "forward", 36, 56), (0, "backward", 56, 86),
                                       (1, "backward", 86, 116)]
    assert spans(timeline, node=0) == [(0, "forward", 0, 10), (1, "forward", 10, 20), (0, "loss", 39.5, 42),
                                       (1, "loss", 59.5, 62), (0, "backward", 89.5, 104.5),
                                       (1, "backward", 119.5, 134.5)]
    assert timeline.makespan_ms == 134.5


def test_memory_of_one_serialises_microbatches_on_their_head():
    timeline = simulate(two_nodes(memory_a=1), [[0, 1], [0, 1]])
    one = 96.5  # a whole microbatch, as in test_one_microbatch_over_two_nodes
    assert spans(timeline, node=0)[3] == (1, "forward", one, one + W_A)  # mb 1 starts when mb 0's backward ends
    assert timeline.finish_ms == (one, 2 * one)


def test_a_link_carries_one_message_at_a_time():
    network = parse_network({
        "stages": 2, "skip": 0, "microbatches": 2, "activation_bytes": 1000,
        "nodes": [{"name": "a", "compute_ms": 1}, {"name": "b", "compute_ms": 1}],
        "default_link": {"latency_ms": 5, "bandwidth_mbps": 0.8},  # 1000 bytes hold the link 10 ms
    })
    timeline = simulate(network, [[0, 1], [0, 1]])
    first, second = [t for t in timeline.transfers if t.kind == "activations" and t.source == 0]
    assert (first.start, first.end) == (1, 16)  # sent at 1, leaves at 11, arrives 5 ms later
    assert (second.start, second.end) == (11, 26)  # sent at 2, waits for the link until 11
    assert spans(timeline, node=1)[:2] == [(0, "forward", 16, 17), (1, "forward", 26, 27)]


def test_backward_goes_before_a_waiting_forward():
    # mb 0 visits a then b; mb 1 visits only b (as its head). b starts mb 1's forward at 0 (0-20);
    # mb 0's activations arrive at 16; at 20 b runs mb 1's loss (ready at 20) before mb 0's forward
    timeline = simulate(two_nodes(), [[0, 1], [1]])
    assert spans(timeline, node=1)[:3] == [(1, "forward", 0, 20), (1, "loss", 20, 25), (1, "backward", 25, 55)]
    assert spans(timeline, node=1)[3] == (0, "forward", 55, 75)


def test_a_deadlock_is_reported():
    # a and b hold one microbatch each; each microbatch needs the other node next
    with pytest.raises(Deadlock, match=r"a holds microbatches \[0\] \(memory 1\) while forwards of \[1\] wait"):
        simulate(two_nodes(memory_a=1, memory_b=1), [[0, 1], [1, 0]])


def test_bad_paths_are_refused():
    with pytest.raises(ValueError, match="visits a node twice"):
        simulate(two_nodes(), [[0, 1, 0]])
    with pytest.raises(ValueError, match="outside"):
        simulate(two_nodes(), [[0, 2]])
