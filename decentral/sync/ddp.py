"""Data parallel baseline: average gradients over every member before every inner step.

It sends the whole model's gradients every step, which is what the low-communication protocols
are measured against. Members are re-read every `membership_every` steps (an epoch, the protocol's
"round"), and at once after an average that did not commit; a member that an average committed without
(gone or silent: the others redid it without that member) is out of the group from the next step on.

Every replica must hold the same weights and the same inner optimizer state, or the same averaged
gradient moves them apart: a rolled-back average is a zero gradient for every replica; a newcomer
takes the weights *and* the optimizer's state, so it steps exactly as the others from its first step;
and replicas compare state digests every epoch (decentral.sync.base).

A newcomer joins at the next step, not the next epoch: it asks a member (its donor) to take it in
(`Transport.request_join`); the donor names it in the note of its next average, and every member whose
average commits knows every note it counted, so all of them add the newcomer to the group from the
following step on. The donor hands the newcomer its state once that step's update is applied. A
donor whose average did not commit names the newcomer again at its next step.
"""

from __future__ import annotations

import torch

from decentral.checkpoint import inner_tensors, optimizer_state_dict, optimizer_tensors
from decentral.sync.base import SyncProtocol, SyncReport, check_count, check_snapshot_names
from decentral.transport import ForeignState, JoinRequest, Transport, check_same_model

MAX_JOINS_PER_STEP = 8  # newcomers one member's note may name (more wait for later steps)


class DDP(SyncProtocol):
    name = "ddp"
    shares_state = True
    identical_replicas = True
    joins_next_step = True
    rounds_ahead = 2  # a newcomer takes part from its offered state's round, and the step it is taken in at
    # (`_join_next_step`) can open the round after it

    def __init__(self, model, optimizer: torch.optim.Optimizer, transport: Transport, *, membership_every: int = 20):
        super().__init__(model, optimizer, transport)
        check_count(membership_every, "membership_every (steps between reads of the members)")
        self.membership_every = membership_every
        self._group: list[str] = []
        self._step_report: SyncReport | None = None
        self._joining: set[str] = set()  # newcomers every member averages with from the next step on
        self._asking: list[JoinRequest] = []  # newcomers that asked us, not yet named in a committed average
        self._handing: list[JoinRequest] = []  # named in this step's committed average: our state after it is theirs

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Weights and the inner optimizer's state (copies)."""
        inner = {k: v.detach().cpu().clone() for k, v in optimizer_tensors(self.optimizer).items()}
        return {"weights": _flat(self.params), **inner}

    def memory_copies(self) -> list[str]:
        return ["weights (offered)", "inner optimizer state (offered; 2 model-sized vectors for AdamW)"]

    def snapshot_meta(self) -> dict:
        return {"param_groups": self.optimizer.state_dict()["param_groups"]}

    def _offer(self) -> str | None:
        """Our state is the epoch's snapshot only at the epoch's first step: a newcomer that joined at a later
        one offers (and publishes a digest) from the next epoch on."""
        return super()._offer() if self.step == self._round_start else None

    def _join_next_step(self, donor: str, round: int) -> tuple[dict, dict[str, torch.Tensor], int] | None:
        """Ask `donor` to take us in from its next step, taking part in its rounds from `round` on (its members'
        pushes of our first step may come before its state does); (meta, tensors, that step), or None."""
        self._join_rounds(round, first=True)
        got = self.transport.request_join(donor)
        if got is None or got[0].get("protocol") != self.name or not all(
                isinstance(got[0].get(k), int) for k in ("round", "step", "joined_step")):
            return None
        meta, tensors = got
        return meta, tensors, meta["joined_step"]

    def check_snapshot(self, tensors: dict[str, torch.Tensor]) -> None:
        """The weights, as many as ours (the inner optimizer's state is checked as it is loaded)."""
        check_snapshot_names(self.name, tensors, ["weights"])
        check_same_model(tensors["weights"], _flat(self.params))

    def load_snapshot(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        """The donor's weights and inner optimizer state; ForeignState, before the weights are taken, when that
        state is not one of an optimizer like ours (torch checks its parameter groups)."""
        self.check_snapshot(tensors)
        try:
            self.optimizer.load_state_dict(optimizer_state_dict(inner_tensors(tensors), meta.get("param_groups")))
        except (KeyError, TypeError, ValueError) as e:
            raise ForeignState(f"the ddp state handed over has an inner optimizer state ours cannot take "
                               f"({type(e).__name__}: {e}): a peer of another optimizer or version") from None
        _copy_flat(tensors["weights"], self.params)
        group = meta.get("group")  # a donor of our next step names its members then; else we look them up
        self._group = sorted(group) if isinstance(group, list) and all(isinstance(p, str) for p in group) else []

    def before_step(self) -> None:
        if self.step % self.membership_every == 0 or not self._group:
            self._group = self._members(self.round)
        self._group, self._joining = self._next_group(), set()
        self._asking = [r for r in self._asking + self.transport.join_requests() if r.waiting]
        naming = self._asking[:MAX_JOINS_PER_STEP]
        note = {"join": [r.peer for r in naming]} if naming else None
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = _flat(grads)
        result, waited = self._timed_average(flat, self._group, f"ddp/{self.step}", note)
        if result.complete:  # every member that committed counted the same notes: all add the same newcomers
            self._group = result.group  # without those a redo left out (gone or silent): they cost one step
            self._joining = self._live({p for n in result.notes.values() for p in _named(n)})
            self._handing = [r for r in naming if r.peer in self._joining]
            for request in naming:
                if request.peer not in self._joining:
                    request.grant(None)  # no live heartbeat: the others did not add it either
            self._asking = [r for r in self._asking if r not in naming]
        elif len(result.group) > 1:
            result.tensor.zero_()  # rolled back: every replica steps on a zero gradient, and none drifts
            self._group = []  # the members may see another list by the next step
        _copy_flat(result.tensor, grads)
        for p, g in zip(self.params, grads):
            p.grad = g if p.requires_grad else None  # frozen since the protocol was made: the optimizer skips it
        self._step_report = SyncReport.of(self.step, result, waited)

    def _live(self, named: set[str]) -> set[str]:
        """Of the newcomers a committed average named, those in the group already or with a live heartbeat
        (in the swarm, a record each peer signs for itself), looked up afresh: a member cannot add made-up
        peers to everyone's group."""
        if named <= set(self._group):
            return named
        alive = self._waiting_on(self.transport.progress)
        return {p for p in named if p in self._group or p in alive}

    def _next_group(self) -> list[str]:
        """The members of our next step: this step's, and the newcomers its committed average named."""
        return sorted({*self._group, *self._joining})

    def after_step(self) -> SyncReport | None:
        """Hand our state to the newcomers named in this step's average. At an epoch boundary, first: offer
        our state to newcomers, compare it with the others', announce the next epochs; report the last step."""
        report = self._close_epoch() if self.step % self.membership_every == 0 else None
        if self._handing:
            meta = {"protocol": self.name, "round": self.round, "step": self._round_start, "joined_step": self.step,
                    "group": self._next_group(), **self.snapshot_meta()}
            state = self.snapshot()
            for request in self._handing:
                request.grant((meta, state))
            self._handing = []
        return report

    def _close_epoch(self) -> SyncReport | None:
        """The epoch boundary's work (see `after_step`); the last step's report."""
        self.round, self._round_start = self.step // self.membership_every, self.step
        self._offer()
        report = self._step_report
        if report is not None:
            self._check_replicas(report.group, report)
            report.digest = self._digests[self.round]
        self._join_rounds(self.round + 1)
        return report


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`tensors` (on one device) as one flat float32 vector on the CPU, a copy, whatever their dtypes."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors]).cpu()


def _copy_flat(vector: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Consecutive pieces of the flat `vector` into `tensors`, in place (moved to their device once, cast to each
    one's dtype: a model that keeps some layers in float32 beside bfloat16 ones keeps them so)."""
    vector = vector.to(tensors[0].device)
    with torch.no_grad():
        for t, piece in zip(tensors, vector.split([t.numel() for t in tensors])):
            t.copy_(piece.view_as(t))


def _named(note: object) -> list[str]:
    """The newcomers a member's note names (nothing, when it is malformed)."""
    joins = note.get("join") if isinstance(note, dict) else None
    if not isinstance(joins, list):
        return []
    return [p for p in joins[:MAX_JOINS_PER_STEP] if isinstance(p, str)]
