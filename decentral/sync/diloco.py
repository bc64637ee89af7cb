"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105): outer Nesterov step on averaged pseudo-gradients.

Every H inner steps (ALGORITHMS.md §1):
    g_i = φ − θ_i                          outer gradient: slow minus fast
    g   = mean_i g_i                       average over all members of the round (each did H inner steps)
    φ  ← SGD(lr, momentum, nesterov)(φ, g) a positive lr moves φ towards the workers' progress
    θ_i ← φ
Inner optimizer states are never averaged. A round whose average does not commit (swarm.averaging:
every member holds the same result, or nobody uses it) is rolled back: φ and the momentum stay, the
fast weights train on, and the next boundary retries with the progress of both rounds (the run's last
round, once more at the end: OuterProtocol.finish). With a codec that sends a small part of each tensor
(top-k), what the average did not count is kept and added to the next round's outer gradient (error
feedback, SparseLoCo; decentral.sync.base `_with_residual`), and the next round starts from θ_i ← φ − e_i,
so that progress stays in our own model while it waits to be sent (from φ alone, demo with topk: final
validation loss 2.61; from φ − e: 2.05; float16 DiLoCo 1.96). Replicas whose φ or momentum differ anyway
are found by digest and repaired (decentral.sync.base). A newcomer whose state arrived rounds late replays
those rounds' averages on it (`_apply_average`, decentral.rounds).
"""

from __future__ import annotations

import torch

from decentral.sync.base import OuterProtocol, SyncReport, check_flag, check_outer_sgd, not_committed
from decentral.transport import Transport


class DiLoCo(OuterProtocol):
    name = "diloco"
    identical_replicas = True  # every member applies the same average to the same φ and momentum
    replays_rounds = True  # so a newcomer whose state arrived rounds late catches up from those averages
    looks_up_members = True
    error_feedback = True

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        transport: Transport,
        *,
        every: int = 500,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        outer_on_device: bool = False,
    ):
        check_outer_sgd(outer_lr, outer_momentum)
        check_flag(nesterov, "nesterov")
        super().__init__(model, optimizer, transport, every=every, outer_on_device=outer_on_device)
        self.slow.requires_grad_(False)
        self.momentum = torch.zeros_like(self.slow)
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov

    def outer_tensors(self) -> dict[str, torch.Tensor]:
        return {"momentum": self.momentum}

    def _apply_average(self, tensors: dict[str, torch.Tensor], average: torch.Tensor) -> None:
        """φ, m ← the outer Nesterov step on `average` (g), in place on a snapshot's tensors."""
        self._drop_frozen_momentum(tensors["momentum"])
        nesterov_sgd_step(tensors["slow"], average, tensors["momentum"], self.outer_lr, self.outer_momentum,
                          self.nesterov)

    def round_start_weights(self) -> torch.Tensor:
        """φ, plus our own progress the averages have not counted yet (the error feedback's residual)."""
        return self.slow if self.residual is None else self.slow - self.residual

    def outer_step(self, fast: torch.Tensor) -> SyncReport:
        group = self._members(self.round)
        outer_grad = self._outer_gradient(fast)
        sent = self._with_residual(outer_grad)
        result, waited = self._timed_average(sent, group, f"diloco/{self.round}")
        rolled_back = not_committed(result)
        if rolled_back:  # retried at the next boundary, with twice the progress (θ holds this round's)
            self._keep_residual(sent, outer_grad)
        else:
            self._keep_residual(sent, result.sent)
            self._own("slow", "momentum")
            self._apply_average({"slow": self.slow, "momentum": self.momentum}, result.tensor)
            self._led_by = result.encoded if result.complete else None  # a newcomer may replay it (base.py)
        return SyncReport.of(self.round, result, waited, rolled_back=rolled_back)


def nesterov_sgd_step(
    slow: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor, lr: float, mu: float, nesterov: bool
) -> None:
    """torch.optim.SGD's update with momentum (dampening 0), in place on φ (`slow`) and `momentum`. One
    model-sized temporary (lr times the direction); the same values as the textbook's expression."""
    momentum.mul_(mu).add_(grad)
    step = (momentum * mu).add_(grad).mul_(lr) if nesterov else momentum * lr  # lr · (grad + mu · momentum)
    slow.sub_(step)
