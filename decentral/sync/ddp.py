"""Data parallel baseline: average gradients over every member before every inner step.

It sends the whole model's gradients every step, which is what the low-communication protocols
are measured against. Members are re-read every `membership_every` steps (an epoch, the protocol's
"round"), and at once after an average that did not commit.

Every replica must hold the same weights and the same inner optimizer state, or the same averaged
gradient moves them apart: a rolled-back average is a zero gradient for every replica; the state a
newcomer takes at an epoch boundary is the weights *and* the optimizer's state, so it steps exactly
as the others from its first step; and replicas compare state digests every epoch (decentral.sync.base).
"""

from __future__ import annotations

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from decentral.checkpoint import optimizer_state_dict, optimizer_tensors
from decentral.sync.base import SyncProtocol, SyncReport
from decentral.transport import Transport


class DDP(SyncProtocol):
    name = "ddp"
    shares_state = True
    identical_replicas = True

    def __init__(self, model, optimizer: torch.optim.Optimizer, transport: Transport, *, membership_every: int = 20):
        super().__init__(model, optimizer, transport)
        if membership_every < 1:
            raise ValueError(f"membership_every must be >= 1, got {membership_every}")
        self.membership_every = membership_every
        self._group: list[str] = []
        self._step_report: SyncReport | None = None

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Weights and the inner optimizer's state (copies)."""
        weights = parameters_to_vector(self.params).detach().float().cpu().clone()
        return {"weights": weights, **{k: v.detach().cpu().clone() for k, v in optimizer_tensors(self.optimizer).items()}}

    def memory_copies(self) -> list[str]:
        return ["weights (offered)", "inner optimizer state (offered; 2 model-sized vectors for AdamW)"]

    def snapshot_meta(self) -> dict:
        return {"param_groups": self.optimizer.state_dict()["param_groups"]}

    def load_snapshot(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        ours = parameters_to_vector(self.params)
        if tensors["weights"].shape != ours.shape:
            raise ValueError(f"the swarm's model has {tensors['weights'].numel()} parameters, ours has "
                             f"{ours.numel()}: the recipes differ")
        vector_to_parameters(tensors["weights"].to(ours, copy=True), self.params)
        inner = {k: v for k, v in tensors.items() if k.startswith("inner.")}
        self.optimizer.load_state_dict(optimizer_state_dict(inner, meta["param_groups"]))

    def before_step(self) -> None:
        if self.step % self.membership_every == 0 or not self._group:
            self._group = self._members(self.round)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = parameters_to_vector(grads).detach().float().cpu()
        result, waited = self._timed_average(flat, self._group, f"ddp/{self.step}")
        if not result.complete and len(result.group) > 1:
            result.tensor.zero_()  # rolled back: every replica steps on a zero gradient, and none drifts
            self._group = []  # the members may see another list by the next step
        vector_to_parameters(result.tensor.to(grads[0]), grads)
        for p, g in zip(self.params, grads):
            p.grad = g
        self._step_report = SyncReport(self.step, result.group, result.complete, result.contributors, waited, result.rejected)

    def after_step(self) -> SyncReport | None:
        """At an epoch boundary: offer our state to newcomers, compare it with the others', announce the
        next epochs; report the last step."""
        if self.step % self.membership_every:
            return None
        self.round, self._round_start = self.step // self.membership_every, self.step
        self._offer()
        report = self._step_report
        if report is not None:
            self._check_replicas(report.group, report)
            report.digest = self._digests[self.round]
        self.transport.join_rounds(self.round + 1)
        return report
