"""Data parallel baseline: average gradients over every member before every inner step.

It sends the whole model's gradients every step, which is what the low-communication protocols
are measured against. Members are re-read every `membership_every` steps.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from decentral.sync.base import SyncProtocol, SyncReport
from decentral.transport import Transport


class DDP(SyncProtocol):
    name = "ddp"

    def __init__(self, model, optimizer: torch.optim.Optimizer, transport: Transport, *, membership_every: int = 20):
        super().__init__(model, optimizer, transport)
        self.membership_every = membership_every
        self._group: list[str] = []
        self._step_report: SyncReport | None = None

    def start(self) -> None:
        got = self.transport.fetch_state(have={"weights": self._weights()})
        if got is not None:
            _, (meta, tensors) = got
            vector_to_parameters(tensors["weights"].to(self.params[0]), self.params)
        self.transport.offer_state({"protocol": self.name, "round": 0}, {"weights": self._weights()})
        super().start()

    def _weights(self) -> torch.Tensor:
        return parameters_to_vector(self.params).detach().float().cpu().clone()

    def before_step(self) -> None:
        epoch = self.step // self.membership_every
        if self.step % self.membership_every == 0 or not self._group:
            self.round = epoch
            self.transport.join_rounds(epoch + 1)
            self._group = self._members(epoch)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = parameters_to_vector(grads).detach().float().cpu()
        result, waited = self._timed_average(flat, self._group, f"ddp/{self.step}")
        if not result.complete and len(result.group) > 1:
            result.tensor.zero_()  # rolled back: every replica steps on a zero gradient, and none drifts
        vector_to_parameters(result.tensor.to(grads[0]), grads)
        for p, g in zip(self.params, grads):
            p.grad = g
        self._step_report = SyncReport(self.step, result.group, result.complete, result.contributors, waited, result.rejected)

    def after_step(self) -> SyncReport | None:
        """Every `membership_every` steps: refresh the state offered to newcomers, report the last step."""
        if self.step % self.membership_every:
            return None
        self.transport.offer_state({"protocol": self.name, "round": self.round}, {"weights": self._weights()})
        return self._step_report
