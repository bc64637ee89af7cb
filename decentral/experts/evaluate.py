"""Perplexity of experts and of their ensembles on each domain's test split, priors from its dev split.

Every expert is loaded once, one at a time, and scores fixed batches of every domain
(`score_experts`); the ensemble variants are then combinations of those scores (decentral.experts.
ensemble): each expert alone, the mixtures with fixed uniform or prior weights, the argmax-prior
expert, the posterior ensemble and its top-k. Perplexity is per token (a byte here): exp(mean negative log-likelihood). With a c-BTM router the
ensemble's weights come from the router instead, fixed per window and computed from the text just
before it (`routed_report`), so no window is routed by the tokens it is scored on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decentral.data.batches import eval_starts
from decentral.data.domains import Domain
from decentral.experts.ensemble import (
    PriorCache, ensemble_nll, estimate_prior, mixture_scores, score_batches, top_k_prior,
)
from decentral.experts.registry import Expert, RegistryError
from decentral.metrics import format_table


@dataclass
class EvalConfig:
    batch_size: int = 16
    context: int = 128
    dev_batches: int = 8
    test_batches: int = 16
    mode: str = "previous"  # the test-time posterior's form: previous or prefix (decentral.experts.ensemble)
    top_k: int | None = None

    def batches_key(self) -> str:
        return f"{self.batch_size}x{self.context}x{self.dev_batches}"


ROUTE_BYTES = 1024  # how much text before a window routes it (c-BTM)


@dataclass
class DomainScores:
    dev: torch.Tensor  # (k, dev_batches, batch, context): log-likelihood of every dev target under each expert
    test: torch.Tensor


def score_experts(experts: Sequence[Expert], domains: Sequence[Domain], config: EvalConfig,
                  progress=None, splits: Sequence[str] = ("dev", "test")) -> dict[str, DomainScores]:
    """Every expert's log-likelihoods on every domain's dev and test batches (only those of `splits`;
    the others are empty); `progress(expert)` is called after each expert. RegistryError for an expert whose
    log-likelihoods are not finite (a mixture, and every prior, would be NaN)."""
    batches = {d.name: {split: d.eval_batches(split, batch_size=config.batch_size, context=config.context,
                                              num_batches=getattr(config, f"{split}_batches"))
                        for split in splits} for d in domains}
    empty = torch.empty(len(experts), 0)
    scores: dict[str, dict[str, list[torch.Tensor]]] = {d.name: {split: [] for split in splits} for d in domains}
    for expert in experts:
        model = expert.load_model()
        for name, splits in batches.items():
            for split, data in splits.items():
                scored = score_batches(model, data)
                if not torch.isfinite(scored).all():
                    raise RegistryError(f"expert {expert.name!r} gives NaN or infinite log-likelihoods on the {split} "
                                        f"split of {name} (are its weights out of range?); it cannot be evaluated")
                scores[name][split].append(scored)
        del model
        if progress:
            progress(expert)
    return {name: DomainScores(*(torch.stack(s[split]) if split in s else empty for split in ("dev", "test")))
            for name, s in scores.items()}


def domain_prior(experts: Sequence[Expert], domain: Domain, config: EvalConfig, cache: PriorCache | None = None,
                 scores: DomainScores | None = None) -> torch.Tensor:
    """The domain's prior over `experts`, estimated on its dev split from `scores` (scored here when not
    given, and not at all when `cache` holds the estimate)."""
    key = PriorCache.key([e.sha256 for e in experts], domain.dev.tobytes(), config.batches_key())
    cached = cache.get(key) if cache else None
    if cached is not None and len(cached) == len(experts):
        return torch.tensor(cached)
    if scores is None:
        scores = score_experts(experts, [domain], config, splits=("dev",))[domain.name]
    prior = estimate_prior(scores.dev)
    if cache:
        cache.put(key, prior.tolist())
    return prior


def perplexity(nll: float) -> float:
    return math.exp(nll)


def ensemble_report(experts: Sequence[Expert], domains: Sequence[Domain], scores: dict[str, DomainScores],
                    config: EvalConfig, cache: PriorCache | None = None) -> dict[str, dict]:
    """Per domain: the prior, and the test perplexity of each expert alone and of each way to combine them."""
    k = len(experts)
    report = {}
    for domain in domains:
        test = scores[domain.name].test
        prior = domain_prior(experts, domain, config, cache, scores[domain.name])
        uniform = torch.full((k,), 1.0 / k)
        best = torch.zeros(k)
        best[int(prior.argmax())] = 1.0
        rows = {f"expert {e.name}": perplexity(float(-test[j].mean())) for j, e in enumerate(experts)}
        rows["uniform mixture"] = perplexity(ensemble_nll(test, uniform, config.mode, posterior=False))
        rows["prior mixture"] = perplexity(ensemble_nll(test, prior, config.mode, posterior=False))
        rows["argmax-prior expert"] = perplexity(ensemble_nll(test, best, config.mode, posterior=False))
        rows["ensemble"] = perplexity(ensemble_nll(test, prior, config.mode))
        if config.top_k and config.top_k < k:
            rows[f"ensemble top-{config.top_k}"] = perplexity(ensemble_nll(test, top_k_prior(prior, config.top_k), config.mode))
        report[domain.name] = {"prior": prior.tolist(), "perplexity": rows}
    return report


def routed_report(router, domains: Sequence[Domain], scores: dict[str, DomainScores], config: EvalConfig
                  ) -> dict[str, dict]:
    """Per domain, the test perplexity of the c-BTM ensemble: expert j (cluster j) weighted by the router's
    softmax(−d²/T) of the `ROUTE_BYTES` before each window (top-k when `config.top_k`), and the mean weights."""
    report = {}
    for domain in domains:
        test = scores[domain.name].test  # (k, N, B, T)
        k, n, b = test.shape[:3]
        if k != router.k:
            raise ValueError(f"the router has {router.k} clusters but {k} experts were given")
        starts = eval_starts(len(domain.test), context=config.context, count=n * b)
        before = [domain.test[max(0, s - ROUTE_BYTES):s].tobytes().decode("utf-8", "replace") for s in starts]
        weights = torch.from_numpy(router.weights(before, top_k=config.top_k)).float()  # (N·B, k)
        log_weights = weights.log().T.reshape(k, n, b, 1)
        nll = float(-mixture_scores(test, log_weights).mean())
        report[domain.name] = {"weights": weights.mean(0).tolist(), "perplexity": perplexity(nll)}
    return report


def format_report(report: dict[str, dict], experts: Sequence[Expert]) -> str:
    """A text table: one row per method, one column per domain (test perplexity), then the priors."""
    domains = list(report)
    methods = list(next(iter(report.values()))["perplexity"]) if report else []
    header = ["test perplexity"] + domains
    rows = [header] + [[m] + [f"{report[d]['perplexity'][m]:.3f}" for d in domains] for m in methods]
    rows += [[f"prior of {e.name}"] + [f"{report[d]['prior'][j]:.3f}" for d in domains] for j, e in enumerate(experts)]
    return format_table(rows)
