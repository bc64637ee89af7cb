"""Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512): DiLoCo one fragment of the model at a time,
each fragment's average overlapped with τ inner steps (ALGORITHMS.md §2).

The flat vector of the trained parameters is split into P equal contiguous slices, the fragments (a slice
may cut a tensor: every rule below is element-wise; the paper's fragments are groups of whole layers, whose
sizes differ by a tensor, and the largest sets the peak bandwidth: 1.12 of a third for the demo's model in
3 runs of whole tensors, exactly a third as slices). A round is H inner steps, as in DiLoCo; fragment f's
average lands at in-round step t_f = (f+1)·H//P, so only one fragment is ever on the wire and the last
lands on the round boundary. Writing e for the error feedback's residual (0 without it, ALGORITHMS.md §9),
for fragment f:
    at t_f − τ:  g_i   = (φ − e_i) − θ_i                  outer gradient of the fragment: slow minus fast
                 launch ḡ = mean_i (g_i + e_i)            in the background; e_i ← 0
    at t_f:      φ    ← SGD(lr, momentum, nesterov)(φ, ḡ) as DiLoCo (the fragment's part of the momentum)
                 e_i  ← g_i + e_i − what the average counted of it
                 θ_i  ← α·θ_i + (1−α)·(φ − e_i)           θ_i has trained τ steps since the launch
τ (`delay`) = 0 launches and applies at once; P = 1, τ = 0, α = 0 is DiLoCo exactly. θ is never reset to
φ: between its syncs a fragment keeps what it trained, and its next sync sends g_i + e_i = φ − θ_i. Mixing
with φ − e rather than the paper's φ keeps the progress the average did not count in θ only, as DiLoCo's
next round starts from φ − e: mixed with φ, a fraction α of it would stay in θ besides the residual and
go out again at every sync (with outer lr 1 and no momentum, a part a top-k codec leaves unsent for a
while is counted up to 1/(1−α) times). Without error feedback both are the paper's rule.

An average that does not commit is rolled back: φ, the momentum and θ stay, and the fragment's next sync
carries both rounds' progress. A member the others finished a round without (it was frozen, or cut off)
learns so when a fragment of that round lands "left out", and joins them where they are then, not at its
boundary (`_catch_up`): meanwhile their next round would wait for its part. At a round boundary nothing is
in flight, so the round's bookkeeping
(snapshot offered to newcomers, replicas compared by digest and repaired) is DiLoCo's, and so is a late
newcomer's replay of the rounds it missed: the outer step is element-wise, so a round's fragment averages
in turn are one DiLoCo average of the whole vector (a round where one did not commit is downloaded). A
checkpoint taken while a fragment is in flight holds no residual for it and loses nothing of ours: θ holds
that progress relative to φ, and the fragment's next sync sends it. A peer resumed from it lacks the average the others
applied: its state is found to differ by digest and repaired (decentral.sync.base).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from decentral.sync.base import SyncReport, check_count, not_committed
from decentral.sync.diloco import DiLoCo, nesterov_sgd_step
from decentral.transport import AverageResult, EncodedAverage, Transport, longest_hold


@dataclass
class InFlight:
    """A fragment's average, launched and not yet applied."""

    fragment: int
    future: Future[AverageResult]  # over the round's members, looked up in the background as it starts
    grad: torch.Tensor  # our outer gradient of the fragment, g_i
    sent: torch.Tensor  # our input to the average, g_i + e_i


class StreamingDiLoCo(DiLoCo):
    """`fragments` P, `delay` τ (inner steps a fragment's average has to arrive) and `mix` α (the local
    weights' share when it lands), as in the module docstring; the outer optimizer's arguments are DiLoCo's."""

    name = "streaming"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        transport: Transport,
        *,
        every: int = 500,
        fragments: int = 4,
        delay: int = 1,
        mix: float = 0.5,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        outer_on_device: bool = False,
    ):
        super().__init__(model, optimizer, transport, every=every, outer_lr=outer_lr,
                         outer_momentum=outer_momentum, nesterov=nesterov, outer_on_device=outer_on_device)
        check_count(fragments, "fragments")
        check_count(delay, "delay", 0)
        if fragments > every:
            raise ValueError(f"fragments must be between 1 and every = {every} (each lands at its own in-round step), "
                             f"got {fragments}")
        if fragments > self.numel:
            raise ValueError(f"fragments must be at most the model's {self.numel} parameters, got {fragments}")
        if delay >= every // fragments:
            raise ValueError(f"delay must be below every // fragments = {every // fragments} (every={every}, "
                             f"fragments={fragments}): fragment 0 launches at in-round step every // fragments - delay, "
                             f"which must be >= 1; got delay={delay}")
        if not 0 <= mix < 1:
            raise ValueError(f"mix (α, the local weights' share when a fragment lands) must be >= 0 and < 1 "
                             f"(1 would never take the average), got {mix}")
        self.mix = mix
        self.fragments = [slice(f * self.numel // fragments, (f + 1) * self.numel // fragments)
                          for f in range(fragments)]  # of the flat vector
        self._lands = [(f + 1) * every // fragments for f in range(fragments)]  # in-round step each lands at
        self._launches = {t - delay: f for f, t in enumerate(self._lands)}
        # a newcomer joins a round under way only before its first launch (it had no part in what is in
        # flight); as DiLoCo's every // 2, its announcement has at least as long again to reach the members
        self.join_within_steps = (every // fragments - delay) // 2
        self.in_flight: InFlight | None = None
        self._synced: list[tuple[AverageResult, float, bool]] = []  # this round's (result, wait, rolled back)

    def memory_copies(self) -> list[str]:
        return [*super().memory_copies(), "fragment in flight (its outer gradient, our input and its average: "
                                          "3/fragments of a copy)"]

    def _can_onlook(self, round_start: int, donor_step: int) -> bool:
        """Never: an onlooker would launch fragments of a round it is no member of; a newcomer past the join
        window waits for the round's end."""
        return False

    def after_step(self) -> SyncReport | None:
        done = self.step - self._round_start  # inner steps of this round done
        if done in self._launches:
            self._launch(self._launches[done])
        if self.in_flight is not None and done == self._lands[self.in_flight.fragment]:
            self._synced.append(self._apply())
            if done < self.every and self._left_behind():
                return self._catch_up()
        if done < self.every:
            return None
        synced, self._synced = self._synced, []
        encodings = [r.encoded for r, _, _ in synced]  # a newcomer may replay the round: each fragment's in turn
        if len(encodings) == len(self.fragments) and all(e is not None for e in encodings):
            self._led_by = EncodedAverage(encodings[0].codec, [chunk for e in encodings for chunk in e.chunks])
        return self._close_round(self._round_report(synced))

    def _round_report(self, synced: list[tuple[AverageResult, float, bool]]) -> SyncReport:
        """The report of this round's fragment averages `synced` (result, wait, rolled back), not yet completed
        by `_close_round`."""
        results = [r for r, _, _ in synced]
        return SyncReport(
            self.round, sorted({p for r in results for p in r.group}), all(r.complete for r in results),
            min((r.contributors for r in results), default=1), sum(w for _, w, _ in synced),
            {p: why for r in results for p, why in r.rejected.items()}, rolled_back=any(b for _, _, b in synced),
            held_by=longest_hold(r.held_by for r in results))

    def _left_behind(self) -> bool:
        """Whether most of the members we averaged with this round averaged without us (`_majority_left_us_out`)
        and one of them is past this round: they finished it without us (we were frozen, or cut off, while they
        averaged it)."""
        return self._majority_left_us_out() and self._past_our_round(self._left_out)

    def _catch_up(self) -> SyncReport:
        """Leave the round the members finished without us at once, not at its boundary, and join them where
        they are (`_rejoin`: at their state, round and step, waiting for their next round when they are past
        its start): its remaining fragments would average with nobody, and the members' next round would
        wait for our part of it until we reached our boundary (our round is within their lead). What we
        trained of it is lost, as in a repair. The report is of the round we left, rolled back."""
        synced, self._synced = self._synced, []
        report = self._round_report(synced)
        report.rolled_back = True
        self._asked, self._left_out = set(), set()
        report.spread = self._rejoin()
        report.repaired = report.spread is not None
        report.digest = self._digests.get(self.round)
        return report

    def _launch(self, fragment: int) -> None:
        part = self.fragments[fragment]
        grad = self._outer_gradient(self._finite_fast(part), part)
        sent = self._with_residual(grad, part)
        future = self.transport.average_async(sent, None, f"streaming/{self.round}/{fragment}", self.round)
        self.in_flight = InFlight(fragment, future, grad, sent)

    def _apply(self) -> tuple[AverageResult, float, bool]:
        """Wait for the fragment in flight and apply it; (its result, seconds waited, rolled back)."""
        flight, self.in_flight = self.in_flight, None
        part = self.fragments[flight.fragment]
        result, waited = self._await_average(flight.future)
        rolled_back = not_committed(result)
        if rolled_back:  # sent again at the fragment's next sync, with that round's progress (θ holds it)
            self._keep_residual(flight.sent, flight.grad, part)
        else:
            self._keep_residual(flight.sent, result.sent, part)
            self._own("slow", "momentum")
            self._drop_frozen_momentum(self.momentum[part], part)
            nesterov_sgd_step(self.slow[part], result.tensor, self.momentum[part], self.outer_lr, self.outer_momentum,
                              self.nesterov)
            fast = self._fast_vector(part)
            merged = torch.lerp(self.round_start_weights()[part], fast, self.mix)
            frozen = self._frozen(part)
            if frozen is not None:  # a frozen parameter keeps its value (mixing moved it towards φ, round by round)
                merged = torch.where(frozen.to(merged.device), fast, merged)
            self._load_fast(merged, part)
        return result, waited, rolled_back

    def finish(self) -> None:
        """Apply the fragment still in flight (training stopped between its launch and its landing), so the
        model holds it. Nothing is offered: mid-round, this is no state a round starts from."""
        if self.in_flight is not None:
            self._apply()

