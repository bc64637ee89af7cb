"""DARE: drop and rescale task vectors before merging (Yu et al. 2024, "Language Models are Super
Mario", arXiv 2311.03099).

Each entry of every task vector τ_i = θ_i − θ₀ is dropped with probability 1 − density and the kept
entries are scaled by 1/density, so the expected task vector is unchanged: τ̂_i = m_i ⊙ τ_i / density,
m_i ~ Bernoulli(density). The sparse τ̂_i are then combined as in task arithmetic,
θ = θ₀ + λ Σ_i w_i τ̂_i, or with `ties: true` by TIES's sign election and disjoint mean
(decentral.merge.ties; no magnitude trim, DARE's drop replaces it), θ = θ₀ + λ·m.

Defaults: density 0.5. The paper drops up to 90% (even 99%) of the changes of supervised fine-tunes,
whose task vectors are tiny, and reports that models whose parameters moved far from the base
(continued pre-training, as BTM's experts are) break at high drop rates, so the default drops only
half. λ = 1, `ties: false`.

Reproducible: the mask of expert i on tensor `name` comes from a generator seeded with a hash of
(seed, name, i), so it depends neither on the order tensors are merged nor on the other tensors;
reordering the experts in a recipe changes their masks. With density 1 nothing is dropped and the
result is task arithmetic's (or TIES's with no trim).
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from decentral.merge.base import MergeMethod, weighted_sum
from decentral.merge.ties import disjoint_mean


def drop_and_rescale(delta: Tensor, density: float, generator: torch.Generator) -> Tensor:
    """`delta`, in place: each entry kept with probability `density` and scaled by 1/density, the others zeroed."""
    dropped = torch.rand(delta.shape, generator=generator) >= density
    return delta.div_(density).masked_fill_(dropped, 0.0)


def mask_generator(seed: int, name: str, index: int) -> torch.Generator:
    """The generator of expert `index`'s mask on tensor `name`."""
    digest = hashlib.sha256(f"{seed}\0{name}\0{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def merge_dare(base: Tensor | None, tensors: list[Tensor], weights: list[float], *, name: str,
               **params) -> Tensor:
    density = params["density"]
    dropped = [drop_and_rescale(tensor - base, density, mask_generator(params["seed"], name, index))
               for index, tensor in enumerate(tensors)]
    merged = disjoint_mean(dropped, weights) if params["ties"] else weighted_sum(dropped, weights)
    return merged.mul_(params["lambda"]).add_(base)


DARE = MergeMethod(
    name="dare", fn=merge_dare, needs_base=True,
    params={"density": 0.5, "lambda": 1.0, "ties": False, "seed": 0},
    checks={"density": (lambda d: 0 < d <= 1, "in (0, 1]")},
)
