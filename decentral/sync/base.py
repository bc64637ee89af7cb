"""The one interface every sync protocol offers, and the machinery that outer-step protocols share.

A protocol wraps the user's model and inner optimizer and hooks the optimizer's `step`, so a plain
training loop adopts it in two lines:

    with NoLoCo(model, optimizer, transport, every=50) as sync:
        for x, y in data:
            loss = model(x, y)[1]; loss.backward(); optimizer.step(); optimizer.zero_grad()

`before_step` runs after backward and before the inner step (gradient protocols such as DDP);
`after_step` after it (outer-step protocols such as DiLoCo and NoLoCo).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from decentral.transport import Transport


class DivergedError(RuntimeError):
    """Local training produced non-finite values; nothing was sent to peers."""


@dataclass
class SyncReport:
    """What one synchronisation did, for logs and metrics."""

    round: int
    group: list[str]
    complete: bool
    contributors: int
    wait_s: float
    rejected: dict[str, str] = field(default_factory=dict)
    spread: float | None = None  # RMS distance of our slow weights from the group's mean, where known
    rolled_back: bool = False  # the average did not commit: outer state unchanged, the fast weights train on


class SyncProtocol:
    """Base: counts inner steps and time spent waiting on the network; hooks the optimizer."""

    name = "base"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport):
        self.model = model
        self.optimizer = optimizer
        self.transport = transport
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.step = 0  # inner steps done by this worker
        self.round = 0  # outer rounds done by the swarm (agreed through state transfer)
        self.wait_s = 0.0  # cumulative seconds blocked on the network
        self._report: SyncReport | None = None
        self._hooks: list = []

    # ----- the user's loop -----
    def __enter__(self) -> "SyncProtocol":
        self.start()
        self._hooks = [
            self.optimizer.register_step_pre_hook(lambda *_: self.before_step()),
            self.optimizer.register_step_post_hook(lambda *_: self._after_step()),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _after_step(self) -> None:
        self.step += 1
        report = self.after_step()
        if report is not None:
            self._report = report
        self.transport.set_progress(self.step, self.round)

    def pop_report(self) -> SyncReport | None:
        """The report of the latest synchronisation not yet popped, if any."""
        report, self._report = self._report, None
        return report

    # ----- what protocols override -----
    def start(self) -> None:
        """Join the swarm: catch up with the peers' state, then announce the coming rounds."""
        self.transport.join_rounds(self.round)

    def before_step(self) -> None:
        """Called after backward, before the inner optimizer step."""

    def after_step(self) -> SyncReport | None:
        """Called after each inner step; returns a report when it synchronised (or has news to log)."""
        return None

    def state_dict(self) -> dict:
        """Everything besides model and inner optimizer needed to resume (JSON meta + tensors)."""
        return {"meta": {"protocol": self.name, "step": self.step, "round": self.round}, "tensors": {}}

    def load_state_dict(self, state: dict) -> None:
        meta = state["meta"]
        if meta.get("protocol") != self.name:
            raise ValueError(f"state is for protocol {meta.get('protocol')!r}, this is {self.name!r}")
        self.step, self.round = int(meta["step"]), int(meta["round"])

    # ----- helpers -----
    def _timed_average(self, flat: torch.Tensor, group: list[str], tag: str):
        start = time.perf_counter()
        result = self.transport.average(flat, group, tag)
        waited = time.perf_counter() - start
        self.wait_s += waited
        return result, waited

    def _members(self, round: int) -> list[str]:
        start = time.perf_counter()
        members = self.transport.members(round)
        self.wait_s += time.perf_counter() - start
        if self.transport.peer_id not in members:  # our announcement may not have propagated yet
            members = sorted([*members, self.transport.peer_id])
        return members


class OuterProtocol(SyncProtocol):
    """Shared by protocols that keep slow weights φ and sync every `every` inner steps.

    φ and the outer state live as flat fp32 CPU vectors. After each outer step the protocol offers
    a snapshot of them to newcomers, and newcomers start from a donor's snapshot.
    """

    def __init__(self, model, optimizer, transport: Transport, *, every: int):
        super().__init__(model, optimizer, transport)
        if every < 1:
            raise ValueError(f"every (H, inner steps per outer step) must be >= 1, got {every}")
        self.every = every
        self.slow = self._fast_vector().clone()
        self._round_start = 0

    def _fast_vector(self) -> torch.Tensor:
        return parameters_to_vector(self.params).detach().to(device="cpu", dtype=torch.float32)

    def _load_fast(self, vector: torch.Tensor) -> None:
        """θ ← vector, by copy: `vector_to_parameters` makes the parameters views of what it is given,
        and inner steps must never write into φ."""
        ref = self.params[0]
        vector_to_parameters(vector.to(device=ref.device, dtype=ref.dtype, copy=True), self.params)

    def outer_tensors(self) -> dict[str, torch.Tensor]:
        """Outer state besides φ (momentum and the like), flat fp32."""
        return {}

    def start(self) -> None:
        """Catch up with the swarm: its slow weights, outer state, round and inner step (so the LR
        schedule and `--steps` are the swarm's), taken at a round boundary."""
        got = self._fetch_at_boundary()
        if got is not None:
            meta, tensors = got
            self._load_outer(meta, tensors)
            self.step = int(meta.get("step", self.step))
        self._load_fast(self.slow)
        self._offer()
        self._round_start = self.step
        super().start()

    def _fetch_at_boundary(self, poll_s: float = 0.25) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """The swarm's outer state, when it is ahead of ours. A donor that has trained past the snapshot
        it offers is in the middle of a round, whose members are already fixed: we announce the rounds
        from the next one on (so the announcement has a round to reach everyone), wait for the donor's
        snapshot of that round and join there, rather than make a round wait for our H inner steps."""
        target = None  # the round we announced and wait for
        while True:
            got = self.transport.fetch_state(have=self._outer_state())
            if got is None:
                return None
            donor, (meta, tensors) = got
            if meta.get("protocol") != self.name or int(meta.get("round", -1)) < self.round:
                return None
            snapshot_round, snapshot_step = int(meta["round"]), int(meta.get("step", 0))
            if snapshot_round == target:
                return meta, tensors
            if target is None and self.transport.progress().get(donor, {}).get("step", snapshot_step) <= snapshot_step:
                return meta, tensors  # the donor has not trained since: we are at a boundary already
            target = snapshot_round + 1
            self.transport.join_rounds(target)
            start = time.perf_counter()
            while self.transport.progress().get(donor, {}).get("round", target) < target:
                time.sleep(poll_s)  # polling the donor's heartbeat until its round ends
            self.wait_s += time.perf_counter() - start

    def _load_outer(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        if tensors["slow"].shape != self.slow.shape:
            raise ValueError(
                f"the swarm's model has {tensors['slow'].numel()} parameters, ours has {self.slow.numel()}: "
                "the recipes differ"
            )
        self.round = int(meta["round"])
        self.slow = tensors["slow"].float().clone()
        for name, value in self.outer_tensors().items():
            value.copy_(tensors[name])

    def _outer_state(self) -> dict[str, torch.Tensor]:
        """A copy of the state newcomers download: slow weights and the protocol's outer tensors."""
        return {"slow": self.slow.clone(), **{k: v.clone() for k, v in self.outer_tensors().items()}}

    def _offer(self) -> None:
        self.transport.offer_state({"protocol": self.name, "round": self.round, "step": self.step},
                                   self._outer_state())

    def after_step(self) -> SyncReport | None:
        if self.step - self._round_start < self.every:
            return None
        fast = self._fast_vector()
        if not bool(torch.isfinite(fast).all()):
            raise DivergedError(f"non-finite weights after inner step {self.step}; not syncing them")
        report = self.outer_step(fast)
        self.round += 1
        self._round_start = self.step
        if not report.rolled_back:
            self._load_fast(self.slow)
        self._offer()
        self.transport.join_rounds(self.round + 1)
        return report

    def outer_step(self, fast: torch.Tensor) -> SyncReport:
        """Update self.slow (and outer state) from our fast weights and the peers'; one round."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["tensors"] = {"slow": self.slow, **self.outer_tensors()}
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._load_outer(state["meta"], state["tensors"])
        self._round_start = self.step
