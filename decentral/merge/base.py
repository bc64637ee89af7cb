"""What every merge method is: a function of one tensor's versions, plus its knobs and needs.

A method sees one tensor at a time: the base's version (or None for methods without a base) and
the experts' versions, all float32 and of one shape, with the experts' weights; it returns the
merged float32 tensor of that shape. `name` is the tensor's name, for methods that draw random
numbers per tensor (DARE), so a result does not depend on the order tensors are visited.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


class MergeError(ValueError):
    """A merge recipe, its inputs or the merge itself went wrong; the message says where and how."""


@dataclass(frozen=True)
class MergeMethod:
    """One merge method.

    `params` maps each knob to its default; `checks` maps a knob to (predicate, what is allowed),
    e.g. `{"density": (lambda d: 0 < d <= 1, "in (0, 1]")}`. `num_models` is the exact number of
    experts the method takes (None: any number from `min_models` up). `uses_weights` is False for
    methods whose mix is set by a parameter or by the geometry (SLERP, model stock) or computed:
    `weights_from(recipe)` gives the experts' weights before the merge starts (posterior).
    """

    name: str
    fn: Callable[..., Tensor]
    needs_base: bool
    params: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, tuple[Callable[[Any], bool], str]] = field(default_factory=dict)
    num_models: int | None = None
    min_models: int = 1
    uses_weights: bool = True
    weights_from: Callable[[Any], list[float]] | None = None

    def merge(self, base: Tensor | None, tensors: list[Tensor], weights: list[float], *, name: str,
              **params: Any) -> Tensor:
        """The merged tensor; `params` override the defaults (unknown names are a MergeError)."""
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            raise MergeError(f"{self.name} has no parameter(s) {unknown}; allowed: {sorted(self.params)}")
        if self.needs_base and base is None:
            raise MergeError(f"{self.name} needs a base model")
        if len(weights) != len(tensors):
            raise MergeError(f"{self.name}: {len(tensors)} tensors but {len(weights)} weights")
        if len(tensors) < self.min_models or self.num_models not in (None, len(tensors)):
            wanted = self.num_models or f"at least {self.min_models}"
            raise MergeError(f"{self.name} merges {wanted} experts, not {len(tensors)}")
        return self.fn(base, tensors, weights, name=name, **{**self.params, **params})


def weighted_sum(tensors: list[Tensor], weights: list[float]) -> Tensor:
    """Σ_i w_i t_i as a new tensor (the inputs are left as they are)."""
    total = torch.mul(tensors[0], weights[0])
    for tensor, weight in zip(tensors[1:], weights[1:]):
        total.add_(tensor, alpha=weight)
    return total


def ratios_only(weights: list[float]) -> list[float]:
    """`weights` times the power of two that brings the largest into [0.5, 1), for a method that uses only their
    ratios (a weighted mean): the same result bit for bit (a power of two scales every float32 product and sum
    exactly), without the float32 overflow of weights far above 1 (1e39 made every merged value infinite) or the
    underflow of weights far below it."""
    _, exponent = math.frexp(max(weights))
    return [math.ldexp(w, -exponent) for w in weights]
