"""Outer-step protocols between real hivemind peers: the update rules of ALGORITHMS.md, checked against
arithmetic done independently here (torch's own SGD for DiLoCo, §3 written out for NoLoCo)."""

import asyncio
import gc
import logging
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from conftest import loss_step, run_in_threads, wait_until, wait_until_senders_counted
from decentral.loopback import EXACT, LoopbackHub
from decentral.swarm import state, wire
from decentral.sync import CO2, DDP, DiLoCo, DivergedError, Local, NoLoCo, StreamingDiLoCo
from decentral.transport import (EncodedAverage, ForeignState, JoinRequest, SoloTransport, heartbeat_digest,
                                 state_digest)


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def flat(model) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def set_flat(model, vector) -> None:
    torch.nn.utils.vector_to_parameters(vector.clone(), model.parameters())


def make_protocols(transports, cls, seeds=None, model=tiny_model, optimizer=None, **kwargs):
    """Started protocols over `transports`, every one seeing all of them announced for their round; each
    protocol's model is `model(seed)`, its optimizer `optimizer(parameters)` (SGD, lr 0.1, by default)."""
    protocols = []
    for i, t in enumerate(transports):
        model_i = model(seeds[i] if seeds else 0)
        made = optimizer(model_i.parameters()) if optimizer else torch.optim.SGD(model_i.parameters(), lr=0.1)
        p = cls(model_i, made, t, **kwargs)
        p.start()  # one after the other: later ones download the first one's state
        protocols.append(p)
    ids = sorted(t.peer_id for t in transports)
    wait_until(lambda: all(set(ids) <= set(p.transport.members(p.round)) for p in protocols), 30,
               "every protocol seeing every announcement")
    return protocols


def outer_round(protocols, fasts):
    """Put `fasts[i]` into worker i's model as if H inner steps produced it, then run the outer step."""
    for p, fast in zip(protocols, fasts):
        set_flat(p.model, fast)
        p.step = p._round_start + p.every
    return run_in_threads([p.after_step for p in protocols])


def test_a_newcomer_that_already_holds_the_donors_state_downloads_no_copy(make_swarm):
    donor, newcomer = make_swarm(2)
    state = {"slow": torch.randn(100_000), "momentum": torch.zeros(100_000)}
    donor.offer_state({"protocol": "diloco", "round": 0}, {k: v.clone() for k, v in state.items()})
    before = newcomer.bytes_received
    assert newcomer.fetch_state(have={k: v.clone() for k, v in state.items()}) is None
    assert newcomer.bytes_received - before < 4_000  # a header, not 800 kB of tensors
    changed = {"slow": state["slow"] + 1e-3, "momentum": state["momentum"]}
    got = newcomer.fetch_state(have=changed)  # the same donor, a state that differs: a full download
    assert got is not None and torch.equal(got[1][1]["slow"], state["slow"])
    assert newcomer.bytes_received - before > 800_000
    donor.set_progress(5, 0)  # the donor trained past its snapshot: one that asks for no more gets the meta only
    before = newcomer.bytes_received
    got = newcomer.fetch_state(have=changed, meta_if_past=True)
    assert got is not None and got[1][1] == {} and got[1][0]["donor_step"] == 5
    assert newcomer.bytes_received - before < 4_000


@pytest.mark.solo
def test_a_donor_that_leaves_first_finishes_the_state_download_under_way(make_swarm, monkeypatch):
    """The swarm's last members ending their run must not cut off a newcomer's download of its final state."""
    monkeypatch.setattr(wire, "LINK", wire.LinkShaper(rate_bps=16e6))  # our streams paced: 4 MB take 2 s
    donor, newcomer = make_swarm(2)
    state = {"slow": torch.randn(1_000_000)}
    donor.offer_state({"protocol": "diloco", "round": 3}, {"slow": state["slow"].clone()})
    before = newcomer.bytes_received
    with ThreadPoolExecutor(1) as pool:
        download = pool.submit(newcomer.fetch_state)
        wait_until(lambda: newcomer.bytes_received > before, 30, "the state's header")  # its payload is on its way
        donor.close()
        got = download.result()
    assert got is not None and torch.equal(got[1][1]["slow"], state["slow"])


def test_replicas_start_identical_even_from_different_seeds(make_peers):
    protocols = make_protocols(make_peers(3), DiLoCo, seeds=[1, 2, 3], every=10)
    reference = flat(protocols[0].model)
    assert not torch.equal(reference, flat(tiny_model(2)))  # the seeds really differ
    for p in protocols:
        assert torch.equal(flat(p.model), reference)
        assert torch.equal(p.slow, reference)


def test_diloco_outer_step_matches_torch_sgd_nesterov_and_moves_towards_workers(make_peers):
    protocols = make_protocols(make_peers(3), DiLoCo, every=10, outer_lr=0.7, outer_momentum=0.9)
    phi = protocols[0].slow.clone()
    reference = phi.clone().requires_grad_(True)
    opt = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    gen = torch.Generator().manual_seed(0)
    for round in range(3):
        fasts = [reference.detach() + 0.1 * torch.randn(phi.numel(), generator=gen) for _ in protocols]
        reports = outer_round(protocols, fasts)
        assert all(r.complete and len(r.group) == 3 for r in reports)
        before = reference.detach().clone()
        reference.grad = torch.stack([before - f for f in fasts]).mean(0)
        opt.step()
        for p in protocols:
            torch.testing.assert_close(p.slow, reference.detach(), rtol=0, atol=1e-6)
            torch.testing.assert_close(flat(p.model), reference.detach(), rtol=0, atol=1e-6)
            assert p.round == round + 1
        if round == 0:  # sign: a positive outer lr moves φ towards the workers' mean
            progress = torch.stack(fasts).mean(0) - before
            assert torch.dot(protocols[0].slow - before, progress) > 0


@pytest.mark.parametrize("cls, settings", [(DiLoCo, {}), (NoLoCo, {}), (CO2, {}),
                                           (StreamingDiLoCo, {"every": 6, "fragments": 3})])
def test_the_offered_state_is_no_copy_and_never_changes_once_offered(make_loopback, cls, settings):
    """What a protocol offers newcomers is its φ and outer tensors themselves, no copy of them, and the rounds
    after leave those tensors exactly as they were offered (a download under way may still be reading them):
    an outer step replaces what it would change in place."""
    protocols = make_protocols(make_loopback(2), cls, **{"every": 4, **settings})
    x = torch.randn(8, 5)
    every = protocols[0].every

    def train(steps):
        run_in_threads([lambda p=p: [loss_step(p, x) for _ in range(steps)] for p in protocols])

    with protocols[0], protocols[1]:
        train(every)
        first = protocols[0]
        offered = first.snapshot()
        assert set(offered) == {"slow", *first.outer_tensors()}
        assert all(offered[name] is getattr(first, name) for name in offered)
        as_offered = {name: t.clone() for name, t in offered.items()}
        train(2 * every)
        assert first.round == 3 and not torch.equal(first.slow, as_offered["slow"])
        for name, t in offered.items():
            assert torch.equal(t, as_offered[name]), f"{name} changed after it was offered"


def test_noloco_pair_round_is_the_section_3_update_for_both_peers(make_peers):
    alpha, beta, gamma = 0.5, 0.7, 0.6
    protocols = make_protocols(make_peers(2), NoLoCo, every=10, alpha=alpha, beta=beta, gamma=gamma)
    gen = torch.Generator().manual_seed(1)
    n = protocols[0].slow.numel()
    # give the replicas different slow weights, as they have after some rounds of pairwise averaging
    slows = [p.slow + 0.05 * torch.randn(n, generator=gen) for p in protocols]
    for p, s in zip(protocols, slows):
        p.slow = s.clone()
    deltas = [torch.zeros(n), torch.zeros(n)]
    for round in range(3):
        fasts = [s + 0.1 * torch.randn(n, generator=gen) for s in slows]
        reports = outer_round(protocols, fasts)
        assert all(r.complete and len(r.group) == 2 for r in reports)
        std = torch.stack(slows).std(dim=0, unbiased=False)  # φ's spread across the two replicas
        for r in reports:
            assert r.spread == pytest.approx(float(std.pow(2).mean().sqrt()), rel=1e-4)
        mean_outer = ((fasts[0] - slows[0]) + (fasts[1] - slows[1])) / 2
        mean_slow = (slows[0] + slows[1]) / 2
        for i in range(2):
            deltas[i] = alpha * deltas[i] + beta * mean_outer + gamma * (mean_slow - slows[i])
        slows = [slows[i] + deltas[i] for i in range(2)]
        for i, p in enumerate(protocols):
            torch.testing.assert_close(p.slow, slows[i], rtol=0, atol=1e-6)
            torch.testing.assert_close(p.delta, deltas[i], rtol=0, atol=1e-6)
            torch.testing.assert_close(flat(p.model), slows[i], rtol=0, atol=1e-6)


def test_noloco_in_float16_leaves_identical_replicas_identical_and_unrounded(make_swarm):
    """On a float16 wire the pull toward the pair's mean compares rounded with rounded: replicas that
    agree are not moved by rounding, and φ is never replaced by its float16 value (which would lose
    every update below half a float16 step, round after round)."""
    protocols = make_protocols(make_swarm(2, codec="float16"), NoLoCo, every=10, alpha=0.5, beta=0.7)
    gen = torch.Generator().manual_seed(5)
    phi = protocols[0].slow.clone()
    assert not torch.equal(phi, phi.half().float())  # φ has more precision than float16 holds
    fast = phi + 0.01 * torch.randn(phi.numel(), generator=gen)
    reports = outer_round(protocols, [fast, fast.clone()])
    assert all(r.complete for r in reports)
    expected = phi + 0.7 * (fast - phi).half().float()  # δ = β·mean(Δ) with Δ as it travelled; no pull
    for p in protocols:
        assert torch.equal(p.slow, expected)


def test_noloco_lone_peer_applies_its_own_delta(make_peers):
    (p,) = make_protocols(make_peers(1), NoLoCo, every=5, alpha=0.5, beta=0.7)
    phi = p.slow.clone()
    fast = phi + 0.1
    (report,) = outer_round([p], [fast])
    assert report.group == [p.transport.peer_id]
    torch.testing.assert_close(p.slow, phi + 0.7 * (fast - phi), rtol=0, atol=1e-6)


def random_round(protocols, gen) -> list:
    """One outer round, each worker's fast weights its φ plus noise from `gen`; the reports."""
    return outer_round(protocols, [p.slow + 0.1 * torch.randn(p.slow.numel(), generator=gen) for p in protocols])


def two_random_rounds(protocols, gen) -> None:
    """Two outer rounds of `random_round`."""
    for _ in range(2):
        random_round(protocols, gen)


def into_round(protocols, steps: int) -> None:
    """As if each protocol had done `steps` inner steps of its round, and said so in its heartbeat."""
    for p in protocols:
        p.step = p._round_start + steps
        p.transport.set_progress(p.step, p.round)


def test_late_joiner_downloads_slow_weights_momentum_and_round(make_peers):
    transports = make_peers(3)
    protocols = make_protocols(transports[:2], DiLoCo, every=10)
    gen = torch.Generator().manual_seed(2)
    two_random_rounds(protocols, gen)
    (late,) = make_protocols(transports[2:], DiLoCo, seeds=[99], every=10)
    assert late.round == protocols[0].round == 2
    assert torch.equal(late.slow, protocols[0].slow)
    assert torch.equal(late.momentum, protocols[0].momentum)
    assert torch.equal(flat(late.model), protocols[0].slow)


def test_a_peer_that_waited_for_the_others_joins_one_that_came_rounds_ahead(make_loopback):
    """Resumed peers: the first waits for --min-peers with its older checkpoint, and one resumed later from a newer
    one comes rounds ahead and waits for nobody. The first trained on from its own round and the two never shared
    a round again (each averaged alone to the end). After the wait, `catch_up` joins the one ahead as a newcomer
    does; a peer at the swarm's round keeps its own state."""
    transports = make_loopback(3)
    model = tiny_model(0)
    ahead = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), transports[0], every=10)
    ahead.round, ahead.step = 3, 30  # resumed from a later checkpoint: it announces rounds from 3 on
    ahead.start()
    two_random_rounds([ahead], torch.Generator().manual_seed(2))
    model = tiny_model(7)
    level = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), transports[2], every=10)
    level.round, level.step = ahead.round, 50
    level.start()  # at the swarm's round: ahead is a member of it
    mine = level.slow.clone()
    level.catch_up()
    assert level.round == ahead.round and torch.equal(level.slow, mine)
    model = tiny_model(5)
    behind = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), transports[1], every=10)
    behind._round_start = 0  # (as `start` leaves a peer that found nobody ahead: ahead came later)
    behind.catch_up()
    assert (behind.round, ahead.round) == (5, 5)
    assert torch.equal(behind.slow, ahead.slow) and torch.equal(behind.momentum, ahead.momentum)
    assert torch.equal(flat(behind.model), ahead.slow)


def test_a_newcomer_joins_the_round_under_way_when_at_most_half_of_it_is_done_else_trains_it_as_an_onlooker(
        make_swarm, caplog):
    transports = make_swarm(4)
    protocols = make_protocols(transports[:2], DiLoCo, every=10)
    gen = torch.Generator().manual_seed(5)
    two_random_rounds(protocols, gen)
    into_round(protocols, 4)  # 4 of round 2's 10 inner steps done
    near = []
    joining = threading.Thread(target=lambda: near.extend(make_protocols(transports[2:3], DiLoCo, seeds=[7], every=10)),
                               daemon=True)
    joining.start()
    joining.join(timeout=60)
    assert near, "the near newcomer waited for the next round"
    (near,) = near
    wait_until(lambda: all(near.transport.peer_id in p.transport.members(2) for p in protocols), 30,
               "the incumbents seeing the near newcomer's announcement of round 2")
    assert (near.round, near.step, near.donor is not None, near.onlooking) == (2, 24, True, False)  # the donor's step
    assert torch.equal(near.slow, protocols[0].slow) and torch.equal(flat(near.model), near.slow)
    into_round([*protocols, near], 6)  # 6 of 10 done (the near newcomer too: it may be the donor)
    model = tiny_model(8)
    far = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), transports[3], every=10)
    far.start()  # does not wait for round 3: trains the rest of round 2 from its φ, no member of it
    assert (far.round, far.step, far.onlooking) == (2, 26, True)
    assert torch.equal(far.slow, protocols[0].slow) and torch.equal(flat(far.model), far.slow)
    far_id = transports[3].peer_id
    wait_until(lambda: all(far_id in p.transport.members(3) for p in protocols), 30,
               "the incumbents seeing the onlooker's announcement of round 3")
    assert all(far_id not in p.transport.members(2) for p in [*protocols, near])
    before = protocols[0].slow.clone()
    fasts = [p.slow + 0.1 * torch.randn(p.slow.numel(), generator=gen) for p in [*protocols, near]]
    reports = outer_round([*protocols, near], fasts)  # round 2: the incumbents and the near newcomer
    assert [(r.complete, len(r.group), r.contributors) for r in reports] == [(True, 3, 3)] * 3, reports
    assert not torch.equal(protocols[0].slow, before)
    set_flat(far.model, far.slow + 0.1 * torch.randn(far.slow.numel(), generator=gen))  # its 4 steps of round 2
    far.step = 30
    with caplog.at_level(logging.INFO, logger="decentral.progress"):
        assert far.after_step() is None  # its round's end: it takes the members' state of round 3
    assert "caught up from round 2 to 3" in caplog.text  # by replaying round 2's average, not a download
    assert (far.round, far.step, far._round_start, far.onlooking) == (3, 30, 30, False)
    for p in [near, far, protocols[1]]:
        assert torch.equal(p.slow, protocols[0].slow) and torch.equal(p.momentum, protocols[0].momentum)
    assert torch.equal(flat(far.model), far.slow)  # it starts round 3 where the members do
    assert far._digests[3] == protocols[0]._digests[3]  # the state it offers is the members'


def wide_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(256, 256)  # 65,792 parameters: a state of 514 KiB


def hold_back_state_transfers(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """(sending, gate): from now on a state transfer sets `sending` and waits until `gate` is set (a large
    state on a slow link, whose download outlasts rounds)."""
    sending, gate = threading.Event(), threading.Event()
    real_write = state.write_tensor_message

    async def held_back(*args, **kwargs):
        sending.set()
        while not gate.is_set():
            await asyncio.sleep(0.01)
        await real_write(*args, **kwargs)

    monkeypatch.setattr(state, "write_tensor_message", held_back)
    return sending, gate


@pytest.mark.parametrize("cls, settings", [(DiLoCo, {"every": 4}), (StreamingDiLoCo, {"every": 8, "fragments": 2})])
def test_a_protocol_resumed_from_a_state_saved_mid_round_keeps_what_its_model_trained(cls, settings):
    """Its start put φ into the model, silently dropping the steps trained since the round began (Streaming DiLoCo:
    all of θ's own progress, which it never resets to φ). A newcomer that takes the swarm's state still starts from
    φ (test_late_joiner_downloads_slow_weights_momentum_and_round)."""
    x = torch.randn(8, 5)
    model = tiny_model(0)
    with cls(model, torch.optim.SGD(model.parameters(), lr=0.1), SoloTransport(), **settings) as sync:
        for _ in range(6):
            loss_step(sync, x)
    state, trained = sync.state_dict(), flat(model)
    assert not torch.equal(trained, sync.slow)
    resumed = tiny_model(1)
    set_flat(resumed, trained)
    again = cls(resumed, torch.optim.SGD(resumed.parameters(), lr=0.1), SoloTransport(), **settings)
    again.load_state_dict(state)
    with again:
        assert torch.equal(flat(resumed), trained) and torch.equal(again.slow, sync.slow) and again.step == 6


@pytest.mark.parametrize("cls, settings", [(DiLoCo, {"every": 4}), (NoLoCo, {"every": 4}), (CO2, {"every": 4}),
                                           (StreamingDiLoCo, {"every": 8, "fragments": 2})])
def test_a_run_resumed_mid_round_syncs_at_the_same_steps_as_one_never_stopped_and_ends_on_its_weights(cls, settings):
    """The resumed protocol began a new round at its resume step (step 6 of a round of 4: outer steps at 10, 14, ...
    instead of 8, 12, ...; `decentral train --resume` and a Trainer's resume_from_checkpoint after a mid-round
    checkpoint ended a round short). Stopped at step 6 and resumed, 16 steps end where 16 straight ones do."""
    x = torch.randn(8, 5)

    def train(model, sync, steps):
        with sync:
            for _ in range(steps):
                loss_step(sync, x)
            return sync.state_dict(), flat(model), (sync.step, sync.round)  # before `finish`: as a stopped run saves

    whole = tiny_model(0)
    _, expected, where = train(whole, cls(whole, torch.optim.SGD(whole.parameters(), lr=0.1), SoloTransport(),
                                          **settings), 16)
    first = tiny_model(0)
    state, weights, _ = train(first, cls(first, torch.optim.SGD(first.parameters(), lr=0.1), SoloTransport(),
                                         **settings), 6)
    resumed = tiny_model(1)
    set_flat(resumed, weights)
    again = cls(resumed, torch.optim.SGD(resumed.parameters(), lr=0.1), SoloTransport(), **settings)
    again.load_state_dict(state)
    _, ended, at = train(resumed, again, 10)
    assert at == where and (cls is StreamingDiLoCo or where == (16, 16 // settings["every"])), (at, where)
    assert torch.allclose(ended, expected, atol=1e-6), (ended - expected).abs().max()


@pytest.mark.parametrize("cls", [DiLoCo, NoLoCo, CO2])
def test_a_saved_state_of_another_model_is_refused_before_any_of_it_is_taken(cls):
    """It raised ForeignState, which speaks of the swarm's model and recipes, once the saved step and round were
    taken."""
    model = tiny_model(0)
    saved = cls(model, torch.optim.SGD(model.parameters(), lr=0.1), SoloTransport(), every=4)
    x = torch.randn(8, 5)
    with saved:
        for _ in range(9):
            loss_step(saved, x)
    wide = wide_model(0)
    ours = cls(wide, torch.optim.SGD(wide.parameters(), lr=0.1), SoloTransport(), every=4)
    with pytest.raises(ValueError, match="state is of a model with 39 trained parameters, this one has 65,792"):
        ours.load_state_dict(saved.state_dict())
    assert (ours.step, ours.round) == (0, 0) and ours.slow.numel() == 65_792


@pytest.mark.parametrize("fault", ["missing", "short"])
@pytest.mark.parametrize("cls, outer", [(DiLoCo, "momentum"), (NoLoCo, "delta"), (CO2, "momentum")])
def test_a_donors_state_without_our_outer_tensors_is_refused_with_its_reason_before_any_is_taken(cls, outer, fault):
    """A donor's state that lacked an outer tensor of ours (a peer of another version, or a liar) stopped the
    newcomer with a KeyError from deep in its replay or load; one of the wrong size, with a reshape error.
    ForeignState says what is wrong, and nothing of it is taken."""
    hub = LoopbackHub()
    donor = hub.transport()
    model = tiny_model(0)
    served = {"slow": flat(tiny_model(1))}
    if fault == "short":
        served[outer] = torch.zeros(served["slow"].numel() - 1)
    donor.offer_state({"protocol": cls.name, "round": 2, "step": 8}, served)
    donor.set_progress(8, 2)
    newcomer = cls(model, torch.optim.SGD(model.parameters(), lr=0.1), hub.transport(), every=4)
    said = (f"the {cls.name} state handed over has no {outer} \\(it has slow\\)" if fault == "missing" else
            f"the {cls.name} state handed over has 38 values of {outer}, ours 39")
    with pytest.raises(ForeignState, match=said):
        newcomer.start()
    assert newcomer.round == 0 and torch.equal(newcomer.slow, flat(tiny_model(0)))


def test_a_ddp_state_without_the_weights_or_our_optimizers_groups_is_refused_before_any_is_taken():
    """A DDP donor's grant without its weights, or with an inner optimizer state unlike ours, stopped the newcomer
    with a KeyError or torch's ValueError from its load, the weights taken already."""
    model = tiny_model(0)
    newcomer = DDP(model, torch.optim.SGD(model.parameters(), lr=0.1), LoopbackHub().transport())
    with pytest.raises(ForeignState, match=r"the ddp state handed over has no weights \(it has inner.0.momentum"):
        newcomer.load_snapshot({"param_groups": []}, {"inner.0.momentum": torch.zeros(3)})
    weights = {"weights": flat(tiny_model(1))}
    for groups in (None, [], [{"lr": 0.1}], [{**newcomer.optimizer.state_dict()["param_groups"][0], "params": [0]}]):
        with pytest.raises(ForeignState, match="the ddp state handed over has an inner optimizer state ours cannot "
                                               "take"):  # (none, no group, a group without its parameters, too few)
            newcomer.load_snapshot({"param_groups": groups}, weights)
    assert torch.equal(flat(model), flat(tiny_model(0)))  # nothing taken
    newcomer.load_snapshot({"param_groups": newcomer.optimizer.state_dict()["param_groups"]}, weights)
    assert torch.equal(flat(model), weights["weights"])


@pytest.mark.parametrize("cls", [DiLoCo, CO2])
def test_a_newcomer_whose_state_arrives_rounds_late_replays_the_rounds_since_instead_of_downloading_again(
        make_swarm, monkeypatch, cls):
    """The download of round 2's state is held back while the members average rounds 2 and 3: the newcomer
    then holds a state two rounds old (half of it from each member, both holding it). It asks for those
    rounds' averages (int8: an eighth of a download each here), one from each member (the other member, told
    at the download's start, kept them too), and applies them: it starts round 4 with the members' φ and
    momentum, bit for bit, having received one state, not two. (CO2's averages run in the background: the
    one applied at round 3's start had finished before the download began, and is kept all the same.) A CO2
    newcomer then takes the members' state once they applied the average launched without it, at its first
    boundary, by replaying that round too: no second download."""
    transports = make_swarm(3, codec="int8")
    protocols = make_protocols(transports[:2], cls, model=wide_model, every=10)
    gen = torch.Generator().manual_seed(3)
    two_random_rounds(protocols, gen)
    sending, gate = hold_back_state_transfers(monkeypatch)
    wait_until(lambda: all(heartbeat_digest(transports[2].progress().get(t.peer_id), 2) for t in transports[:2]), 30,
               "the newcomer seeing both members' digest of round 2 (each then sends a share of it)")
    late = []
    joining = threading.Thread(target=lambda: late.extend(make_protocols(transports[2:], cls, model=wide_model,
                                                                         seeds=[7], every=10)), daemon=True)
    before = transports[2].bytes_received
    joining.start()
    assert sending.wait(30), "the newcomer never asked for the state"
    wait_until(lambda: all(t.state.rounds.wanted() for t in transports[:2]), 30,
               "both members keeping the rounds after the state being downloaded")
    two_random_rounds(protocols, gen)  # rounds 2 and 3, while round 2's state is on its way
    sent, received_before_gate = [t.bytes_sent for t in transports[:2]], transports[2].bytes_received
    gate.set()
    joining.join(timeout=60)
    wait_until_senders_counted(transports[:2], sent, transports[2], received_before_gate)
    (late,) = late
    assert late.round == protocols[0].round == 4
    assert torch.equal(late.slow, protocols[0].slow) and torch.equal(late.momentum, protocols[0].momentum)
    assert torch.equal(flat(late.model), late.slow)
    state_bytes = 8 * late.slow.numel()
    received = transports[2].bytes_received - before
    assert state_bytes < received < state_bytes * 1.4, (received, state_bytes)  # one state and two int8 rounds
    one_round = late.slow.numel()  # an int8 average: a byte a value (and a scale per 256)
    least = min(t.bytes_sent - s for t, s in zip(transports[:2], sent))
    assert least > state_bytes / 2 + one_round, (least, state_bytes)  # half the state and a round from each
    if cls is CO2:
        before = transports[2].bytes_received
        co2_newcomer_takes_the_members_state_at_its_first_boundary([*protocols, late], gen)
        assert transports[2].bytes_received - before < state_bytes  # two rounds' averages, no download


def a_newcomer_two_rounds_behind(make_loopback):
    """(members, newcomer, donor, meta, tensors): two DiLoCo members at round 3 on loopback, and a newcomer that
    holds the state of round 1 it downloaded from `donor` (meta, tensors), which kept rounds 1 and 2 for it."""
    transports = make_loopback(3)
    protocols = make_protocols(transports[:2], DiLoCo, every=10)
    gen = torch.Generator().manual_seed(4)
    random_round(protocols, gen)
    donor, (meta, tensors) = transports[2].fetch_state()
    two_random_rounds(protocols, gen)
    model = tiny_model(9)
    late = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), transports[2], every=10)
    return protocols, late, donor, meta, tensors


def test_a_replayed_round_that_differs_from_its_digest_means_a_download(make_loopback):
    """Rounds replayed from the donor's kept averages give the members' state bit for bit; an average that
    does not lead to the state the donor published (a bug, or a lie) costs the newcomer a download, not a
    split replica."""
    protocols, late, donor, meta, tensors = a_newcomer_two_rounds_behind(make_loopback)
    newcomer = late.transport
    replayed = late._replayed(donor, dict(meta), {k: v.clone() for k, v in tensors.items()})
    assert replayed is not None and replayed[0]["round"] == 3
    assert all(torch.equal(replayed[1][k], v) for k, v in protocols[0].snapshot().items())
    newcomer.hub._rounds_since[donor]._chain[1].average = EncodedAverage(EXACT, [(EXACT.encode(torch.zeros(39)), 39)])
    assert late._replayed(donor, dict(meta), {k: v.clone() for k, v in tensors.items()}) is None


def test_rounds_replayed_to_another_state_than_the_donor_publishes_mean_a_download(make_loopback):
    """The rounds a donor kept name the digest of each one's result: a donor that lies consistently there (an
    average, and the digest of the state it leads to) led a newcomer to its state. The last round's result must
    also be the state the donor's heartbeat publishes for that round (what the members hold)."""
    _, late, donor, meta, tensors = a_newcomer_two_rounds_behind(make_loopback)
    newcomer = late.transport
    lied = late._replayed(donor, dict(meta), {k: v.clone() for k, v in tensors.items()}, upto=2)[1]
    other = torch.zeros(lied["slow"].numel())  # round 2's average, as the donor lists it
    late._apply_average(lied, other)
    last = newcomer.hub._rounds_since[donor]._chain[-1]
    assert last.meta["round"] == 3
    last.average, last.digest = EncodedAverage(EXACT, [(EXACT.encode(other), other.numel())]), state_digest(lied)
    assert late._replayed(donor, dict(meta), {k: v.clone() for k, v in tensors.items()}) is None


def test_inner_steps_through_the_optimizer_hooks_leave_slow_weights_alone(make_swarm):
    """Regression: θ must be a copy of φ, or every inner step also moves φ and the outer gradient is 0."""
    (p,) = make_protocols(make_swarm(1), DiLoCo, every=4, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    start = p.slow.clone()
    x = torch.randn(8, 5)
    with p:
        for _ in range(3):
            p.model(x).pow(2).sum().backward()
            p.optimizer.step()
            p.optimizer.zero_grad()
        assert torch.equal(p.slow, start)
        fast = flat(p.model)
        assert not torch.equal(fast, start)
        p.model(x).pow(2).sum().backward()
        p.optimizer.step()  # the 4th step is an outer step: alone, with lr 1 and no momentum, φ ← θ
        fast = flat(p.model)
    assert p.round == 1
    assert not torch.equal(p.slow, start)
    torch.testing.assert_close(p.slow, fast, rtol=0, atol=1e-6)


def test_a_protocol_is_entered_once_and_an_optimizer_hooked_by_one_protocol_at_a_time():
    """Entering a protocol again started its run again (θ back to φ: the round's progress lost, silently), and a
    second protocol on a hooked optimizer stepped with the first: both are refused, and nothing is hooked twice."""
    model = tiny_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 5)
    sync = DiLoCo(model, optimizer, SoloTransport(), every=8)
    with sync:
        with pytest.raises(RuntimeError, match="hooked by a diloco protocol already"):
            with NoLoCo(model, optimizer, SoloTransport(), every=8):
                pass
        with pytest.raises(RuntimeError, match="entered before"):
            with sync:
                pass
        for _ in range(3):
            loss_step(sync, x)
    trained = flat(model)
    with pytest.raises(RuntimeError, match="entered before"):
        with sync:
            pass
    assert torch.equal(flat(model), trained) and sync.step == 3
    with NoLoCo(model, optimizer, SoloTransport(), every=8) as other:  # the first one left: the optimizer is free
        loss_step(other, x)
    assert other.step == 1 and sync.step == 3


@pytest.mark.parametrize("cls", [DiLoCo, DDP])
def test_an_optimizer_of_another_models_parameters_or_a_model_with_none_to_train_is_refused(cls):
    """The protocol syncs the model's parameters: an optimizer that trains others' left them unchanged, and the
    protocol synced a model nobody trained, silently; a model with nothing to train failed in torch.cat."""
    model, other = tiny_model(0), tiny_model(1)
    with pytest.raises(ValueError, match="the optimizer holds 4 parameter.s. that are not the model's"):
        cls(model, torch.optim.SGD(other.parameters(), lr=0.1), SoloTransport())
    frozen = tiny_model(0).requires_grad_(False)
    with pytest.raises(ValueError, match="the model has no parameters that require grad"):
        cls(frozen, torch.optim.SGD(frozen.parameters(), lr=0.1), SoloTransport())
    part = cls(model, torch.optim.SGD(model[0].parameters(), lr=0.1), SoloTransport())  # part of the model: its own
    assert part.params == list(model.parameters())


@pytest.mark.parametrize("cls", [DiLoCo, DDP])
def test_a_parameter_unfrozen_after_the_protocol_was_made_is_refused_at_the_next_step(cls):
    """It trained but was never synced (the protocol syncs the parameters that required grad when it was made):
    each replica's copy of it drifted apart without a word. One frozen since stays synced: no error."""
    model = tiny_model(0)
    model[0].requires_grad_(False)  # frozen for the first steps
    x = torch.randn(8, 5)
    settings = {"every": 2} if cls is DiLoCo else {}
    with cls(model, torch.optim.SGD(model.parameters(), lr=0.1), SoloTransport(), **settings) as sync:
        loss_step(sync, x)
        model[2].bias.requires_grad_(False)
        loss_step(sync, x)
        model[0].requires_grad_(True)
        with pytest.raises(RuntimeError, match=r"2 parameter\(s\) of the model require grad now that did not when the "
                                               rf"{cls.name} protocol was made \(0.weight, 0.bias\)"):
            loss_step(sync, x)
    assert sync.step == 2


@pytest.mark.parametrize("cls, settings", [(DiLoCo, {}), (CO2, {}), (StreamingDiLoCo, {"every": 6, "fragments": 3}),
                                           (NoLoCo, {})])
def test_a_parameter_frozen_mid_run_takes_no_outer_momentum(make_loopback, cls, settings):
    """Frozen at a round's end, a parameter has no progress to sync from then on; the outer momentum kept moving
    it, round after round (Streaming's mixing too, towards φ). Now it holds still once the steps under way landed
    (CO2's lands a round late); NoLoCo's pair still pulls its two copies together, about their mean."""
    protocols = make_protocols(make_loopback(2), cls, **{"every": 4, **settings})
    x = torch.randn(8, 5)

    def train(rounds):
        run_in_threads([lambda p=p: [loss_step(p, x) for _ in range(rounds * p.every)] for p in protocols])

    with protocols[0], protocols[1]:
        train(3)
        for p in protocols:
            p.model[0].weight.requires_grad_(False)
        train(2)
        held = [p.model[0].weight.detach().clone() for p in protocols]
        train(3)
    now = [p.model[0].weight.detach() for p in protocols]
    if cls is NoLoCo:
        torch.testing.assert_close(now[0] + now[1], held[0] + held[1], rtol=0, atol=1e-6)
    else:
        assert all(torch.equal(a, b) for a, b in zip(now, held))


def test_ddp_leaves_a_parameter_frozen_since_the_protocol_was_made_alone_as_the_plain_loop_does():
    """A frozen parameter has no gradient, so AdamW skips it. DDP gave it a zero gradient to average, and AdamW's
    weight decay (and its moments) moved the frozen weights at every step."""
    x = torch.randn(8, 5)
    plain = tiny_model(0)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.1, weight_decay=0.5)
    model = tiny_model(0)
    with DDP(model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5), SoloTransport()) as sync:
        for step in range(3):
            if step == 1:
                plain[0].requires_grad_(False)
                model[0].requires_grad_(False)
            plain(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            loss_step(sync, x)
    assert torch.equal(flat(model), flat(plain))


def test_ddp_under_fp16_loss_scaling_averages_a_skipped_step_with_the_replicas_next_one_and_stays_identical(
        make_loopback):
    """fp16's loss scaler checks each replica's gradients before the optimizer step, where DDP averages them: a
    replica whose gradients overflow skips the step (and its protocol step) alone. The others' average of that
    step waits for its next one, and every replica applies the same gradients: identical weights and AdamW state,
    each at the protocol's step 6, the one that skipped after one more iteration."""
    protocols = make_protocols(make_loopback(2), DDP,
                               optimizer=lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1))
    xs = [torch.randn(8, 5, generator=torch.Generator().manual_seed(s)) for s in range(8)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in protocols]

    def train(p, scaler, overflow_at):
        iterations = 0
        with p:
            while p.step < 6:
                x = xs[iterations] * (1e6 if iterations == overflow_at else 1.0)  # inf in float16
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = p.model(x).pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(p.optimizer)
                scaler.update()
                p.optimizer.zero_grad()
                iterations += 1
        return iterations

    done = run_in_threads([lambda: train(protocols[0], scalers[0], 3), lambda: train(protocols[1], scalers[1], None)])
    assert done == [7, 6] and scalers[0].get_scale() < scalers[1].get_scale()  # replica 0 skipped one
    assert torch.equal(flat(protocols[0].model), flat(protocols[1].model))
    states = [p.optimizer.state_dict()["state"] for p in protocols]
    assert all(torch.equal(states[0][k]["exp_avg"], states[1][k]["exp_avg"]) for k in states[0])


def test_an_optimizer_stepped_outside_the_with_block_of_the_protocol_made_for_it_is_refused():
    """Without its `with` block a protocol hooks nothing: the loop trained alone and never synced, without a word.
    A protocol dropped unused, or one that ran its block, leaves the optimizer free."""
    model, x = tiny_model(0), torch.randn(8, 5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = DiLoCo(model, optimizer, SoloTransport(), every=2)
    before = flat(model)
    with pytest.raises(RuntimeError, match="a diloco protocol was made for this optimizer, but its `with` block was "
                                           "not entered"):
        loss_step(sync, x)
    assert torch.equal(flat(model), before)  # refused before the step
    del sync
    gc.collect()
    model(x).pow(2).mean().backward()
    optimizer.step()  # the dropped protocol guards nothing
    with DiLoCo(model, optimizer, SoloTransport(), every=2) as sync:
        loss_step(sync, x)
    optimizer.step()  # after its block: the plain loop again
    assert sync.step == 1


def test_a_local_protocol_which_syncs_nothing_lets_a_parameter_be_unfrozen():
    """Experts trained alone (`local`) may unfreeze gradually: there is no replica for their copies to drift from."""
    model = tiny_model(0)
    model[0].requires_grad_(False)
    x = torch.randn(8, 5)
    with Local(model, torch.optim.SGD(model.parameters(), lr=0.1), SoloTransport()) as sync:
        loss_step(sync, x)
        model[0].requires_grad_(True)
        loss_step(sync, x)
    assert sync.step == 2


class MixedPrecision(torch.nn.Module):
    """A bfloat16 layer, then a float32 one (as models that keep some modules in float32)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.low, self.high = torch.nn.Linear(5, 4).to(torch.bfloat16), torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.high(torch.tanh(self.low(x.to(torch.bfloat16))).float())


@pytest.mark.parametrize("cls, settings", [(DiLoCo, {"every": 2, "outer_lr": 1.0, "outer_momentum": 0.0}), (DDP, {})])
def test_a_model_of_bfloat16_and_float32_layers_keeps_each_layers_dtype_and_precision(cls, settings):
    """Alone, a protocol trains as the plain loop does (DiLoCo with outer lr 1 and no momentum ends its round on θ,
    DDP steps on our own gradient), and a newcomer takes the state with each layer's dtype. DiLoCo rounded the
    float32 layer to bfloat16 at every round (θ ← φ was cast to the first parameter's dtype); DDP failed at its first
    step (a gradient of the wrong dtype), and its newcomer's bfloat16 layer became float32."""
    x = torch.randn(8, 5)
    plain = MixedPrecision()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(2):
        plain(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model = MixedPrecision()
    with cls(model, torch.optim.SGD(model.parameters(), lr=0.1), SoloTransport(), **settings) as sync:
        for _ in range(2):
            loss_step(sync, x)
    assert sync.step == 2 and [p.dtype for p in model.parameters()] == [p.dtype for p in plain.parameters()]
    for ours, theirs in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    newcomer = MixedPrecision()
    joined = cls(newcomer, torch.optim.SGD(newcomer.parameters(), lr=0.1), SoloTransport(), **settings)
    joined.load_snapshot(sync._offered_meta(), sync.snapshot())
    joined._on_rejoined()
    assert [p.dtype for p in newcomer.parameters()] == [p.dtype for p in plain.parameters()]
    for ours, theirs in zip(newcomer.parameters(), model.parameters()):
        assert torch.equal(ours, theirs)


def test_non_finite_local_weights_are_never_sent(make_swarm):
    (p,) = make_protocols(make_swarm(1), DiLoCo, every=3)
    sent = p.transport.bytes_sent
    fast = p.slow.clone()
    fast[0] = float("nan")
    set_flat(p.model, fast)
    p.step = p.every
    with pytest.raises(DivergedError):
        p.after_step()
    assert p.transport.bytes_sent == sent
    assert torch.isfinite(p.slow).all()


def test_a_diloco_replica_that_split_is_repaired_from_the_majority(make_peers):
    protocols = make_protocols(make_peers(3), DiLoCo, every=10, outer_lr=0.7, outer_momentum=0.9)
    gen = torch.Generator().manual_seed(3)
    n = protocols[0].slow.numel()
    random_round(protocols, gen)
    split = protocols[2]  # as if it had missed the commit of round 0: other φ and momentum than the others
    split.slow += 0.05 * torch.randn(n, generator=gen)
    split.momentum.zero_()
    split._offer()  # it publishes the digest of what it holds after round 1, as at its boundary
    reports = random_round(protocols, gen)
    assert [r.repaired for r in reports] == [False, False, True]
    assert reports[0].spread == reports[1].spread == 0.0 and reports[2].spread > 0.0
    for p in protocols[1:]:
        assert torch.equal(p.slow, protocols[0].slow) and torch.equal(p.momentum, protocols[0].momentum)
        assert torch.equal(flat(p.model), p.slow)
    assert len({r.digest for r in reports}) == 1


def sees_only(protocol, peers: list, rounds: set[int]) -> None:
    """From now on, `protocol`'s lookups of `rounds`' members list only the peers of `peers` (protocols)."""
    ids = sorted(p.transport.peer_id for p in peers)
    members = protocol.transport.members
    protocol.transport.members = lambda round: ids if round in rounds else members(round)


@pytest.mark.parametrize("cls", [DiLoCo, CO2])
def test_a_member_whose_lookup_missed_a_member_takes_the_others_state_at_that_boundary_by_replaying_it(
        make_swarm, cls):
    """Its lookup of round 1's members misses the third member, which the others see (a newcomer's
    announcement that reached them and not it): its part and theirs are rejected ("averages over another
    member list") and the two others commit without it. It takes their state once they applied that average
    (DiLoCo at that boundary, CO2 at the next), by replaying it on the state it began the round with, which
    every member keeps (int8: an eighth of φ and momentum; before, it downloaded their whole state). The two
    others took part in the average they committed, and repair nothing (CO2's did: its redo's group had
    dropped the third member, so the third's "another member list" looked like half of theirs)."""
    transports = make_swarm(3, codec="int8")
    protocols = make_protocols(transports, cls, model=wide_model, every=10, outer_lr=0.7, outer_momentum=0.9)
    gen = torch.Generator().manual_seed(4)
    random_round(protocols, gen)
    blind = protocols[0]
    sees_only(blind, protocols[:2], {1})
    if cls is CO2:  # round 1's average, in flight, is applied at the next boundary
        random_round(protocols, gen)
    before = transports[0].bytes_received
    reports = random_round(protocols, gen)
    assert [(r.complete, r.contributors) for r in reports[1:]] == [(True, 2)] * 2
    assert reports[0].repaired and not reports[1].repaired and not reports[2].repaired
    for p in protocols[:2]:
        assert torch.equal(p.slow, protocols[2].slow) and torch.equal(p.momentum, protocols[2].momentum)
    assert len({r.digest for r in reports}) == 1
    state_bytes = 8 * blind.slow.numel()
    assert transports[0].bytes_received - before < state_bytes / 2  # its parts and one int8 round, no state


def test_a_member_left_alone_by_a_split_that_rolled_back_everywhere_downloads_nothing(make_swarm):
    """As above, but the third member is gone: the other member's average rolls back too, so both hold the
    state they began the round with. Taking the other's state then costs no download."""
    transports = make_swarm(3)
    protocols = make_protocols(transports, DiLoCo, model=wide_model, every=10, outer_lr=0.7, outer_momentum=0.9)
    gen = torch.Generator().manual_seed(4)
    random_round(protocols, gen)
    blind, other = protocols[:2]
    sees_only(blind, [blind, other], {1})
    sees_only(other, protocols, {1})
    transports[2].close()
    before = transports[0].bytes_received
    reports = random_round([blind, other], gen)
    assert [r.rolled_back for r in reports] == [True, True]
    assert reports[0].spread == 0.0 and not reports[0].repaired
    assert torch.equal(blind.slow, other.slow) and torch.equal(blind.momentum, other.momentum)
    assert transports[0].bytes_received - before < 8 * blind.slow.numel() / 2  # parts, no state


@pytest.mark.parametrize("cls", [DiLoCo, CO2])
@pytest.mark.parametrize("second_try_commits", [True, False])
def test_a_runs_last_average_that_rolled_back_everywhere_is_tried_again_at_the_end_or_dropped(
        make_swarm, cls, second_try_commits):
    """The run's last average rolls back for both members left (their lookups of its members differ, the third
    member is gone). Leaving the protocol, they average what it held once more, over the members of a round of
    its own, and apply it; if that rolls back as well, both drop that progress. Either way the two end on the
    same φ and momentum, their models on it (before, each ended on φ plus its own last round). Outer lr 1 and
    no momentum: φ goes down by each committed average, the mean of its members' outer gradients."""
    transports = make_swarm(3)
    kwargs = {"clip": None} if cls is CO2 else {}
    protocols = make_protocols(transports, cls, every=10, outer_lr=1.0, outer_momentum=0.0, **kwargs)
    blind, other, gone = protocols
    gen = torch.Generator().manual_seed(13)
    phi = blind.slow.clone()
    sent = [0.1 * torch.randn(phi.numel(), generator=gen) for _ in protocols]  # each one's outer gradient
    outer_round(protocols, [flat(p.model) - g for p, g in zip(protocols, sent)])
    if cls is CO2:  # round 0's average, in flight, is applied at the next boundary: over all three
        for p in protocols:
            assert p.in_flight.future.result().complete
    last = blind.round  # the round whose average rolls back: DiLoCo's round 1, CO2's round 1 (applied at the end)
    again = last + 1 if cls is DiLoCo else last + 2  # the second try's round: CO2 closes the applied one first
    split = {last} | (set() if second_try_commits else {again})  # each one's average of these rolls back: the
    sees_only(blind, [blind, other], split)  # other's part is over another member list, the third is gone, and
    sees_only(other, protocols, split)  # one member is too few to redo it
    gone.transport.close()
    phi = phi - torch.stack(sent).mean(0)  # round 0's average, over all three
    last_sent = [0.1 * torch.randn(phi.numel(), generator=gen) for _ in range(2)]
    reports = outer_round([blind, other], [flat(p.model) - g for p, g in zip((blind, other), last_sent)])
    if cls is DiLoCo:
        assert [r.rolled_back for r in reports] == [True, True]
    run_in_threads([blind.finish, other.finish])
    if second_try_commits:
        phi = phi - torch.stack(last_sent).mean(0)
    for p in (blind, other):
        torch.testing.assert_close(p.slow, phi, rtol=0, atol=1e-5)
        assert torch.equal(p.slow, blind.slow) and torch.equal(p.momentum, blind.momentum)
        assert torch.equal(flat(p.model), p.slow)
        assert p.round == again + 1


@pytest.mark.parametrize("cls", [DiLoCo, CO2])
def test_a_member_the_runs_last_average_left_out_ends_on_the_others_state_without_its_own_progress(make_swarm, cls):
    """The run's last average commits over two members without the third (its lookup missed one of them). It
    takes their state (DiLoCo at that boundary, CO2 when the average in flight is applied at the end) and,
    leaving the protocol, drops the progress no average counted: all three end on one φ, momentum and model."""
    transports = make_swarm(3)
    protocols = make_protocols(transports, cls, every=10)
    gen = torch.Generator().manual_seed(14)
    random_round(protocols, gen)
    blind = protocols[0]
    sees_only(blind, protocols[:2], {1})
    reports = random_round(protocols, gen)
    if cls is DiLoCo:
        assert reports[0].repaired and [r.complete for r in reports] == [False, True, True]
    run_in_threads([p.finish for p in protocols])
    for p in protocols:
        assert torch.equal(p.slow, blind.slow) and torch.equal(p.momentum, blind.momentum)
        assert torch.equal(flat(p.model), p.slow)


def fall_a_round_behind(protocols, gen) -> None:
    """Protocols 0 and 1 end round 1 between themselves while protocol 2, a round behind, holds another state
    than theirs of round 1 (as if it had missed round 0's commit) and has not reached its boundary."""
    n = protocols[0].slow.numel()
    random_round(protocols, gen)
    ahead, late = protocols[:2], protocols[2]
    late.slow += 0.05 * torch.randn(n, generator=gen)
    late._offer()
    pair = sorted(p.transport.peer_id for p in ahead)
    for p in ahead:
        members = p._members
        p._members = lambda round, members=members: pair if round == 1 else members(round)
    random_round(ahead, gen)
    assert [p.round for p in protocols] == [2, 2, 1]


@pytest.mark.parametrize("cls, lead", [(DiLoCo, 1), (StreamingDiLoCo, 1), (DDP, 2), (CO2, 2), (NoLoCo, 2)])
def test_an_average_of_a_round_further_ahead_than_a_protocols_lead_goes_on_without_the_member_one_within_waits(
        make_loopback, cls, lead):
    """A member in step has begun round r's average before any member begins r + 1's, except in CO2 (a
    member launches r + 1's before it waits for r's, which needs the part of one that began r − 1), NoLoCo
    (pairs wait only for each other) and DDP (a newcomer's first step can open the round after its offered
    state's). A member just started has begun none (round −1): an average of round `lead` goes on without
    it at once (as for one woken from a freeze behind the others), one of round `lead` − 1 waits for it."""
    a, b = make_loopback(2)
    (protocol,) = make_protocols([a], cls)
    assert protocol.round == 0
    group, numel = sorted([a.peer_id, b.peer_id]), 4
    within = b.average_async(torch.ones(numel), group, "within", round=lead - 1)
    past = b.average_async(torch.ones(numel), group, "past", round=lead)
    assert past.done() and not past.result().complete and past.result().absent == [a.peer_id]
    assert not within.done()  # a may still reach it
    a.average(torch.full((numel,), 3.0), group, "within", round=lead - 1)
    assert within.result(timeout=1).complete and torch.equal(within.result().tensor, torch.full((numel,), 2.0))


@pytest.mark.parametrize("cls", [DiLoCo, CO2])
def test_a_replica_a_round_behind_the_majority_joins_them_where_they_are(make_peers, cls):
    """Its repair asks for the majority's state of round 1, which they no longer serve: it takes their
    state of round 2 at their step (once, not a download per poll until the repair times out), and from
    the next round on the three hold one state."""
    protocols = make_protocols(make_peers(3), cls, every=10, outer_lr=0.7, outer_momentum=0.5)
    gen = torch.Generator().manual_seed(11)
    fall_a_round_behind(protocols, gen)
    late = protocols[2]
    late.repair_timeout_s = 10.0
    spread = late._repair({p.transport.peer_id for p in protocols[:2]})
    assert spread is not None and spread > 0
    assert (late.round, late.step) == (2, protocols[0].step)
    assert torch.equal(late.slow, protocols[0].slow) and torch.equal(late.momentum, protocols[0].momentum)
    reports = random_round(protocols, gen)
    assert [p.round for p in protocols] == [3, 3, 3]
    assert len({r.digest for r in reports}) == 1
    assert all(torch.equal(p.slow, protocols[0].slow) for p in protocols)


def test_a_repair_that_outlasts_rounds_replays_them_and_joins_the_members_where_they_are(make_swarm, monkeypatch):
    """A replica whose state split is repaired by a download held back while the other two average two more
    rounds (a large state over a slow link) holds, once it arrives, their state of a round they left behind.
    It replays the rounds since and joins them at their round and step, bit for bit, having received one
    state (before, it went on from that old round: late for their next average, left out of it, and repaired
    again, round after round)."""
    transports = make_swarm(3, codec="int8")
    protocols = make_protocols(transports, DiLoCo, model=wide_model, every=10, outer_lr=0.7, outer_momentum=0.5)
    gen = torch.Generator().manual_seed(5)
    random_round(protocols, gen)
    ahead, late = protocols[:2], protocols[2]
    late.slow += 0.05 * torch.randn(late.slow.numel(), generator=gen)
    late._offer()  # it publishes the digest of another state of round 1 than theirs
    pair, rounds = sorted(p.transport.peer_id for p in ahead), {late.round, late.round + 1}
    for p in ahead:  # they average rounds 1 and 2 without it (it is busy repairing)
        members = p._members
        p._members = lambda round, members=members: pair if round in rounds else members(round)
    sending, gate = hold_back_state_transfers(monkeypatch)
    late.repair_timeout_s = 60.0
    spreads, before = [], transports[2].bytes_received
    repairing = threading.Thread(target=lambda: spreads.append(late._repair(set(pair))), daemon=True)
    repairing.start()
    assert sending.wait(30), "the repair never asked for the state"
    wait_until(lambda: all(t.state.rounds.wanted() for t in transports[:2]), 30,
               "both members keeping the rounds after the state being downloaded")
    two_random_rounds(ahead, gen)
    gate.set()
    repairing.join(timeout=60)
    assert spreads and spreads[0] > 0
    assert (late.round, late.step) == (ahead[0].round, ahead[0].step) == (3, 30)
    assert torch.equal(late.slow, ahead[0].slow) and torch.equal(late.momentum, ahead[0].momentum)
    state_bytes = 8 * late.slow.numel()
    assert transports[2].bytes_received - before < 1.4 * state_bytes  # one state and two int8 rounds, no second
    wait_until(lambda: all(late.transport.peer_id in p.transport.members(3) for p in ahead), 30,
               "the members seeing its announcement of round 3")
    reports = random_round(protocols, gen)
    assert [p.round for p in protocols] == [4, 4, 4]
    assert len({r.digest for r in reports}) == 1 and all(r.complete for r in reports[:2])


def test_a_repair_whose_donors_all_left_gives_up_without_waiting_out_its_timeout(make_peers):
    """A newcomer in a run's last round finds the members gone once they have finished: nobody will serve
    their state, and waiting out `repair_timeout_s` only delays the end of its run."""
    protocols = make_protocols(make_peers(3), DiLoCo, every=10)
    late = protocols[2]
    late.slow += 1.0
    late._offer()
    late.repair_timeout_s = 60.0
    for p in protocols[:2]:
        p.transport.close()
    assert late._repair({p.transport.peer_id for p in protocols[:2]}) is None
    assert late.wait_s < late.repair_timeout_s / 2


def test_a_join_request_waits_for_the_donors_answer_and_a_peer_that_takes_none_refuses_it(make_peers):
    """A peer whose protocol never asked for join requests (not DDP) refuses one without queuing it; once it
    takes them, the newcomer gets what it grants: a refusal, or the state."""
    donor, newcomer = make_peers(2)
    assert newcomer.request_join(donor.peer_id) is None
    assert donor.join_requests() == []  # the refused request was never queued
    state = ({"protocol": "ddp", "round": 0, "step": 0, "joined_step": 7}, {"weights": torch.arange(5.0)})
    for answer in (None, state):
        got, requests = [], []
        asking = threading.Thread(target=lambda: got.append(newcomer.request_join(donor.peer_id)))
        asking.start()
        wait_until(lambda: requests.extend(donor.join_requests()) or requests, 30, "the request reaching the donor")
        assert [r.peer for r in requests] == [newcomer.peer_id] and requests[0].waiting
        requests[0].grant(answer)
        asking.join(timeout=30)
        assert got[0] is None if answer is None else (got[0][0]["joined_step"] == 7
                                                      and torch.equal(got[0][1]["weights"], state[1]["weights"]))


def test_a_ddp_newcomer_joins_at_the_next_step_continues_the_swarms_step_and_ends_bit_identical(make_peers):
    """Two members train; a newcomer (its own weights differ) arrives in the middle of an epoch. Its donor
    takes its request at some step and names it in that step's average; the newcomer's first step is the
    next one, long before the next epoch boundary, and from then on all three hold one state."""
    transports = make_peers(3)
    every, steps, arrive = 20, 60, 22
    data = torch.Generator().manual_seed(4)
    batches = [(torch.randn(16, 5, generator=data), torch.randn(16, 3, generator=data)) for _ in range(steps)]
    started, midway, asked = threading.Barrier(2), threading.Barrier(3), threading.Event()
    made, taken = {}, []
    for index, seed in enumerate((0, 0, 7)):  # models made here, one after the other: the RNG is global
        model = tiny_model(seed)
        made[index] = DDP(model, torch.optim.AdamW(model.parameters(), lr=1e-2), transports[index], membership_every=every)

    def noting_the_step(ddp):  # ddp's transport's join_requests, noting the step at which it took one
        take = ddp.transport.join_requests

        def join_requests():
            got = take()
            if got:
                taken.append(ddp.step)
            return got
        return join_requests

    for ddp in made.values():
        ddp.transport.join_requests = noting_the_step(ddp)
    ask = made[2].transport.request_join

    def request_join(donor):  # the members go on past `arrive` once the newcomer asks
        asked.set()
        return ask(donor)
    made[2].transport.request_join = request_join

    def train(index):
        ddp = made[index]
        reports = {}
        with ddp:
            first = ddp.step
            if index < 2:  # neither trains before both started: they begin as members of epoch 0
                started.wait(timeout=60)
            while ddp.step < steps:
                if index < 2 and ddp.step == arrive:
                    midway.wait(timeout=60)
                    assert asked.wait(60)
                x, y = batches[ddp.step]
                torch.nn.functional.mse_loss(ddp.model(x), y).backward()
                ddp.optimizer.step()
                ddp.optimizer.zero_grad()
                report = ddp.pop_report()
                if report is not None:
                    reports[ddp.round] = report
        return first, reports

    def late():
        midway.wait(timeout=60)
        return train(2)

    (first0, reports0), (first1, _), (joined, reports) = run_in_threads(
        [lambda: train(0), lambda: train(1), late], timeout=120)
    assert first0 == first1 == 0
    assert len(taken) == 1 and joined == taken[0] + 1  # the step after the donor took its request
    assert arrive < joined < 2 * every  # not the next epoch boundary (40), where it joined before
    assert len(reports0[2].group) == len(reports[2].group) == 3 and reports[2].complete
    assert not any(r.repaired for r in [*reports0.values(), *reports.values()])  # one state from its first step
    assert len({r.digest for r in (reports0[3], reports[3])}) == 1
    for index in (1, 2):
        assert made[index].step == steps
        assert torch.equal(flat(made[index].model), flat(made[0].model))
        ours, theirs = made[index].optimizer.state_dict()["state"], made[0].optimizer.state_dict()["state"]
        assert all(torch.equal(ours[i]["exp_avg_sq"], theirs[i]["exp_avg_sq"]) for i in theirs)


def test_a_ddp_member_naming_a_made_up_newcomer_adds_nobody_to_the_group(make_peers):
    """A member's note names a peer id that has no heartbeat: nobody adds it (no step waits for it), and the
    request is refused."""
    made = []
    for t in make_peers(2):
        model = tiny_model(0)
        made.append(DDP(model, torch.optim.SGD(model.parameters(), lr=0.1), t, membership_every=100))
    made_up = JoinRequest("QmNobodyHasThisPeerIdInTheSwarm", Future())
    requests = made[0].transport.join_requests
    made[0].transport.join_requests = lambda: requests() + ([made_up] if made[0].step == 1 else [])
    data = torch.Generator().manual_seed(3)
    batches = [torch.randn(8, 5, generator=data) for _ in range(4)]
    started = threading.Barrier(2)

    def train(ddp):
        groups = []
        with ddp:
            started.wait(timeout=30)  # neither trains before both started: both are members from step 0
            while ddp.step < len(batches):
                loss_step(ddp, batches[ddp.step])
                groups.append((ddp._step_report.complete, len(ddp._step_report.group)))
        return groups

    for groups in run_in_threads([lambda p=p: train(p) for p in made], timeout=60):
        assert groups == [(True, 2)] * len(batches)
    assert made_up.answer.result(timeout=0) is None
    assert torch.equal(flat(made[0].model), flat(made[1].model))


def test_a_ddp_member_that_left_costs_one_step_not_a_redo_at_every_step_of_the_epoch(make_swarm):
    """Three members; one leaves after 4 steps, in the middle of a 100-step epoch. The first average without
    it is redone by the other two; from then on their group is the two of them (before, it stayed three
    until the epoch's end, and every step's average was tried with the gone member, then redone)."""
    made = []
    for t in make_swarm(3):
        model = tiny_model(0)
        made.append(DDP(model, torch.optim.SGD(model.parameters(), lr=0.1), t, membership_every=100))
    data = torch.Generator().manual_seed(3)
    batches = [torch.randn(8, 5, generator=data) for _ in range(10)]
    started = threading.Barrier(3)

    def train(ddp, steps):
        after = []  # (the step's average committed, its group's size, the group the next step uses)
        with ddp:
            started.wait(timeout=30)
            while ddp.step < steps:
                loss_step(ddp, batches[ddp.step])
                after.append((ddp._step_report.complete, len(ddp._step_report.group), len(ddp._group)))
        if steps < len(batches):
            ddp.transport.close()
        return after

    stayed = run_in_threads([lambda p=p, n=n: train(p, n) for p, n in zip(made, (10, 10, 4))], timeout=120)
    for after in stayed[:2]:
        assert after[:4] == [(True, 3, 3)] * 4
        assert all(complete for complete, _, _ in after)
        first_without = next(i for i, (_, size, _) in enumerate(after) if size == 2)
        assert after[first_without:] == [(True, 2, 2)] * (10 - first_without)
    assert torch.equal(flat(made[0].model), flat(made[1].model))


def test_a_ddp_peer_the_others_left_out_of_their_first_epoch_takes_their_state_at_its_end(make_swarm):
    """Peers 0 and 1 fixed the members of epoch 0 before peer 2's announcement reached them (forced
    here: their view of round 0 is {0, 1}); peer 2, sure of all three, is left out of every average of
    the epoch. At the epoch's end it takes their weights and optimizer state, and from then on all
    three hold bit-identical state after every epoch.

    Peers 0 and 1 never wait for peer 2 in epoch 0, so none trains before all three have joined: a peer 2
    whose start() came after they had ended the epoch (its thread scheduled late; CI saw it once) joined at
    epoch 1 as a newcomer, with their state, never left out of anything, and gave no report of epoch 1."""
    transports = make_swarm(3)
    every, steps = 4, 16
    data = torch.Generator().manual_seed(5)
    batches = [(torch.randn(16, 5, generator=data), torch.randn(16, 3, generator=data)) for _ in range(steps)]
    made = []
    for t in transports:
        model = tiny_model(0)
        made.append(DDP(model, torch.optim.AdamW(model.parameters(), lr=1e-2), t, membership_every=every))
    for p in made:  # all hold the same state: none waits for another's epoch when it starts
        p.transport.join_rounds(0)
    ids = sorted(t.peer_id for t in transports)
    wait_until(lambda: all(p.transport.members(0) == ids for p in made), 30, "every peer seeing every announcement")
    early = sorted(t.peer_id for t in transports[:2])
    for p in made[:2]:
        members = p._members
        p._members = lambda round, members=members: early if round == 0 else members(round)
    started = threading.Barrier(len(made))

    def train(ddp):
        reports = {}
        with ddp:
            joined = (ddp.step, ddp.round)
            started.wait(timeout=60)
            while ddp.step < steps:
                x, y = batches[ddp.step]
                torch.nn.functional.mse_loss(ddp.model(x), y).backward()
                ddp.optimizer.step()
                ddp.optimizer.zero_grad()
                report = ddp.pop_report()
                if report is not None:
                    reports[ddp.round] = report
        return joined, reports

    joined, reports = zip(*run_in_threads([lambda p=p: train(p) for p in made], timeout=120))
    assert joined == ((0, 0),) * 3  # each joined at epoch 0 (nobody had trained yet)
    assert reports[2][1].repaired and not reports[0][1].repaired and not reports[1][1].repaired
    for round in range(1, steps // every + 1):
        assert len({r[round].digest for r in reports}) == 1, round
    for p in made[1:]:
        assert torch.equal(flat(p.model), flat(made[0].model))


@pytest.mark.parametrize("adaptive", [False, True])
def test_co2_steps_on_the_round_befores_average_with_the_penalty_and_a_clip_that_clips(make_peers, adaptive):
    lr, mu, penalty, clip, mix = 0.8, 0.5, 2.0, 0.04, 0.3
    protocols = make_protocols(make_peers(3), CO2, every=10, outer_lr=lr, outer_momentum=mu, penalty=penalty,
                               staleness_adaptive=adaptive, clip=clip, mix=mix)
    phi, momentum, clipped = protocols[0].slow.clone(), torch.zeros_like(protocols[0].slow), False
    stale = anchor = None  # the average in flight, and the φ it was measured from
    gen = torch.Generator().manual_seed(6)
    own_grads = [torch.zeros_like(phi)] * 3  # each one's progress φ does not hold yet
    for round in range(4):
        starts = [phi - mix * own for own in own_grads]
        fasts = [start + 0.1 * torch.randn(phi.numel(), generator=gen) for start in starts]
        reports = outer_round(protocols, fasts)
        assert all(r.complete for r in reports)
        own_grads = [start - f for start, f in zip(starts, fasts)]
        launched = torch.stack(own_grads).mean(0)
        if stale is not None:  # §4, written out: the round before's average, penalised, momentum clipped
            p = penalty * (1 + float((phi - anchor).norm()) / float(stale.norm())) if adaptive else penalty
            unclipped = mu * momentum + stale / p
            momentum = unclipped.clamp(-clip, clip)
            clipped |= not torch.equal(momentum, unclipped)
            anchor, phi = phi, phi - lr * momentum
        else:
            anchor = phi
        stale = launched
        for p, own in zip(protocols, own_grads):  # the next round starts from φ plus a share of our progress in flight
            torch.testing.assert_close(p.slow, phi, rtol=0, atol=1e-6)
            torch.testing.assert_close(p.momentum, momentum, rtol=0, atol=1e-6)
            torch.testing.assert_close(flat(p.model), phi - mix * own, rtol=0, atol=1e-6)
        assert len({r.digest for r in reports}) == 1
    assert clipped and momentum.abs().max() <= clip
    run_in_threads([p.finish for p in protocols])  # the last average, still in flight, is applied at the end
    p = penalty * (1 + float((phi - anchor).norm()) / float(stale.norm())) if adaptive else penalty
    momentum = (mu * momentum + stale / p).clamp(-clip, clip)
    for p in protocols:
        torch.testing.assert_close(p.slow, phi - lr * momentum, rtol=0, atol=1e-6)
        assert torch.equal(flat(p.model), p.slow)


def test_co2_refuses_settings_outside_their_range(make_loopback):
    (transport,) = make_loopback(1)
    model = tiny_model(0)
    for setting, why in (({"mix": 1.5}, r"mix \(α, the share of our own progress in flight"),
                         ({"penalty": 0.0}, "penalty"), ({"clip": -1.0}, "clip")):
        with pytest.raises(ValueError, match=why):
            CO2(model, torch.optim.SGD(model.parameters(), lr=0.1), transport, **setting)


@pytest.mark.parametrize("cls, setting, why", [
    (DiLoCo, {"every": 2.5}, r"every \(H, inner steps per outer step\) must be an integer >= 1, got 2.5"),
    (NoLoCo, {"every": math.inf}, "every .* must be an integer >= 1, got inf"),  # never synced, silently
    (CO2, {"every": "50"}, "every .* must be an integer >= 1, got '50'"),  # a TypeError from a comparison
    (DiLoCo, {"every": True}, "every .* must be an integer >= 1, got True"),
    (NoLoCo, {"group_size": 2.5}, r"group_size \(the peers that average together each round\) must be an integer >= 2"),
    (DDP, {"membership_every": 0.5}, "membership_every .* must be an integer >= 1, got 0.5"),
    (CO2, {"penalty": math.inf}, "penalty .* must be a finite number > 0, got inf"),  # every average scaled to 0
    (DiLoCo, {"nesterov": "no"}, "nesterov must be true or false, got 'no'"),  # a string that counted as true
    (NoLoCo, {"nesterov": 1}, "nesterov must be true or false, got 1"),
])
def test_counts_that_are_no_integers_and_flags_that_are_no_booleans_are_refused_naming_the_argument(cls, setting, why):
    """Refused at construction with a message naming the argument: they were taken (a round that never ends, a
    float where a count of peers goes) or failed on a comparison deep inside."""
    model = tiny_model(0)
    with pytest.raises(ValueError, match=why):
        cls(model, torch.optim.SGD(model.parameters(), lr=0.1), SoloTransport(), **setting)


def test_a_co2_average_runs_in_the_background_while_the_next_round_trains(make_loopback):
    first, second = make_protocols(make_loopback(2), CO2, every=4)
    x = torch.randn(8, 5)

    with first, second:
        for _ in range(4):
            loss_step(first, x)
        in_flight = first.in_flight.future
        for _ in range(3):  # training goes on, and the average waits for the second peer's part
            loss_step(first, x)
            assert not in_flight.done()
        for _ in range(4):
            loss_step(second, x)
        assert in_flight.result().complete and in_flight.result().contributors == 2
        loss_step(first, x)  # first's next boundary: the average of round 0 is applied
        assert first.round == 2 and first.momentum.abs().sum() > 0
        for _ in range(4):
            loss_step(second, x)
    assert torch.equal(first.slow, second.slow)  # leaving the block applied round 1's average on both


def record_lookups(protocols) -> tuple[list[threading.Thread], set[threading.Thread]]:
    """(threads that looked up a round's members, threads that ran a step's `after_step`) of `protocols`,
    from now on."""
    lookups, trainers = [], set()
    for p in protocols:
        members, after_step = p.transport.members, p.after_step
        p.transport.members = lambda round, members=members: (lookups.append(threading.current_thread()),
                                                              members(round))[1]
        p.after_step = lambda after_step=after_step: (trainers.add(threading.current_thread()), after_step())[1]
    return lookups, trainers


def test_a_co2_average_looks_up_its_members_off_the_training_thread(make_swarm):
    """The lookup of a round's members is a DHT read: part of the average, in the background, not of a step."""
    protocols = make_protocols(make_swarm(2), CO2, every=10)
    lookups, trainers = record_lookups(protocols)
    gen = torch.Generator().manual_seed(3)
    for round in range(3):
        reports = random_round(protocols, gen)
        assert all(r.complete and len(r.group) == (2 if round else 1) for r in reports)  # round 0: nothing applied
    run_in_threads([p.finish for p in protocols])
    assert lookups and not trainers & set(lookups)
    assert torch.equal(protocols[0].slow, protocols[1].slow)


@pytest.mark.parametrize("cls", [DiLoCo, NoLoCo])
def test_an_outer_step_looks_up_its_members_during_the_rounds_last_inner_step(make_swarm, cls):
    """DHT reads on the training thread at every boundary added to every member's wait: the lookup starts
    after the round's second-to-last step, off the training thread, and the outer step averages over it."""
    protocols = make_protocols(make_swarm(2), cls, every=4)
    lookups, trainers = record_lookups(protocols)
    started = []  # (protocol, its inner step) at each start of a lookup
    for p in protocols:
        members_async = p.transport.members_async
        p.transport.members_async = lambda round, p=p, members_async=members_async: (
            started.append((p, p.step)), members_async(round))[1]
    x = torch.randn(8, 5)

    def train(p):
        reports = []
        for _ in range(3 * p.every):
            loss_step(p, x)
            reports.append(p.pop_report())
        return [r for r in reports if r is not None]

    with protocols[0], protocols[1]:
        results = run_in_threads([lambda p=p: train(p) for p in protocols])
    for reports in results:
        assert len(reports) == 3 and all(r.complete and len(r.group) == 2 for r in reports)
    assert sorted((protocols.index(p), step) for p, step in started) == [(i, s) for i in (0, 1) for s in (3, 7, 11)]
    assert len(lookups) == 6 and not trainers & set(lookups)


def test_a_co2_average_that_did_not_commit_goes_out_again_so_nothing_trained_is_lost(make_loopback):
    transports = make_loopback(2)
    alone, leaving = make_protocols(transports, CO2, every=10, outer_lr=1.0, outer_momentum=0.0, clip=None)
    gen = torch.Generator().manual_seed(7)
    phi0 = alone.slow.clone()
    fasts = [phi0 + 0.1 * torch.randn(phi0.numel(), generator=gen) for _ in range(2)]
    outer_round([alone, leaving], fasts)  # round 0: launched by both
    grads = [torch.stack([phi0 - f for f in fasts]).mean(0)]
    for round in range(1, 4):
        start = flat(alone.model)
        fast = start + 0.1 * torch.randn(phi0.numel(), generator=gen)
        grads.append(start - fast)
        (report,) = outer_round([alone], [fast])
        if round == 1:  # round 1's average over both never commits: the other peer leaves before its part
            leaving.transport.close()
        if round == 2:
            assert not report.complete  # round 1's, applied at round 2's end: rolled back
    alone.finish()
    torch.testing.assert_close(alone.slow, phi0 - sum(grads), rtol=0, atol=1e-5)


def test_co2_progress_an_earlier_average_did_not_count_is_averaged_at_the_end_when_the_last_one_commits(
        make_loopback):
    """Round 1's average rolls back for both members (a third announced member leaves without its part), so
    each holds its part to send again; round 2's average, applied at the end (`finish`), commits. The part
    round 1's did not count is averaged then too: both end on one model, φ counting every round's mean."""
    a_t, b_t, ghost = make_loopback(3)
    members = make_protocols([a_t, b_t], CO2, every=10, outer_lr=1.0, outer_momentum=0.0, clip=None)
    ghost.join_rounds(1, first=True)
    wait_until(lambda: all(ghost.peer_id in p.transport.members(1) for p in members), 30, "the ghost announced")
    gen = torch.Generator().manual_seed(5)
    phi0, trained = members[0].slow.clone(), torch.zeros_like(members[0].slow)
    for round in range(3):
        steps = [0.1 * torch.randn(phi0.numel(), generator=gen) for _ in members]
        trained += torch.stack(steps).mean(0)
        reports = outer_round(members, [flat(p.model) + s for p, s in zip(members, steps)])
        if round == 1:
            ghost.close()  # round 1's average, launched now, rolls back for both
        if round == 2:
            assert not any(r.complete for r in reports)  # round 1's, applied at round 2's end
    run_in_threads([p.finish for p in members])
    for p in members:
        torch.testing.assert_close(p.slow, phi0 + trained, rtol=0, atol=1e-5)
        assert torch.equal(flat(p.model), p.slow)


def co2_newcomer_takes_the_members_state_at_its_first_boundary(everyone, gen) -> None:
    """Two rounds of CO2 incumbents and a newcomer (`everyone[-1]`, in its first round as a member): at the
    first boundary the incumbents apply the average launched without it and it takes their state; at the
    next all three apply the same average. All hold the same state after each."""
    for first in (True, False):
        reports = random_round(everyone, gen)
        assert [len(r.group) for r in reports] == ([2, 2, 1] if first else [3, 3, 3])  # what each applied
        assert reports[2].repaired == first
        for p in everyone:
            assert torch.equal(p.slow, everyone[0].slow) and torch.equal(p.momentum, everyone[0].momentum)
        assert len({r.digest for r in reports}) == 1


def test_a_co2_newcomer_late_in_a_round_onlooks_and_takes_the_members_state_once_they_applied_what_it_missed(
        make_peers):
    transports = make_peers(3)
    protocols = make_protocols(transports[:2], CO2, every=10)
    gen = torch.Generator().manual_seed(8)
    two_random_rounds(protocols, gen)
    into_round(protocols, 6)  # 6 of round 2's 10 inner steps: past the half a newcomer joins
    model = tiny_model(9)
    late = CO2(model, torch.optim.SGD(model.parameters(), lr=0.1), transports[2], every=10)
    late.start()
    assert (late.round, late.step, late.onlooking) == (2, 26, True)
    assert torch.equal(late.slow, protocols[0].slow) and torch.equal(flat(late.model), late.slow)
    late_id = late.transport.peer_id
    wait_until(lambda: all(late_id in p.transport.members(3) for p in protocols), 30,
               "the incumbents seeing the onlooker's announcement of round 3")
    assert all(late_id not in p.transport.members(2) for p in protocols)
    reports = random_round(protocols, gen)
    assert [len(r.group) for r in reports] == [2, 2]  # round 2 ends without it
    set_flat(late.model, late.slow + 0.1 * torch.randn(late.slow.numel(), generator=gen))
    late.step = 30
    assert late.after_step() is None  # its round's end: the members' state of round 3
    assert (late.round, late.step, late.onlooking) == (3, 30, False)
    assert torch.equal(late.slow, protocols[0].slow) and torch.equal(flat(late.model), late.slow)
    co2_newcomer_takes_the_members_state_at_its_first_boundary([*protocols, late], gen)


def test_a_co2_newcomer_whose_donor_does_not_end_the_round_stops_waiting_for_it(make_peers):
    """At its first boundary a CO2 newcomer waits for the members to end the round, to replay it (or download
    the state it led to); members that never do (hung, their heartbeats still going) cost it
    `repair_timeout_s`, not its run."""
    transports = make_peers(3)
    protocols = make_protocols(transports[:2], CO2, every=10)
    gen = torch.Generator().manual_seed(8)
    two_random_rounds(protocols, gen)
    (late,) = make_protocols(transports[2:], CO2, seeds=[9], every=10)
    late.repair_timeout_s = 0.5
    set_flat(late.model, late.slow + 0.1 * torch.randn(late.slow.numel(), generator=gen))
    late.step = late._round_start + late.every  # the members never reach their boundary
    reports = []
    boundary = threading.Thread(target=lambda: reports.append(late.after_step()), daemon=True)
    boundary.start()
    boundary.join(timeout=30)
    assert reports and not reports[0].repaired and late.round == 3
    assert late.wait_s >= late.repair_timeout_s


@pytest.mark.parametrize("cls", [DiLoCo, CO2])
def test_a_newcomer_that_takes_no_part_in_the_round_it_joined_takes_the_members_state_once_they_averaged_it(
        make_peers, cls):
    """It joined round 2 under way, then found that it takes part from round 3 on only (in the swarm: a member
    that had finished round 2 pushed to it before it joined, see GroupAverager.take_part_from). The members
    average round 2 without it; its own average of round 2 comes back at once, saying so, and it takes their
    state once they applied that average: DiLoCo at this boundary, CO2 (whose round-2 average is applied a
    round later) at the next. No member waits for it, and after each boundary all three hold one state."""
    transports = make_peers(3)
    protocols = make_protocols(transports[:2], cls, every=10)
    gen = torch.Generator().manual_seed(12)
    two_random_rounds(protocols, gen)
    into_round(protocols, 4)
    (late,) = make_protocols(transports[2:], cls, seeds=[9], every=10)
    assert (late.round, late.step, late.onlooking) == (2, 24, False)
    late.transport.join_rounds(3, first=True)
    everyone = [*protocols, late]
    for boundary in (1, 2) if cls is CO2 else (1,):
        reports = random_round(everyone, gen)
        for p in everyone:
            assert torch.equal(p.slow, everyone[0].slow) and torch.equal(p.momentum, everyone[0].momentum), boundary
        assert len({r.digest for r in reports}) == 1
        assert reports[2].repaired  # CO2's first: the state after the average launched before it joined (as ever)
    assert all(r.complete for r in reports[:2])


def test_a_co2_newcomer_takes_the_members_state_once_they_applied_the_average_it_missed(make_peers):
    transports = make_peers(3)
    protocols = make_protocols(transports[:2], CO2, every=10)
    gen = torch.Generator().manual_seed(8)
    two_random_rounds(protocols, gen)
    (late,) = make_protocols(transports[2:], CO2, seeds=[9], every=10)  # round 1's average is in flight
    assert late.round == 2 and torch.equal(late.slow, protocols[0].slow)
    wait_until(lambda: all(late.transport.peer_id in p.transport.members(2) for p in protocols), 30,
               "the incumbents seeing the newcomer's announcement of round 2")
    co2_newcomer_takes_the_members_state_at_its_first_boundary([*protocols, late], gen)
