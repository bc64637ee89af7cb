"""SLERP: spherical linear interpolation of two models (Shoemake 1985, "Animating rotation with
quaternion curves", SIGGRAPH), applied per tensor as model-merging tools do.

Per tensor, with v0 the first expert and v1 the second, both flattened: the angle Ω between them is
taken from their normalised copies, cos Ω = ⟨v0/‖v0‖, v1/‖v1‖⟩, and the original (unnormalised)
vectors are interpolated along the arc:

    θ = sin((1−t)Ω)/sin Ω · v0 + sin(tΩ)/sin Ω · v1

t = 0 gives the first expert, t = 1 the second; the default 0.5 is the midpoint. When the tensors
are nearly parallel or anti-parallel, |cos Ω| > `parallel_threshold` (default 0.9995, the threshold
merge tools use), sin Ω is too small to divide by and the arc is (nearly) the chord: linear
interpolation (1−t)·v0 + t·v1 is used. A zero tensor has no direction; it is lerped too.
Needs no base, exactly two experts, and no weights (t sets the mix).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from decentral.merge.base import MergeMethod

ZERO_NORM = 1e-12  # a tensor with a smaller norm has no direction


def merge_slerp(base: Tensor | None, tensors: list[Tensor], weights: list[float], *, name: str,
                t: float, parallel_threshold: float) -> Tensor:
    v0, v1 = tensors
    norm0, norm1 = torch.linalg.vector_norm(v0).item(), torch.linalg.vector_norm(v1).item()
    if norm0 > ZERO_NORM and norm1 > ZERO_NORM:
        cos = max(-1.0, min(1.0, torch.dot(v0.view(-1), v1.view(-1)).item() / (norm0 * norm1)))
        if abs(cos) <= parallel_threshold:
            omega = math.acos(cos)
            sin_omega = math.sin(omega)
            return v0 * (math.sin((1 - t) * omega) / sin_omega) + v1 * (math.sin(t * omega) / sin_omega)
    return torch.lerp(v0, v1, t)


SLERP = MergeMethod(
    name="slerp", fn=merge_slerp, needs_base=False, num_models=2, uses_weights=False,
    params={"t": 0.5, "parallel_threshold": 0.9995},
    checks={"t": (lambda t: 0 <= t <= 1, "in [0, 1]"),
            "parallel_threshold": (lambda c: 0 < c < 1, "in (0, 1)")},
)
