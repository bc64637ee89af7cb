"""Linear merge: the weighted average of the experts (Wortsman et al. 2022, "Model soups", arXiv 2203.05482).

    θ = Σ_i w_i θ_i / Σ_i w_i          (normalize: true, the default: a "uniform soup" for equal weights)
    θ = Σ_i w_i θ_i                    (normalize: false, the weights are used as given)

This is also BTM's collapse of the forest into one model (Li et al. 2022, §6 of ALGORITHMS.md), with
uniform or posterior weights. Needs no base. Averaging only works for experts that share a trained
starting point (the seed); the soups paper's models are all fine-tuned from one pre-trained model.
"""

from __future__ import annotations

from torch import Tensor

from decentral.merge.base import MergeMethod, ratios_only, weighted_sum


def merge_linear(base: Tensor | None, tensors: list[Tensor], weights: list[float], *, name: str,
                 normalize: bool = True) -> Tensor:
    if not normalize:
        return weighted_sum(tensors, weights)
    weights = ratios_only(weights)
    return weighted_sum(tensors, weights).div_(sum(weights))


LINEAR = MergeMethod(name="linear", fn=merge_linear, needs_base=False, params={"normalize": True})
