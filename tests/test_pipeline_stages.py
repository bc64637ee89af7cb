"""Cutting the reference GPT into SkipPipe stages, and putting it back together."""

from __future__ import annotations

import itertools

import pytest
import torch

from decentral.models.gpt import GPT, GPTConfig
from decentral.pipeline.evaluate import evaluate_dropping, kept_orders
from decentral.pipeline.network import NetworkError
from decentral.pipeline.stages import assemble, block_ranges, cut, make_stage, partial_loss

CONFIG = GPTConfig(n_layer=6, n_head=2, d_model=32, context=16)


def tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(seed))
    return rows[:, :-1], rows[:, 1:]


def test_blocks_are_dealt_in_order_with_the_remainder_last():
    assert block_ranges(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert block_ranges(7, 3) == [range(0, 2), range(2, 4), range(4, 7)]
    assert block_ranges(8, 6) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4), range(4, 6), range(6, 8)]
    with pytest.raises(NetworkError, match="6 stages need at least 6 transformer blocks"):
        block_ranges(4, 6)


def test_stages_in_order_compute_the_whole_model():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    stages = cut(model, 4)
    assert stages[0].embed is model.embed and stages[0].head is model.head
    assert all(s.embed is None and s.head is None for s in stages[1:])
    x, y = tokens()
    h = stages[0].begin(x)
    for stage in stages[1:]:
        h = stage(h)
    assert torch.allclose(stages[0].loss(h, y), model(x, y)[1])
    assert torch.allclose(partial_loss(model, 4, (0, 1, 2, 3), x, y), model(x, y)[1])
    assert len({id(p) for s in stages for p in s.parameters()}) == len(list(model.parameters()))


def test_a_skipped_stage_passes_the_hidden_state_unchanged_and_gets_no_gradient():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    stages = cut(model, 3)
    x, y = tokens()
    loss = partial_loss(model, 3, (0, 2), x, y)
    by_hand = stages[0].loss(stages[2](stages[0].begin(x)), y)  # stage 1 skipped: no rescaling
    assert torch.allclose(loss, by_hand)
    loss.backward()
    assert all(p.grad is None for p in stages[1].parameters())
    assert all(p.grad is not None for p in stages[2].parameters())
    with pytest.raises(NetworkError, match="must start at stage 0"):
        partial_loss(model, 3, (1, 2), x, y)


def test_replicas_start_alike_and_stages_reassemble_the_model():
    assert all(torch.equal(a, b) for a, b in zip(make_stage(CONFIG, 3, 1, seed=5).parameters(),
                                                 make_stage(CONFIG, 3, 1, seed=5).parameters()))
    torch.manual_seed(5)
    model = GPT(CONFIG)
    parts = [make_stage(CONFIG, 3, s, seed=5).global_state_dict() for s in range(3)]
    assert set(parts[1]) == {k for k in model.state_dict() if k.startswith(("blocks.2.", "blocks.3."))}
    rebuilt = assemble(CONFIG, parts)
    x, y = tokens()
    assert torch.equal(rebuilt(x, y)[1], model(x, y)[1])
    with pytest.raises(NetworkError, match="lack"):
        assemble(CONFIG, parts[:2])
    stage = make_stage(CONFIG, 3, 2, seed=9)
    stage.load_global_state_dict(model.state_dict())
    assert torch.equal(stage.global_state_dict()["blocks.5.mlp.fc.weight"], model.blocks[5].mlp.fc.weight)


def test_dropping_half_the_stages_keeps_stage_0_and_sorted_subsets():
    assert kept_orders(6, 0.5) == [(0, a, b) for a in range(1, 6) for b in range(a + 1, 6)]
    assert kept_orders(4, 0.0) == [(0, 1, 2, 3)]
    many = kept_orders(12, 0.5, draws=7, seed=3)
    assert len(many) == 7 and all(o[0] == 0 and list(o[1:]) == sorted(o[1:]) and len(o) == 6 for o in many)
    every = kept_orders(8, 0.5, draws=50)  # 35 subsets, fewer than the draws asked for: all of them, once each
    assert every == [(0, *subset) for subset in itertools.combinations(range(1, 8), 3)]
    torch.manual_seed(0)
    model = GPT(CONFIG)
    result = evaluate_dropping(model, 6, [tokens(1), tokens(2)], drop=0.5)
    assert result["kept_stages"] == 3 and result["subsets"] == 10
    assert result["full_ppl"] == pytest.approx(torch.tensor(result["full_loss"]).exp().item())
