"""Model stock (Jang et al. 2024, "Model Stock: All we need is just a few fine-tuned models", arXiv 2403.19522).

Per tensor, from the experts' task vectors τ_i = θ_i − θ₀ (N ≥ 2 experts):

    cos θ = mean over pairs i ≠ j of ⟨τ_i, τ_j⟩ / (‖τ_i‖ ‖τ_j‖)
    t     = N cos θ / (1 + (N − 1) cos θ)
    θ     = t · mean_i θ_i + (1 − t) · θ₀

The paper derives t for fine-tuned models that lie at equal distance from the base with equal
pairwise angles: the merged point is the one on the segment from the base to the experts' mean that
is nearest the (unknown) centre of the fine-tuned weights' distribution. Experts more alike
(cos θ → 1) give t → 1, their average; unrelated ones (cos θ → 0) give t → 0, the base.

Conventions: cos θ is clamped to [0, 1], so t stays in [0, 1] (the derivation assumes a positive
cosine; for cos θ < 0 the formula leaves the segment and has a pole at cos θ = −1/(N−1)); a zero
task vector has no direction and counts as cosine 0 in the pairs it is part of. The mean of the θ_i
is unweighted, as in the paper: the method takes no weights and no parameters.
"""

from __future__ import annotations

import torch
from torch import Tensor

from decentral.merge.base import MergeMethod

ZERO_NORM = 1e-12  # a task vector with a smaller norm has no direction


def stock_ratio(deltas: list[Tensor]) -> float:
    """t = N cos θ / (1 + (N − 1) cos θ), cos θ the mean pairwise cosine of `deltas`, clamped to [0, 1]."""
    flat = [delta.view(-1) for delta in deltas]
    norms = [torch.linalg.vector_norm(v).item() for v in flat]
    cosines = [
        torch.dot(flat[i], flat[j]).item() / (norms[i] * norms[j]) if min(norms[i], norms[j]) > ZERO_NORM else 0.0
        for i in range(len(flat)) for j in range(i + 1, len(flat))
    ]
    cos = min(1.0, max(0.0, sum(cosines) / len(cosines)))
    count = len(deltas)
    return count * cos / (1 + (count - 1) * cos)


def merge_model_stock(base: Tensor | None, tensors: list[Tensor], weights: list[float], *, name: str) -> Tensor:
    t = stock_ratio([tensor - base for tensor in tensors])
    mean = tensors[0].clone()
    for tensor in tensors[1:]:
        mean.add_(tensor)
    return mean.div_(len(tensors)).mul_(t).add_(base, alpha=1 - t)


MODEL_STOCK = MergeMethod(name="model_stock", fn=merge_model_stock, needs_base=True, min_models=2, uses_weights=False)
