"""The ensemble of experts: a mixture weighted by the posterior over domains, in log space.

Branch-train-merge (Li et al. 2022, arXiv 2208.03306, §3.3, after DEMix, Gururangan et al. 2022):

    p(x_t | x_<t) = Σ_j p_j(x_t | x_<t) · P(D=j | x_<t)
    P(D=j | x_<t) ∝ π_j · p_j(x_{t−1} | x_<t−1)        "previous": the last token's likelihood (default)
    P(D=j | x_<t) ∝ π_j · Π_{s<t} p_j(x_s | x_<s)       "prefix": the whole prefix's likelihood

At the first position of a sequence only the prior counts. The prior π of a target domain is
estimated on that domain's dev data: starting uniform, for each batch q = the posterior at every
sequence's end, P(D=j | the whole sequence) ∝ π_j Π_t p_j(x_t), averaged over the batch, then
π ← 0.3·q + 0.7·π (an exponential moving average); π stays fixed on test data (`estimate_prior`,
cached by `PriorCache`). The prior is a property of the domain, so it is estimated from whole
sequences whichever form the test-time posterior takes: estimated from one token's likelihood it
stays near the token-level mixture weights (measured: 0.46 for the code expert on code against 0.95
from whole sequences) and the previous-token ensemble ends up worse than its best expert. Everything
is computed with log-probabilities and logsumexp, so an expert that gives a token probability 1e-300
shifts weights without underflow.

Shapes: `scores` are per-expert log-likelihoods of the targets, (k, ..., T) with the experts first
and positions last; weights are log-probabilities of the same shape, normalised over the experts.
Evaluations score every expert once on fixed batches (`score_batches`) and then combine the scores,
so the mixture, top-k, argmax-expert and uniform variants cost no further forward passes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from decentral.data.batches import Batch

log = logging.getLogger(__name__)

MODES = ("previous", "prefix")
PRIOR_EMA = 0.3


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"posterior mode must be one of {MODES}, got {mode!r}")


@torch.no_grad()
def score_batches(model: nn.Module, batches: Sequence[Batch]) -> torch.Tensor:
    """log p(y_t | x_≤t) of every target under `model`: (num_batches, batch, T) float32 on the CPU."""
    was_training = model.training
    model.eval()
    try:
        out = []
        for x, y in batches:
            logits = model(x)[0].float()
            out.append(torch.log_softmax(logits, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1).cpu())
        return torch.stack(out)
    finally:
        model.train(was_training)


def log_posterior(scores: torch.Tensor, log_prior: torch.Tensor, mode: str = "previous") -> torch.Tensor:
    """log P(D=j | x_<t) for every expert j and position t, from the experts' `scores` (k, ..., T) and
    `log_prior` (k,); normalised over the experts (dim 0)."""
    _check_mode(mode)
    evidence = torch.zeros_like(scores)
    if mode == "previous":
        evidence[..., 1:] = scores[..., :-1]
    else:
        evidence[..., 1:] = scores[..., :-1].cumsum(-1)
    prior = log_prior.reshape(-1, *([1] * (scores.dim() - 1)))
    return torch.log_softmax(prior + evidence, dim=0)


def mixture_scores(scores: torch.Tensor, log_weights: torch.Tensor) -> torch.Tensor:
    """log Σ_j w_j p_j(y_t): the mixture's log-likelihood of every target, (...,  T)."""
    return torch.logsumexp(log_weights + scores, dim=0)


def estimate_prior(scores: torch.Tensor, ema: float = PRIOR_EMA) -> torch.Tensor:
    """π from dev-data `scores` (k, num_batches, batch, T): per batch, q = the mean over sequences of the
    posterior after the whole sequence (under the current π), then π ← ema·q + (1−ema)·π, from uniform."""
    k = scores.shape[0]
    prior = torch.full((k,), 1.0 / k, dtype=torch.float64)
    evidence = scores.double().sum(-1)  # (k, num_batches, batch): log-likelihood of each whole sequence
    for batch in range(scores.shape[1]):
        posterior = torch.softmax(prior.log()[:, None] + evidence[:, batch], dim=0)  # (k, batch)
        prior = ema * posterior.mean(dim=1) + (1 - ema) * prior
    return (prior / prior.sum()).float()


def top_k_prior(prior: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """`prior` with all but its `top_k` largest entries set to zero, renormalised (ties: lower index first)."""
    if top_k is None or top_k >= len(prior):
        return prior
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    keep = torch.zeros_like(prior)
    index = torch.argsort(prior, descending=True, stable=True)[:top_k]
    keep[index] = prior[index]
    return keep / keep.sum()


def ensemble_nll(scores: torch.Tensor, prior: torch.Tensor, mode: str = "previous", posterior: bool = True) -> float:
    """Mean negative log-likelihood per token of the mixture: weights from the posterior (or, with
    `posterior=False`, the fixed prior, e.g. uniform) over the experts whose prior is not zero."""
    used = prior > 0
    log_prior = prior[used].log()
    experts = scores[used]
    if posterior:
        log_weights = log_posterior(experts, log_prior, mode)
    else:
        log_weights = log_prior.reshape(-1, *([1] * (experts.dim() - 1))).expand_as(experts)
    return float(-mixture_scores(experts, log_weights).mean())


class Ensemble(nn.Module):
    """Next-token distributions of a mixture of experts (models with the same vocabulary).

    `prior` (k,) defaults to uniform; `top_k` keeps the experts with the largest prior. `log_probs(idx)`
    returns (B, T, vocab) log-probabilities of the mixture at every position, the posterior built from
    the tokens of `idx` itself; `route` (B, k) replaces the posterior by fixed per-sequence weights (c-BTM).
    """

    def __init__(self, experts: Sequence[nn.Module], prior: torch.Tensor | None = None, *, mode: str = "previous",
                 top_k: int | None = None):
        super().__init__()
        _check_mode(mode)
        if not experts:
            raise ValueError("an ensemble needs at least one expert")
        k = len(experts)
        prior = torch.full((k,), 1.0 / k) if prior is None else torch.as_tensor(prior, dtype=torch.float32)
        if prior.shape != (k,) or not bool(torch.isfinite(prior).all()) or bool((prior < 0).any()) or prior.sum() <= 0:
            raise ValueError(f"prior must be {k} non-negative finite numbers with a positive sum, got {prior.tolist()}")
        prior = top_k_prior(prior / prior.sum(), top_k)
        self.used = [j for j in range(k) if prior[j] > 0]
        self.experts = nn.ModuleList(experts[j] for j in self.used)
        self.register_buffer("log_prior", prior[self.used].log())
        self.mode = mode

    @torch.no_grad()
    def log_probs(self, idx: torch.Tensor, route: torch.Tensor | None = None) -> torch.Tensor:
        if idx.dim() != 2:
            raise ValueError(f"tokens must be (batch, time), got shape {tuple(idx.shape)} (one sequence: idx[None])")
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise ValueError(f"tokens must be integer ids, got {idx.dtype}")
        if idx.numel() and int(idx.min()) < 0:
            raise ValueError(f"tokens must be ids >= 0, got {int(idx.min())}")
        try:
            per_expert = torch.stack([torch.log_softmax(e(idx)[0].float(), dim=-1) for e in self.experts])  # (k,B,T,V)
        except IndexError as e:  # an embedding given an id past its vocabulary
            raise ValueError(f"tokens must be ids below the experts' vocabulary, got ids up to {int(idx.max())} "
                             f"({e})") from None
        if route is not None:
            route = torch.as_tensor(route, dtype=torch.float32, device=idx.device)[:, self.used]
            log_weights = (route / route.sum(1, keepdim=True)).log().T[:, :, None]  # (k, B, 1)
        else:
            # scores as `score_batches` gives them, the targets being idx shifted by one; the last position's
            # target is the token to come, which log_posterior never looks at
            targets = idx[None, :, 1:, None].expand(len(self.used), -1, -1, 1)
            scores = torch.zeros(per_expert.shape[:3], device=idx.device)
            scores[..., :-1] = per_expert[:, :, :-1].gather(-1, targets).squeeze(-1)
            log_weights = log_posterior(scores, self.log_prior, self.mode)
        return torch.logsumexp(log_weights[..., None] + per_expert, dim=0)


class PriorCache:
    """Estimated priors kept in a JSON file, keyed by the experts' hashes and the dev batches."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._told = False  # that the file is damaged

    @staticmethod
    def key(expert_hashes: Sequence[str], dev_tokens: bytes, batches: str) -> str:
        text = json.dumps([list(expert_hashes), hashlib.sha256(dev_tokens).hexdigest(), batches, PRIOR_EMA])
        return hashlib.sha256(text.encode()).hexdigest()

    def _read(self) -> dict:
        """The cache's entries; none when there is no file yet, or a damaged one (said once: estimates are made
        again, and the next `put` writes the file anew)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            problem = str(e)
        else:
            if isinstance(data, dict):
                return data
            problem = "not a JSON object"
        if not self._told:
            self._told = True
            log.warning("%s is damaged (%s): the priors are estimated again, and it is written anew", self.path,
                        problem)
        return {}

    def get(self, key: str) -> list[float] | None:
        value = self._read().get(key)
        ok = isinstance(value, list) and value and all(isinstance(v, (int, float)) and math.isfinite(v) for v in value)
        return [float(v) for v in value] if ok else None

    def put(self, key: str, prior: Sequence[float]) -> None:
        data = self._read()
        data[key] = [float(p) for p in prior]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.path)

