"""CO2 (Sun et al., ICLR 2024, arXiv 2401.16265): DiLoCo's outer step with the average fully overlapped.

The average of round t's outer gradients runs in the background while round t+1 trains; the outer
step at the end of round t+1 uses it, one round stale (ALGORITHMS.md §4). At the boundary ending round t:
    g_i^t  = s_i − θ_i                          outer gradient: where this round started minus where it ended
    launch ḡ^t = mean_i g_i^t                   in the background: it has all of round t+1 to finish
    wait for ḡ^{t−1}                            launched one boundary ago (no wait when it is done)
    m      ← μ·m + ḡ^{t−1} / p_t                staleness gap penalty p_t
    m      ← clamp(m, −c, c)                    outer momentum clipping, element-wise
    φ_{t+1} = φ_t − lr·m
    θ_i    ← s_i = φ_{t+1} − α·g_i^t            the next round starts from φ plus a share α (`mix`) of our
                                                own progress in flight
The penalty is constant by default (p_t = `penalty`, the reference code's, 1.0); `staleness_adaptive`
scales it by how far φ moved since the point ḡ^{t−1} was measured from, relative to ḡ^{t−1}'s size:
p_t = penalty · (1 + ‖φ_t − φ_{t−1}‖ / ‖ḡ^{t−1}‖). The reference code's clip discards its result (never
clips); this one clips. `clip=None` turns it off.

Where the next round starts: the reference code (SlowMo's) sets θ ← φ_{t+1} (α = 0), which lacks round
t's progress (still in flight), so every round trains from a point one round behind. That is a delayed
outer step, and with H=50 it oscillated here (4 peers of one LoopbackHub, protocols/co2.yaml, an ad-hoc
script not kept: validation loss 2.43 at step 150, 3.83 at 250; DiLoCo 2.09). Starting from φ_{t+1} plus
all of our own part in flight (α = 1) keeps our own progress undelayed, but the replicas' starts then
differ by each one's own last round, and that difference does not shrink: at the next boundary each swaps
its own round for the average after a whole round was trained on top of it, and in directions where a
round converges, θ_i lands as far from the others as its start was. In a 1000-step run the models at
the boundaries zig-zagged between validation loss 2.0 and 2.45 for most of it, and the run ended worse
than no communication. A share 0 < α < 1 keeps that share of our own progress undelayed and shrinks the
replicas' differences by α every round, as Streaming DiLoCo's mixing of local and global weights does.
The default α = 0.75 ended 5% below α = 1 at 1000 steps and below no communication, and slightly below
α = 1 at 400; 0.25 and 0.5 did worse than 0.75 (BENCHMARKS.md "CO2's start"); protocols/co2.yaml takes
α = 0.9 with outer lr 1.3, slightly ahead at 300 to 1000 steps ("CO2's outer lr and mix"). φ and m stay identical on
every replica. Whatever a round starts from, φ counts every round's average exactly once; the start only
decides where the next round's gradients are taken.

An average that did not commit changes nothing, and our part of it goes out again with the next
round's, so nothing trained is lost (when training ends, what the last two averages did not count goes out
once more: OuterProtocol.finish). With a codec that sends a small part of each tensor (top-k), what
a committed average did not count is the error feedback's residual, added to the next input. A peer that
starts while an average is in flight that it had no part in (a newcomer, or a resumed peer) takes the
members' state at its first boundary, when they have applied it: it replays that round's average on the
state it holds (`_apply_average`, as a newcomer whose state arrived rounds late replays the rounds since:
decentral.rounds), or downloads the state when that fails; a resumed peer alone applies its own part of the
round it had in flight. With the staleness-adaptive penalty a round's step depends on φ a round earlier,
which a newcomer does not hold: it downloads instead.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from decentral.sync.base import OuterProtocol, SyncReport, check_outer_sgd, not_committed
from decentral.transport import AverageResult, Transport, finished


@dataclass
class InFlight:
    """An average launched at a boundary and not yet applied."""

    future: Future[AverageResult]  # over the round's members, looked up in the background as it starts
    sent: torch.Tensor  # our input to it (progress φ does not hold yet: sent again if it does not commit)
    anchor: torch.Tensor | None  # φ it was measured from (kept for the staleness-adaptive penalty only)


class CO2(OuterProtocol):
    name = "co2"
    identical_replicas = True
    rounds_ahead = 2  # a member launches round r + 1's average before it waits for round r's
    error_feedback = True

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        transport: Transport,
        *,
        every: int = 48,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.5,
        penalty: float = 1.0,
        staleness_adaptive: bool = False,
        clip: float | None = 1.0,
        mix: float = 0.75,
        outer_on_device: bool = False,
    ):
        check_outer_sgd(outer_lr, outer_momentum)
        super().__init__(model, optimizer, transport, every=every, outer_on_device=outer_on_device)
        if not 0 < penalty < math.inf:
            raise ValueError(f"penalty (the staleness gap penalty's divisor) must be a finite number > 0, got {penalty}")
        if clip is not None and not clip > 0:
            raise ValueError(f"clip (the outer momentum's element-wise bound) must be > 0 or None, got {clip}")
        if not 0 <= mix <= 1:
            raise ValueError(f"mix (α, the share of our own progress in flight a round starts with) must be in "
                             f"[0, 1], got {mix}")
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.penalty, self.staleness_adaptive, self.clip, self.mix = penalty, staleness_adaptive, clip, mix
        self.replays_rounds = not staleness_adaptive  # a round's step is then a function of its average alone
        self.momentum = torch.zeros_like(self.slow)
        self.in_flight: InFlight | None = None
        self._unsent: torch.Tensor | None = None  # our part of an average that did not commit
        self._behind = False  # an average we had no part in is in flight: take the members' state after it

    def outer_tensors(self) -> dict[str, torch.Tensor]:
        return {"momentum": self.momentum}

    def memory_copies(self) -> list[str]:
        copies = [*super().memory_copies(), "outer gradient in flight", "its average"]
        return copies + (["φ it was measured from"] if self.staleness_adaptive else [])

    def round_start_weights(self) -> torch.Tensor:
        """φ plus our own progress that φ does not hold yet: the share `mix` of our part in flight, and all
        of what goes out again (an average that did not commit, the error feedback's residual)."""
        start = self.slow if self.in_flight is None else self.slow - self.mix * self.in_flight.sent
        for part in (self._unsent, self.residual):
            if part is not None:
                start = start - part
        return start

    def start(self) -> None:
        super().start()
        self._behind = self._behind or (self.donor is not None and self.round > 0)

    def after_step(self) -> SyncReport | None:
        behind = self._behind  # raised at this boundary (a rejoin), it waits for the next one
        report = super().after_step()
        if report is not None and behind:
            self._behind = False
            self._take_members_state(report)
        return report

    def _on_rejoined(self) -> None:
        """The members' state holds the average we had in flight (or went on without it); theirs of the
        round they are in is in flight without us: take their state once they applied it."""
        self.in_flight, self._unsent, self._behind = None, None, True
        super()._on_rejoined()

    def outer_step(self, fast: torch.Tensor) -> SyncReport:
        outer_grad = self._with_residual(self._outer_gradient(fast))
        if self._unsent is not None:
            outer_grad, self._unsent = outer_grad + self._unsent, None
        future = self.transport.average_async(outer_grad, None, f"co2/{self.round}", self.round)
        previous, self.in_flight = self.in_flight, InFlight(
            future, outer_grad, self.slow.clone() if self.staleness_adaptive else None)
        if previous is None:  # our first boundary: nothing of ours was in flight, nothing to apply
            return SyncReport(self.round, [self.transport.peer_id], True, 1, 0.0)
        return self._apply(previous)

    def _apply(self, stale: InFlight) -> SyncReport:
        """Wait for the average launched a boundary ago and take the outer step on it."""
        result, waited = self._await_average(stale.future)
        if not_committed(result):
            self._unsent = stale.sent if self._unsent is None else self._unsent + stale.sent
        else:
            self._keep_residual(stale.sent, result.sent)
            gap = None if stale.anchor is None else self.slow - stale.anchor
            self._own("slow", "momentum")
            self._drop_frozen_momentum(self.momentum)
            co2_outer_step(self.slow, result.tensor, self.momentum, self.outer_lr, self.outer_momentum,
                           staleness_penalty(self.penalty, result.tensor, gap), self.clip)
            self._led_by = result.encoded if result.complete else None  # a newcomer may replay it (base.py)
        return SyncReport.of(self.round, result, waited)

    def _apply_average(self, tensors: dict[str, torch.Tensor], average: torch.Tensor) -> None:
        """φ, m ← the outer step on a round's stale `average` with the constant penalty, in place on a
        snapshot's tensors."""
        self._drop_frozen_momentum(tensors["momentum"])
        co2_outer_step(tensors["slow"], average, tensors["momentum"], self.outer_lr, self.outer_momentum,
                       self.penalty, self.clip)

    def _take_members_state(self, report: SyncReport) -> None:
        """After our first boundary, the state the other members hold once they applied the average we
        had no part in: our state (theirs of the round before: we had nothing to apply) with that round
        replayed, or downloaded (`_repair`, each checked against their digests); alone, we keep ours."""
        others = set(self._members(self.round - 1)) - {self.transport.peer_id}  # of the average in flight
        if not others:
            return
        spread = self._repair(others, base=({**self._offered_meta(), "round": self.round - 1}, self.snapshot()))
        report.repaired, report.spread = spread is not None, spread
        report.digest = self._digests[self.round]

    def finish(self) -> None:
        """Apply the average still in flight, so the model holds the last round's progress too: a round of
        its own, closed as a boundary closes one (the replicas compare states; a member the others averaged
        without takes theirs), then tried once more where it rolled back (OuterProtocol.finish)."""
        if self.in_flight is not None:
            stale, self.in_flight = self.in_flight, None
            report = self._apply(stale)
            self._load_fast(self.round_start_weights())
            self._close_round(report)
            super().finish()

    def _holds_uncounted(self, last: SyncReport) -> bool:
        """Our part of an average that did not commit waits to go out again: that of the average applied at
        the end, or of the one applied at the last boundary (the end's committing does not count it)."""
        return self._unsent is not None

    def _average_again(self) -> SyncReport:
        """Our parts that averages did not count, averaged now and applied (see OuterProtocol.finish)."""
        sent, self._unsent = self._unsent, None
        future = self.transport.average_async(sent, None, f"co2/{self.round}", self.round)
        return self._apply(InFlight(future, sent, self.slow.clone() if self.staleness_adaptive else None))

    def _drop_uncounted(self) -> None:
        self._unsent = None

    def state_dict(self) -> dict:
        """Also our part of the average in flight: a peer resumed alone applies it at its first boundary
        (among others it takes their state instead, which holds the average)."""
        state = super().state_dict()
        if self.in_flight is not None:
            state["tensors"]["in_flight"] = self.in_flight.sent.cpu()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        mine = state["tensors"].get("in_flight")
        if mine is not None:
            mine = mine.to(self.outer_device, torch.float32)
            me = [self.transport.peer_id]
            self.in_flight = InFlight(finished(AverageResult(mine.clone(), mine, me, True, 1)), mine, None)
            self._behind = True


def staleness_penalty(penalty: float, stale_grad: torch.Tensor, gap: torch.Tensor | None) -> float:
    """p_t: `penalty`, times 1 + ‖gap‖/‖stale_grad‖ where `gap` (how far φ moved since the stale average
    was measured from) is given (the staleness-adaptive option)."""
    if gap is None:
        return penalty
    norm = float(stale_grad.norm())
    return penalty * (1.0 + float(gap.norm()) / norm) if norm > 0 else penalty


def co2_outer_step(slow: torch.Tensor, stale_grad: torch.Tensor, momentum: torch.Tensor, lr: float, mu: float,
                   penalty: float, clip: float | None) -> None:
    """m ← clamp(μ·m + ḡ/p, −c, c), then φ ← φ − lr·m, in place on `momentum` and `slow` (§4)."""
    momentum.mul_(mu).add_(stale_grad, alpha=1.0 / penalty)
    if clip is not None:
        momentum.clamp_(-clip, clip)
    slow.sub_(lr * momentum)
