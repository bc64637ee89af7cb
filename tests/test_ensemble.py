"""The ensemble's posterior, mixture and prior against hand-computed examples."""

import logging
import math
import re

import pytest
import torch

from decentral.experts.ensemble import (
    Ensemble, PriorCache, ensemble_nll, estimate_prior, log_posterior, mixture_scores, score_batches, top_k_prior,
)
from decentral.models import GPT, GPTConfig

# two experts, one sequence of three targets: the probability each expert gave each target
P_A = [0.5, 0.25, 0.5]
P_B = [0.25, 0.5, 0.125]


def scores():
    return torch.tensor([[P_A], [P_B]]).log()  # (k=2, batch=1, T=3)


def test_previous_token_posterior_by_hand():
    post = log_posterior(scores(), torch.tensor([0.5, 0.5]).log(), "previous").exp()[:, 0]
    # t=0: the prior; t=1: ∝ 0.5·0.5 : 0.5·0.25; t=2: ∝ 0.5·0.25 : 0.5·0.5
    expected = torch.tensor([[0.5, 2 / 3, 1 / 3], [0.5, 1 / 3, 2 / 3]])
    assert torch.allclose(post, expected, atol=1e-6)
    mixture = mixture_scores(scores(), log_posterior(scores(), torch.tensor([0.5, 0.5]).log())).exp()[0]
    assert torch.allclose(mixture, torch.tensor([0.375, 1 / 3, 0.25]), atol=1e-6)
    nll = ensemble_nll(scores(), torch.tensor([0.5, 0.5]))
    assert nll == pytest.approx(-(math.log(0.375) + math.log(1 / 3) + math.log(0.25)) / 3, rel=1e-6)


def test_prefix_posterior_and_prior_by_hand():
    prior = torch.tensor([0.8, 0.2])
    post = log_posterior(scores(), prior.log(), "prefix").exp()[:, 0]
    # t=2: ∝ 0.8·0.5·0.25 : 0.2·0.25·0.5 = 0.1 : 0.025
    assert torch.allclose(post[:, 0], prior) and torch.allclose(post[:, 2], torch.tensor([0.8, 0.2]), atol=1e-6)
    assert torch.allclose(post[:, 1], torch.tensor([0.8 * 0.5, 0.2 * 0.25]) / 0.45, atol=1e-6)
    fixed = ensemble_nll(scores(), prior, posterior=False)
    assert fixed == pytest.approx(-sum(math.log(0.8 * a + 0.2 * b) for a, b in zip(P_A, P_B)) / 3, rel=1e-6)


def test_estimate_prior_is_the_ema_of_whole_sequence_posteriors():
    batch = scores().expand(2, 2, 3)  # two sequences alike
    both = torch.stack([batch, batch], dim=1)  # (k, 2 batches, 2, 3)
    # each sequence's likelihood: A 0.5·0.25·0.5 = 1/16, B 0.25·0.5·0.125 = 1/64
    # batch 1 under the uniform prior: posterior [0.8, 0.2]; π ← 0.3·q + 0.7·π
    pi1 = 0.3 * torch.tensor([0.8, 0.2]) + 0.7 * torch.tensor([0.5, 0.5])
    w = torch.tensor([pi1[0] / 16, pi1[1] / 64])
    pi2 = 0.3 * w / w.sum() + 0.7 * pi1
    assert torch.allclose(estimate_prior(both), pi2, atol=1e-6)


def test_log_space_survives_tiny_likelihoods():
    s = torch.tensor([[[-1000.0, -1000.0, -1.0]], [[-1.0, -1.0, -1000.0]]])
    nll = ensemble_nll(s, torch.tensor([0.5, 0.5]), mode="prefix")
    assert math.isfinite(nll)
    assert torch.isfinite(log_posterior(s, torch.tensor([0.5, 0.5]).log(), "prefix")).all()


def test_top_k_and_bad_input():
    assert torch.allclose(top_k_prior(torch.tensor([0.2, 0.5, 0.3]), 2), torch.tensor([0.0, 0.625, 0.375]))
    assert torch.equal(top_k_prior(torch.tensor([0.2, 0.8]), None), torch.tensor([0.2, 0.8]))
    with pytest.raises(ValueError):
        log_posterior(scores(), torch.tensor([0.5, 0.5]).log(), "future")
    with pytest.raises(ValueError, match="prior"):
        Ensemble([GPT(GPTConfig(n_layer=1, n_head=1, d_model=8, context=8))], torch.tensor([float("nan")]))
    ensemble = Ensemble([GPT(GPTConfig(n_layer=1, n_head=1, d_model=8, context=8))])
    for tokens, said in ((torch.full((1, 4), 300), "below the experts' vocabulary, got ids up to 300"),
                         (torch.full((1, 4), -1), "ids >= 0, got -1"), (torch.rand(1, 4), "integer ids, got torch.float32")):
        with pytest.raises(ValueError, match=re.escape(said)):
            ensemble.log_probs(tokens)


def test_ensemble_module_agrees_with_scores_and_normalises():
    torch.manual_seed(0)
    experts = [GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, context=16)) for _ in range(3)]
    prior = torch.tensor([0.6, 0.3, 0.1])
    x = torch.randint(0, 256, (2, 13))
    batch = [(x[:, :-1], x[:, 1:])]
    expert_scores = torch.stack([score_batches(e, batch)[0] for e in experts])
    for mode in ("previous", "prefix"):
        log_probs = Ensemble(experts, prior, mode=mode).log_probs(x[:, :-1])
        assert torch.allclose(log_probs.exp().sum(-1), torch.ones(2, 12), atol=1e-5)
        mine = -log_probs.gather(-1, x[:, 1:, None]).mean()
        assert float(mine) == pytest.approx(ensemble_nll(expert_scores, prior, mode), rel=1e-5)
    top1 = Ensemble(experts, prior, top_k=1).log_probs(x[:, :-1])
    alone = torch.log_softmax(experts[0](x[:, :-1])[0], -1)
    assert torch.allclose(top1, alone, atol=1e-5)
    route = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    routed = Ensemble(experts).log_probs(x[:, :-1], route=route)
    assert torch.allclose(routed[1], torch.log_softmax(experts[2](x[1:, :-1])[0][0], -1), atol=1e-5)


def test_prior_cache_round_trip(tmp_path, caplog):
    cache = PriorCache(tmp_path / "priors.json")
    key = PriorCache.key(["a" * 64, "b" * 64], b"dev tokens", "16x128x8")
    assert cache.get(key) is None
    cache.put(key, [0.25, 0.75])
    assert PriorCache(tmp_path / "priors.json").get(key) == [0.25, 0.75]
    assert key != PriorCache.key(["a" * 64, "b" * 64], b"other dev tokens", "16x128x8")
    (tmp_path / "priors.json").write_text("{broken")
    with caplog.at_level(logging.WARNING):
        assert cache.get(key) is None  # a damaged cache is recomputed, not trusted, and said so once
        cache.put(key, [0.5, 0.5])
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [f"{tmp_path / 'priors.json'} is damaged"]
    assert PriorCache(tmp_path / "priors.json").get(key) == [0.5, 0.5]  # written anew
