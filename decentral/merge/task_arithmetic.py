"""Task arithmetic (Ilharco et al. 2023, "Editing models with task arithmetic", arXiv 2212.04089).

Each expert's task vector is its difference from the base, τ_i = θ_i − θ₀; the merge adds the
weighted sum of task vectors back to the base, scaled by λ:

    θ = θ₀ + λ Σ_i w_i τ_i

The paper adds the task vectors and picks one λ on validation data (from 0 to 1 in steps of 0.05).
The default λ = 1 adds every expert's full change, as mergekit does with its per-model weights; with
equal weights, λ = 1/N is the plain average of the experts. The paper's negation (forgetting a task)
is a negative weight, which recipes do not allow (weights must be positive): use λ < 0 for it.
"""

from __future__ import annotations

from torch import Tensor

from decentral.merge.base import MergeMethod


def weighted_task_sum(base: Tensor, tensors: list[Tensor], weights: list[float]) -> Tensor:
    """Σ_i w_i (θ_i − θ₀), one task vector at a time (each difference taken before summing, for precision)."""
    total = (tensors[0] - base).mul_(weights[0])
    for tensor, weight in zip(tensors[1:], weights[1:]):
        total.add_(tensor - base, alpha=weight)
    return total


def merge_task_arithmetic(base: Tensor | None, tensors: list[Tensor], weights: list[float], *, name: str,
                          **params: float) -> Tensor:
    return weighted_task_sum(base, tensors, weights).mul_(params["lambda"]).add_(base)


TASK_ARITHMETIC = MergeMethod(name="task_arithmetic", fn=merge_task_arithmetic, needs_base=True, params={"lambda": 1.0})
