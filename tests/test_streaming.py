"""Streaming DiLoCo (decentral.sync.streaming): equal fragments of the flat vector, the staggered schedule, the update
rule against arithmetic done here (torch's own SGD per fragment), overlap, rollback, identical replicas,
error feedback, and the fragment still in flight when training ends."""

import threading

import pytest
import torch

from conftest import loss_step, run_in_threads, wait_until
from decentral.loopback import LoopbackHub
from decentral.models import GPT, GPTConfig
from decentral.sync import DiLoCo, StreamingDiLoCo
from decentral.transport import SoloTransport
from test_protocols import flat, make_protocols, outer_round, record_lookups, set_flat, tiny_model

# tiny_model's 4 tensors (20, 4, 12 and 3 values) in 3 fragments of 13 values: the first cuts the first tensor,
# the second holds the rest of it, the second tensor and 2 values of the third
PARTS = [slice(0, 13), slice(13, 26), slice(26, 39)]


def inner_steps(protocols, count, gen, scale=0.01):
    """`count` inner steps on every peer, as if training moved θ in a direction common to all, plus noise
    of each peer's own (outer gradients of similar norms: the swarm clips parts far above the others);
    each peer's total move."""
    n = protocols[0].slow.numel()
    moves = [torch.zeros(n) for _ in protocols]
    for _ in range(count):
        common = torch.randn(n, generator=gen)
        for p, move in zip(protocols, moves):
            noise = scale * (common + 0.5 * torch.randn(n, generator=gen))
            move += noise
            set_flat(p.model, flat(p.model) + noise)
        run_in_threads([p._after_step for p in protocols])  # threads: with delay 0 an average blocks its step
    return moves


def record(p):
    """Log (inner step, tag, what we sent) of every launch and (inner step, result) of every apply of `p`."""
    launches, applies = [], []
    launch, wait = p.transport.average_async, p._await_average

    def logged_launch(tensor, group, tag, round=None):
        launches.append((p.step, tag, tensor.clone()))
        return launch(tensor, group, tag, round)

    def logged_wait(future):
        result, waited = wait(future)
        applies.append((p.step, result))
        return result, waited

    p.transport.average_async, p._await_average = logged_launch, logged_wait
    return launches, applies


def test_fragments_are_equal_slices_and_read_and_write_only_their_values_across_tensors():
    model = tiny_model(0)
    p = StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), SoloTransport(), every=12, fragments=3)
    assert p.fragments == PARTS  # equal slices of the flat vector, covering it
    sizes = [q.numel() for q in GPT(GPTConfig(n_layer=3, n_head=4, d_model=96)).parameters()]
    big = GPT(GPTConfig(n_layer=3, n_head=4, d_model=96))
    parts = StreamingDiLoCo(big, torch.optim.SGD(big.parameters(), lr=0.1), SoloTransport(), every=50,
                            fragments=3).fragments
    assert [s.stop - s.start for s in parts] == [sum(sizes) // 3] * 3  # the peak is a third, not the largest run
    theta = flat(model)
    for part in PARTS:
        assert torch.equal(p._fast_vector(part), theta[part])
        new = torch.arange(part.stop - part.start, dtype=torch.float32) + 100
        p._load_fast(new, part)
        theta[part] = new
        assert torch.equal(flat(model), theta)  # only the fragment's values changed, in every tensor it cuts


@pytest.mark.parametrize("kwargs, message", [
    ({"fragments": 0}, "fragments must be an integer >= 1, got 0"),
    ({"fragments": 2.5}, "fragments must be an integer >= 1, got 2.5"),
    ({"fragments": 40, "every": 50}, "at most the model's 39 parameters, got 40"),
    ({"fragments": 3, "delay": 4}, "delay must be below every // fragments = 4"),
    ({"fragments": 3, "delay": -1}, "delay must be an integer >= 0, got -1"),
    ({"fragments": 3, "every": 2, "delay": 0}, "fragments must be between 1 and every = 2"),  # was said of delay
    ({"mix": 1.0}, "mix"),
])
def test_bad_fragments_delay_or_mix_are_refused(kwargs, message):
    model = tiny_model(0)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), SoloTransport(),
                        **{"every": 12, **kwargs})


def test_fragments_launch_staggered_land_delay_steps_later_and_the_last_on_the_boundary(make_loopback):
    protocols = make_protocols(make_loopback(2), StreamingDiLoCo, every=12, fragments=3, delay=1)
    logs = [record(p) for p in protocols]
    gen = torch.Generator().manual_seed(0)
    reports, in_flight, rounds = [], [], []
    for _ in range(24):
        inner_steps(protocols, 1, gen)
        reports.append([p.pop_report() for p in protocols])
        rounds.append([p.round for p in protocols])
        in_flight.append([None if p.in_flight is None else p.in_flight.fragment for p in protocols])
    for launches, applies in logs:
        assert [(step, tag) for step, tag, _ in launches] == [
            (3, "streaming/0/0"), (7, "streaming/0/1"), (11, "streaming/0/2"),
            (15, "streaming/1/0"), (19, "streaming/1/1"), (23, "streaming/1/2")]
        assert [step for step, _ in applies] == [4, 8, 12, 16, 20, 24]
        assert all(r.complete and r.contributors == 2 for _, r in applies)
    for step, fragments in enumerate(in_flight, start=1):  # one fragment on the wire, only between its two steps
        assert fragments == [(step % 12) // 4 if step % 4 == 3 else None] * 2, step
    for step, pair in enumerate(reports, start=1):
        if step % 12:
            assert pair == [None, None]
        else:
            assert [(r.round, r.complete, len(r.group), r.contributors, r.rolled_back) for r in pair] == \
                [(step // 12 - 1, True, 2, 2, False)] * 2
            assert pair[0].digest == pair[1].digest
    assert rounds == [[step // 12] * 2 for step in range(1, 25)]  # a round ends when its last fragment lands


def test_a_fragment_lands_as_torch_sgd_on_the_mean_outer_gradient_mixed_with_the_local_weights(make_peers):
    lr, mu, alpha = 0.8, 0.9, 0.3
    protocols = make_protocols(make_peers(2), StreamingDiLoCo, every=12, fragments=3, delay=1, mix=alpha,
                               outer_lr=lr, outer_momentum=mu)
    phi = protocols[0].slow.clone()
    references = [phi[part].clone().requires_grad_(True) for part in PARTS]
    optimizers = [torch.optim.SGD([r], lr=lr, momentum=mu, nesterov=True) for r in references]
    thetas = [flat(p.model) for p in protocols]
    gen = torch.Generator().manual_seed(1)
    grads = None
    for step in range(1, 25):
        common = torch.randn(phi.numel(), generator=gen)  # as in inner_steps
        for p, theta in zip(protocols, thetas):
            theta += 0.01 * (common + 0.5 * torch.randn(theta.numel(), generator=gen))
            set_flat(p.model, theta)
        run_in_threads([p._after_step for p in protocols])
        done = (step - 1) % 12 + 1
        if done % 4 == 3:  # launch: g_i = φ − θ_i on the fragment
            grads = [phi[PARTS[done // 4]] - theta[PARTS[done // 4]] for theta in thetas]
        if done % 4 == 0:  # land: φ ← SGD step on mean g_i; θ_i ← α·θ_i + (1−α)·φ on the fragment only
            f = done // 4 - 1
            part, reference, optimizer = PARTS[f], references[f], optimizers[f]
            reference.grad = torch.stack(grads).mean(0)
            optimizer.step()
            if f == 0 and step == 4:  # sign: a positive outer lr moves φ towards the workers' progress
                assert float(torch.dot(reference.detach() - phi[part], -reference.grad)) > 0
            phi[part] = reference.detach()
            for p, theta in zip(protocols, thetas):
                outside = torch.ones(theta.numel(), dtype=torch.bool)
                outside[part] = False
                assert torch.equal(flat(p.model)[outside], theta[outside])  # other fragments untouched
                theta[part] = alpha * theta[part] + (1 - alpha) * phi[part]
                torch.testing.assert_close(p.momentum[part], optimizer.state[reference]["momentum_buffer"],
                                           rtol=0, atol=1e-6)
        for p, theta in zip(protocols, thetas):
            torch.testing.assert_close(p.slow, phi, rtol=0, atol=1e-6)
            torch.testing.assert_close(flat(p.model), theta, rtol=0, atol=1e-6)
            set_flat(p.model, theta)


def test_one_fragment_no_delay_and_no_mix_is_diloco_exactly(make_loopback):
    transports = [LoopbackHub().transport()]
    transports += [transports[0].hub.transport() for _ in range(2)]
    try:
        diloco = make_protocols(transports, DiLoCo, every=10)
        streaming = make_protocols(make_loopback(3), StreamingDiLoCo, every=10, fragments=1, delay=0, mix=0.0)
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            fasts = [flat(p.model) + 0.1 * torch.randn(p.slow.numel(), generator=gen) for p in diloco]
            outer_round(diloco, fasts)
            outer_round(streaming, fasts)
            for d, s in zip(diloco, streaming):
                assert torch.equal(d.slow, s.slow) and torch.equal(d.momentum, s.momentum)
                assert torch.equal(flat(d.model), flat(s.model))
    finally:
        for t in transports:
            t.close()


def test_a_fragment_average_runs_in_the_background_while_training_goes_on(make_loopback):
    first, second = make_protocols(make_loopback(2), StreamingDiLoCo, every=12, fragments=3, delay=3)
    x = torch.randn(8, 5)

    with first, second:
        loss_step(first, x)  # fragment 0 launches at step 4 - 3 = 1
        in_flight = first.in_flight.future
        for _ in range(2):  # training goes on, and the average waits for the second peer's part
            loss_step(first, x)
            assert not in_flight.done()
        loss_step(second, x)
        assert in_flight.result().complete and in_flight.result().contributors == 2
        loss_step(first, x)  # step 4: fragment 0 lands
        assert first.in_flight is None and first.momentum[PARTS[0]].abs().sum() > 0
        assert first.momentum[PARTS[0].stop:].abs().sum() == 0
        for _ in range(3):
            loss_step(second, x)
    assert torch.equal(first.slow, second.slow) and torch.equal(first.momentum, second.momentum)


def test_a_fragment_average_that_did_not_commit_changes_nothing_and_goes_out_again(make_loopback):
    transports = make_loopback(2)
    for t in transports:  # as over a codec that drops part of each tensor: the protocols keep a residual
        t.error_feedback = True
    alone, leaving = make_protocols(transports, StreamingDiLoCo, every=12, fragments=3, delay=1)
    launches, applies = record(alone)
    gen = torch.Generator().manual_seed(3)
    inner_steps([alone, leaving], 12, gen)  # round 0, both
    residual = 0.05 * torch.randn(PARTS[0].stop, generator=gen)  # what an earlier average did not count
    alone.residual[PARTS[0]] = residual
    inner_steps([alone], 3, gen)  # fragment 0 of round 1 launches over both; the other peer leaves before its part
    leaving.transport.close()
    slow, momentum, theta = alone.slow.clone(), alone.momentum.clone(), flat(alone.model)
    alone._after_step()  # step 16: it lands rolled back
    assert not applies[-1][1].complete
    assert torch.equal(alone.slow, slow) and torch.equal(alone.momentum, momentum)
    assert torch.equal(flat(alone.model), theta)  # θ keeps its progress
    torch.testing.assert_close(alone.residual[PARTS[0]], residual, rtol=0, atol=1e-7)  # and the residual is back
    inner_steps([alone], 8, gen)
    report = alone.pop_report()
    assert report.round == 1 and report.rolled_back and not report.complete
    inner_steps([alone], 3, gen)  # round 2: fragment 0 goes out again, alone
    (_, _, rolled_back), (_, again, sent), now = launches[3], launches[6], flat(alone.model)
    assert again == "streaming/2/0" and torch.equal(alone.slow[PARTS[0]], slow[PARTS[0]])
    # both rounds' progress: what the rolled-back average carried and what θ trained since
    torch.testing.assert_close(sent, rolled_back + (theta - now)[PARTS[0]], rtol=0, atol=1e-6)
    assert float((theta - now)[PARTS[0]].norm()) > 0.1 * float(rolled_back.norm())


def test_replicas_hold_identical_slow_weights_and_momentum_after_every_round(make_peers):
    protocols = make_protocols(make_peers(3), StreamingDiLoCo, every=12, fragments=3, delay=1)
    gen = torch.Generator().manual_seed(4)
    for round in range(3):
        inner_steps(protocols, 12, gen)
        reports = [p.pop_report() for p in protocols]
        assert all(r.round == round and r.complete and r.spread == 0.0 for r in reports)
        assert len({r.digest for r in reports}) == 1
        for p in protocols[1:]:
            assert torch.equal(p.slow, protocols[0].slow) and torch.equal(p.momentum, protocols[0].momentum)
            assert not torch.equal(flat(p.model), flat(protocols[0].model))  # θ_i keep their own progress
    assert not torch.equal(flat(protocols[0].model), protocols[0].slow)  # never reset to φ


def test_a_fragment_average_looks_up_its_members_off_the_training_thread(make_swarm):
    protocols = make_protocols(make_swarm(2), StreamingDiLoCo, every=12, fragments=3, delay=1)
    lookups, trainers = record_lookups(protocols)
    inner_steps(protocols, 24, torch.Generator().manual_seed(3))
    reports = [p.pop_report() for p in protocols]
    assert all(r.complete and r.round == 1 and len(r.group) == 2 for r in reports)
    assert len(lookups) == 2 * 6 and not trainers & set(lookups)  # 3 fragments a round, 2 rounds, 2 peers


def test_error_feedback_keeps_what_a_fragment_average_did_not_count(make_swarm):
    protocols = make_protocols(make_swarm(2, codec="topk:0.1"), StreamingDiLoCo, every=12, fragments=3, delay=1)
    first = protocols[0]
    launches, applies = record(first)
    gen = torch.Generator().manual_seed(5)
    inner_steps(protocols, 4, gen)
    residual = first.residual.clone()
    inner_steps(protocols, 4, gen)  # fragment 1: launched at step 7, applied at step 8
    (_, _, sent), (_, result) = launches[-1], applies[-1]
    assert result.complete and not torch.equal(result.sent, sent)  # top-k dropped some of it
    assert torch.equal(first.residual[PARTS[1]], sent - result.sent)
    outside = torch.ones_like(residual, dtype=torch.bool)
    outside[PARTS[1]] = False
    assert torch.equal(first.residual[outside], residual[outside])


def test_error_feedback_loses_nothing_of_the_replicas_progress_even_when_mixing(make_swarm):
    """With outer lr 1, no momentum and no delay, the mean of the peers' fast weights is where they started
    plus the mean of what they trained, however little of it each average counted: what one did not count
    stays in its model (θ mixes with φ − e, not φ)."""
    protocols = make_protocols(make_swarm(2, codec="topk:0.1"), StreamingDiLoCo, every=12, fragments=3, delay=0,
                               mix=0.5, outer_lr=1.0, outer_momentum=0.0)
    start = flat(protocols[0].model)
    moves = inner_steps(protocols, 24, torch.Generator().manual_seed(6), scale=0.1)
    mean_move = torch.stack(moves).mean(0)
    residual = torch.stack([p.residual for p in protocols]).mean(0)
    assert float(residual.norm()) > 0.1 * float(mean_move.norm())  # top-k really left some out
    mean_theta = torch.stack([flat(p.model) for p in protocols]).mean(0)
    torch.testing.assert_close(mean_theta, start + mean_move, rtol=0, atol=1e-5)


def test_finish_applies_the_fragment_in_flight(make_loopback):
    protocols = make_protocols(make_loopback(2), StreamingDiLoCo, every=12, fragments=3, delay=1, mix=0.5,
                               outer_lr=1.0, outer_momentum=0.0)
    phi = protocols[0].slow.clone()
    inner_steps(protocols, 3, torch.Generator().manual_seed(7))  # fragment 0 in flight
    thetas = [flat(p.model) for p in protocols]
    run_in_threads([p.finish for p in protocols])
    expected = phi.clone()
    expected[PARTS[0]] = torch.stack([t[PARTS[0]] for t in thetas]).mean(0)  # φ − mean(φ − θ_i)
    for p, theta in zip(protocols, thetas):
        assert p.in_flight is None
        torch.testing.assert_close(p.slow, expected, rtol=0, atol=1e-6)
        theta[PARTS[0]] = 0.5 * theta[PARTS[0]] + 0.5 * expected[PARTS[0]]
        torch.testing.assert_close(flat(p.model), theta, rtol=0, atol=1e-6)


def test_a_newcomer_whose_state_is_rounds_old_replays_each_rounds_fragment_averages(make_loopback):
    """A round's fragment averages, in turn, are the round's update of φ and the momentum (element-wise): a
    newcomer holding the state of round 1 replays rounds 1 and 2 from the donor's kept averages and holds the
    members' state of round 3, bit for bit."""
    transports = make_loopback(3)
    protocols = make_protocols(transports[:2], StreamingDiLoCo, every=12, fragments=3, delay=1)
    gen = torch.Generator().manual_seed(5)
    inner_steps(protocols, 12, gen)
    donor, (meta, tensors) = transports[2].fetch_state()  # the donor keeps the rounds after it for us
    inner_steps(protocols, 24, gen)
    model = tiny_model(9)
    late = StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), transports[2], every=12, fragments=3,
                           delay=1)
    replayed = late._replayed(donor, dict(meta), {k: v.clone() for k, v in tensors.items()})
    assert meta["round"] == 1 and replayed is not None and replayed[0]["round"] == 3
    assert all(torch.equal(replayed[1][k], v) for k, v in protocols[0].snapshot().items())


def test_a_member_the_others_finished_a_round_without_joins_them_when_a_fragment_lands_not_at_its_boundary(make_swarm):
    """The third member stops training after round 1's first fragment (as if frozen); the other two average
    its next two fragments without it and go on into round 2. Resumed, its next fragment lands left out: it
    joins them there (their state, round and step) instead of training the rest of a round nobody averages
    with it, while their round 2 waited for its part (its round is within their lead). All three then hold
    one state and average the next round together."""
    protocols = make_protocols(make_swarm(3, timeout=3.0), StreamingDiLoCo, every=12, fragments=3, delay=1)
    ahead, late = protocols[:2], protocols[2]
    inner_steps(protocols, 12 + 4, torch.Generator().manual_seed(8))  # round 0, and round 1's fragment 0
    onward = threading.Thread(target=inner_steps, args=(ahead, 8 + 12, torch.Generator().manual_seed(9)))
    onward.start()  # round 1's other fragments without the late member (each after the timeout), then round 2
    wait_until(lambda: all(p.round == 2 for p in ahead), 30, "the two going on into round 2")
    gen = torch.Generator().manual_seed(10)
    inner_steps([late], 4, gen)  # round 1's fragment 1 launches at in-round step 7 and lands at 8, left out
    assert late.round == 3 and late.step == 36  # it waited for their round 3 (round 2 was under way) and joined it
    left = late.pop_report()
    assert left.round == 1 and left.rolled_back and left.repaired
    onward.join(timeout=30)
    assert not onward.is_alive()
    reports = [p.pop_report() for p in ahead]
    assert all(r.round == 2 and r.complete and r.group == sorted(p.transport.peer_id for p in ahead)
               for r in reports)
    for p in ahead:
        assert torch.equal(p.slow, late.slow) and torch.equal(p.momentum, late.momentum)
    inner_steps(protocols, 12, gen)
    reports = [p.pop_report() for p in protocols]
    assert all(r.round == 3 and r.complete and r.contributors == 3 for r in reports)
    assert len({r.digest for r in reports}) == 1
