"""Posterior-weighted average: BTM's collapse of a forest of experts into one model for a target
domain (Li et al. 2022, arXiv 2208.03306, §3.3 and §4.3; ALGORITHMS.md §6).

    θ = Σ_j π_j θ_j

π is the target domain's prior over the experts, estimated on its dev split exactly as the
ensemble estimates it (decentral.experts.ensemble.estimate_prior: the posterior after each whole
dev sequence, EMA 0.3 over batches) and cached in the registry's priors.json. The merge is then the
linear one with those weights. Like every average, it only works for experts that share a trained
seed. Parameter: `domain`, the target domain (a built-in name or NAME=PATH, decentral.data.domains).
Weights in the recipe are an error: the posterior sets them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from decentral.merge.base import MergeError, MergeMethod
from decentral.merge.linear import merge_linear

PRIOR_FLOOR = 1e-6  # an expert the domain never picks still gets this weight (recipe weights must be > 0)


def posterior_weights(recipe: Any) -> list[float]:
    """π of `recipe.parameters["domain"]` over the recipe's experts (cached beside the first expert)."""
    from decentral.data import DataError
    from decentral.data.domains import load_domain
    from decentral.experts.ensemble import PriorCache
    from decentral.experts.evaluate import EvalConfig, domain_prior
    from decentral.experts.registry import RegistryError, read_expert

    spec = recipe.parameters["domain"]
    if not spec:
        raise MergeError(f"{recipe.source}: parameters.domain is required: the target domain whose posterior weights "
                         "the experts (a built-in name such as legal, or NAME=PATH)")
    try:
        domain = load_domain(spec)
    except DataError as e:
        raise MergeError(f"{recipe.source}: parameters.domain: {e}") from None
    try:
        experts = [read_expert(ref.folder) for ref in recipe.experts]
    except RegistryError as e:
        raise MergeError(f"{recipe.source}: {e}") from None
    config = EvalConfig(context=experts[0].context)
    cache = PriorCache(experts[0].folder.parent / "priors.json")
    prior = domain_prior(experts, domain, config, cache)
    return [max(float(p), PRIOR_FLOOR) for p in prior]


def merge_posterior(base: Tensor | None, tensors: list[Tensor], weights: list[float], *, name: str,
                    domain: str) -> Tensor:
    """Σ_j π_j θ_j / Σ_j π_j, with `weights` the π that `posterior_weights` found."""
    return merge_linear(base, tensors, weights, name=name)


POSTERIOR = MergeMethod(
    name="posterior", fn=merge_posterior, needs_base=False, uses_weights=False, weights_from=posterior_weights,
    params={"domain": ""},
)
