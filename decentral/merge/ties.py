"""TIES-merging: trim, elect sign, disjoint merge (Yadav et al. 2023, arXiv 2306.01708).

With task vectors τ_i = θ_i − θ₀ and weights w_i, per tensor:

1. Trim: keep the entries of each τ_i whose magnitude is among its top `density` fraction, zero the
   rest (τ̃_i). The paper keeps the top k = 20% of each task vector, the default here.
2. Elect: per entry, the sign of the total mass, s = sign(Σ_i w_i τ̃_i).
3. Disjoint merge: per entry, the weighted mean over the experts whose trimmed value has sign s,
   m = Σ_{i: sign τ̃_i = s} w_i τ̃_i / Σ_{i: sign τ̃_i = s} w_i (zero where no expert agrees).

θ = θ₀ + λ·m. The paper tunes λ on validation data; the default λ = 1 adds the merged change in
full, as merge tools do.

Conventions (where the paper leaves a choice):
- Trimming is per tensor (as merge tools do), not over the whole flattened model as in the paper's
  code. It keeps the ⌈density·n⌉ largest magnitudes of a tensor of n entries, at least one entry,
  and also every entry tied in magnitude with the smallest kept one, so the result does not depend
  on how a sort breaks ties.
- An exact tie, Σ_i w_i τ̃_i = 0 (elected sign 0), leaves the entry at the base value (m = 0):
  the experts' changes cancel there, as they would in task arithmetic, and neither side is picked
  arbitrarily (the paper's code gives such entries the tensor-wide majority sign; mergekit counts
  0 as positive). This keeps the merge symmetric: negating every task vector negates m.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from decentral.merge.base import MergeMethod, ratios_only, weighted_sum


def trim_to_top(delta: Tensor, density: float) -> Tensor:
    """`delta`, in place, with all but its ⌈density·n⌉ largest magnitudes (and ties with the smallest of them) zeroed."""
    if density >= 1.0:
        return delta
    smallest_kept = delta.numel() - max(1, math.ceil(density * delta.numel()))  # its index in ascending order
    magnitude = delta.abs().view(-1).numpy()
    magnitude.partition(smallest_kept)  # in place and without torch.kthvalue's copy and index array
    threshold = float(magnitude[smallest_kept])
    del magnitude
    return delta.masked_fill_(delta.abs() < threshold, 0.0)


def disjoint_mean(deltas: list[Tensor], weights: list[float]) -> Tensor:
    """Elect the sign of Σ w_i δ_i per entry; the weighted mean of the δ_i that have that sign.
    Overwrites `deltas` (each keeps only its agreeing entries), to hold no more tensors than they are.

    Where the elected sign is 0 no nonzero entry agrees, so the mean is 0; where nobody agrees,
    numerator and denominator are both 0 and so is the result.
    """
    weights = ratios_only(weights)
    elected = weighted_sum(deltas, weights).sign_()
    numerator = torch.zeros_like(elected)
    denominator = torch.zeros_like(elected)
    for delta, weight in zip(deltas, weights):
        agreeing = delta.masked_fill_(delta.sign() != elected, 0.0)
        numerator.add_(agreeing, alpha=weight)
        denominator.add_(agreeing != 0, alpha=weight)
    return numerator.div_(denominator.clamp_(min=torch.finfo(denominator.dtype).tiny))


def merge_ties(base: Tensor | None, tensors: list[Tensor], weights: list[float], *, name: str,
               **params: float) -> Tensor:
    trimmed = [trim_to_top(tensor - base, params["density"]) for tensor in tensors]
    return disjoint_mean(trimmed, weights).mul_(params["lambda"]).add_(base)


TIES = MergeMethod(
    name="ties", fn=merge_ties, needs_base=True, params={"density": 0.2, "lambda": 1.0},
    checks={"density": (lambda d: 0 < d <= 1, "in (0, 1]")},
)
