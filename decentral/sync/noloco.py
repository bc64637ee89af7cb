"""NoLoCo (Kolehmainen et al. 2025, arXiv 2506.10911): no all-reduce, average with one random peer.

Every H inner steps (ALGORITHMS.md §3), with the pair {i, j} drawn from a shared seed:
    Δ_i = θ_i − φ_i                                   fast minus slow (opposite sign to DiLoCo)
    δ_i = α·δ_i + β·mean_pair(Δ) + γ·(mean_pair(φ) − φ_i)
    φ_i = φ_i + δ_i ;  θ_i ← φ_i
With φ rounded on the wire (float16, bfloat16), the pull mean_pair(φ) − φ_i is taken between rounded
values, mean_pair(q(φ)) − q(φ_i): zero for identical replicas, and φ_i itself is never replaced by a
rounded value (which would lose every update smaller than half a unit in the last place, round after
round, as with float16 master weights).
The sign of β follows the released code (+β); the paper's printed −β diverges. Default momentum is
the reference code's heavy ball; `nesterov=True` adds the look-ahead (φ_i += α·δ_i + u_i). A peer left
without a partner (odd count, dead partner) applies its own Δ alone.
"""

from __future__ import annotations

import math

import torch

from decentral.sync.pairing import group_of, round_groups
from decentral.sync.base import OuterProtocol, SyncReport, check_count, check_flag
from decentral.transport import AverageResult, Transport


class NoLoCo(OuterProtocol):
    name = "noloco"
    looks_up_members = True
    rounds_ahead = 2  # pairs wait only for each other: a partner may be a round further on than our last ones

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        transport: Transport,
        *,
        every: int = 50,
        alpha: float = 0.5,
        beta: float = 0.7,
        gamma: float | None = None,
        nesterov: bool = False,
        group_size: int = 2,
        seed: int = 0,
        outer_on_device: bool = False,
    ):
        gamma = beta if gamma is None else gamma
        check_noloco_settings(alpha, beta, gamma, group_size)
        check_flag(nesterov, "nesterov")
        super().__init__(model, optimizer, transport, every=every, outer_on_device=outer_on_device)
        self.alpha, self.beta, self.gamma = alpha, beta, gamma
        self.nesterov, self.group_size, self.seed = nesterov, group_size, seed
        self.delta = torch.zeros_like(self.slow)

    def outer_tensors(self) -> dict[str, torch.Tensor]:
        return {"delta": self.delta}

    def outer_step(self, fast: torch.Tensor) -> SyncReport:
        groups = round_groups(self._members(self.round), self.seed, self.round, self.group_size)
        group = group_of(self.transport.peer_id, groups)
        n = self.slow.numel()
        both = torch.cat([self.slow, fast.sub_(self.slow)])  # Δ_i in our copy of θ_i
        if len(group) > 1:
            result, waited = self._timed_average(both, group, f"noloco/{self.round}")
        else:  # nobody to average with this round
            result, waited = AverageResult(both, both, group, True, 1), 0.0
        mean, sent = result.tensor, result.sent
        spread = replica_spread(sent[:n], mean[:n]) if result.complete and len(group) > 1 else None
        self._own("delta")
        self._drop_frozen_momentum(self.delta)
        self.slow = noloco_update(self.slow, self.delta, mean[n:], mean[:n] - sent[:n], self.alpha, self.beta,
                                  self.gamma, self.nesterov)
        return SyncReport.of(self.round, result, waited, spread=spread)


def check_noloco_settings(alpha: float, beta: float, gamma: float, group_size: int) -> None:
    """ValueError unless a group holds 2 peers or more (1 never averages) and α, β, γ lie in the paper's
    stability region (its appendix, for n = 2; ALGORITHMS.md §3): 0 <= α < 1, α < β (finite) and
    α < γ < √(2 + α²)."""
    check_count(group_size, "group_size (the peers that average together each round)", 2)
    if not 0 <= alpha < 1:
        raise ValueError(f"alpha (α, the outer momentum) must be in [0, 1), got {alpha}")
    if not alpha < beta < math.inf:
        raise ValueError(f"beta (β, the outer learning rate) must be a finite number above alpha = {alpha} (the "
                         f"paper's stability region), got {beta}")
    bound = math.sqrt(2 + alpha**2)
    if not alpha < gamma < bound:
        raise ValueError(f"gamma (γ, the pull towards the group's mean φ; beta when not given) must be above "
                         f"alpha = {alpha} and below √(2 + alpha²) = {bound:.3g} (the paper's stability region), "
                         f"got {gamma}")


def replica_spread(slow: torch.Tensor, mean_slow: torch.Tensor) -> float:
    """RMS over parameters of φ_i − mean_group(φ): for a pair, the standard deviation of φ across the two
    replicas. NoLoCo's replicas never become identical; the paper finds the spread ∝ (inner lr)² (§3)."""
    return float((slow - mean_slow).pow(2).mean().sqrt())


def noloco_update(
    slow: torch.Tensor,
    delta: torch.Tensor,
    mean_outer: torch.Tensor,
    pull: torch.Tensor,
    alpha: float,
    beta: float,
    gamma: float,
    nesterov: bool,
) -> torch.Tensor:
    """One NoLoCo outer step; updates the momentum `delta` in place and returns the new φ. `pull` is
    mean_pair(φ) − φ_i (between rounded values, see the module docstring)."""
    update = beta * mean_outer + gamma * pull
    delta.mul_(alpha).add_(update)
    return slow + (alpha * delta + update if nesterov else delta)
