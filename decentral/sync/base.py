"""The one interface every sync protocol offers, and the machinery that outer-step protocols share.

A protocol wraps the user's model and inner optimizer and hooks the optimizer's `step`, so a plain
training loop adopts it in two lines:

    with NoLoCo(model, optimizer, transport, every=50) as sync:
        for x, y in data:
            loss = model(x, y)[1]; loss.backward(); optimizer.step(); optimizer.zero_grad()

`before_step` runs after backward and before the inner step (gradient protocols such as DDP);
`after_step` after it (outer-step protocols such as DiLoCo and NoLoCo).

Replicas never split (protocols whose members must hold identical state: DDP, DiLoCo): at every round
boundary a protocol offers a snapshot of its state and publishes the snapshot's digest with its
heartbeat. One boundary later (when the others' digests have long arrived) it compares its digest of
the previous round with its group's; a peer that held another state than the group's majority (the
lowest peer id's digest breaks a tie) downloads the majority's state of the current round from one of
the peers that held it, checks it against the digest they publish, and goes on from there. This
catches what the averages' commit phase cannot: a member that died inside the commit phase, a
late joiner that missed a round, anything that made a replica's bits differ. A peer the others averaged a
round without (they said so) takes their state at that boundary instead, by replaying their average on its
state of the round before (which was theirs: every member keeps its last round, decentral.rounds), or
downloading it when that fails.

A newcomer whose state arrives rounds old (a download longer than a round) catches up by replaying the
rounds since from their committed averages (`_replayed`, protocols that `replays_rounds`: DiLoCo, Streaming
DiLoCo, CO2), each checked against the digest of the state it led to; it downloads the state again only
when no member kept them, or when a replayed round's result differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import numbers
import time
import weakref
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterator, TypeVar

import torch

from decentral.transport import (AverageResult, EncodedAverage, ForeignState, StateUnavailable, Transport, all_finite,
                                 check_same_model, heartbeat_digest, state_digest, with_us)
from decentral.vml import resolve_kernels

log = logging.getLogger(__name__)
progress_log = logging.getLogger("decentral.progress")  # shown without --verbose: the CLI sets it to INFO

ASK_STATE_AGAIN_S = 1.0  # a newcomer whose state downloads all failed asks again this much later

KEPT_DIGESTS = 3  # rounds whose digest of our own state we remember
DONORS_GONE_S = 2.0  # a repair whose donors have all been missing from the heartbeats this long gives up: they left

T = TypeVar("T")

_HOOKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, str] = weakref.WeakKeyDictionary()  # optimizer -> the
# name of the protocol whose `with` block hooks it now


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
    spread: float | None = None  # RMS distance of our slow weights from the group's (mean or majority), where known
    rolled_back: bool = False  # the average did not commit: outer state unchanged, the fast weights train on
    digest: str | None = None  # state_digest of what we hold after this round (replicas that agree hold the same)
    repaired: bool = False  # our state differed from the group's majority and was replaced by it
    held_by: tuple[str, float] | None = None  # the member that held the average up longest, and by how long
    # (AverageResult.held_by)

    @classmethod
    def of(cls, round: int, result: AverageResult, wait_s: float, **more) -> SyncReport:
        """The report of a synchronisation whose one average gave `result`, waited for `wait_s` seconds."""
        return cls(round, result.group, result.complete, result.contributors, wait_s, result.rejected,
                   held_by=result.held_by, **more)


class SyncProtocol:
    """Base: counts inner steps and time spent waiting on the network; hooks the optimizer; hands its
    state to newcomers and keeps replicas identical (see the module docstring).

    A protocol that shares state overrides `snapshot`, `load_snapshot` and sets `shares_state`;
    `identical_replicas` says whether its members must hold bit-identical snapshots after a round.
    """

    name = "base"
    syncs_parameters = True  # False: the protocol never syncs the model (`local`), so unfreezing one is no error
    shares_state = False
    identical_replicas = False
    weights_key = "weights"  # the snapshot tensor whose distance between replicas is their spread
    error_feedback = False  # keeps what a codec did not send and sends it again (see Transport.error_feedback)
    repair_timeout_s = 60.0  # how long a split replica waits for the majority's state of a round
    join_timeout_s = 60.0  # how long a newcomer asks again when the swarm's state downloads fail
    outer_device = torch.device("cpu")  # where the outer state lives and averages' results are brought
    joins_next_step = False  # a newcomer mid-round asks its donor to take it in at its next step (DDP)
    replays_rounds = False  # a newcomer whose state is rounds old replays the rounds since (`_apply_average`)
    rounds_ahead = 1  # the most rounds a member in step can be past the latest one another began an average of:
    # one, as each begins round r's average before it trains round r + 1 (CO2, NoLoCo and DDP say two); a member
    # further behind is not waited for (Transport.join_rounds' `ahead`)
    hook_before_step = True  # False: whoever runs the loop calls `before_step` itself, after backward (Lightning,
    # whose optimizer step runs the backward in a closure, after the optimizer's step pre-hooks)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport):
        if transport.error_feedback and not self.error_feedback:
            raise ValueError(f"the transport's codec sends a small part of each tensor; {self.name} keeps no "
                             "error feedback for the rest: use a dense codec (float16, int8, ...)")
        resolve_kernels()  # before our averages' threads (and our peers', in tests) compute: decentral.vml
        self.model = model
        self.optimizer = optimizer
        self.transport = transport
        self.params = [p for p in model.parameters() if p.requires_grad]  # the parameters synced, for the whole run
        if not self.params:
            raise ValueError("the model has no parameters that require grad: nothing to train or sync")
        self._synced_ids = {id(p) for p in self.params}
        ours = {id(p) for p in model.parameters()}
        foreign = sum(id(p) not in ours for group in optimizer.param_groups for p in group["params"])
        if foreign:
            raise ValueError(f"the optimizer holds {foreign} parameter(s) that are not the model's: the protocol syncs "
                             "the model's parameters, so the optimizer must be the one that trains them")
        self.step = 0  # inner steps done by this worker
        self.round = 0  # outer rounds done by the swarm (agreed through state transfer)
        self.wait_s = 0.0  # cumulative seconds blocked on the network
        self._waiting_since: float | None = None  # the start of the wait under way (`_waiting`)
        self._report: SyncReport | None = None
        self._hooks: list = []
        self._entered = False  # a protocol's `with` block is its whole run: entered once
        self._digests: dict[int, str] = {}  # round -> state_digest of our snapshot after it
        self._asked: set[str] = set()  # members we averaged with in this round (replicas only)
        self._left_out: set[str] = set()  # those of them that said they averaged without us, or averaged over
        # another member list (neither counted the other's part)
        self._round_start: int | None = None  # the inner step at which the current round began (set by `start`)
        self.join_within_steps = 0  # a newcomer joins a round its donor is at most this many steps into
        self.donor: str | None = None  # the peer whose state we joined the swarm with, if any
        self.onlooking = False  # a newcomer training the round under way without being a member of it
        self._members_ahead: tuple[int, Future[list[str]]] | None = None  # (round, its members' lookup under way)
        self._offered: tuple[dict, dict[str, torch.Tensor]] | None = None  # our snapshot offered last (protocols
        # that `replays_rounds`): a member the others averaged without replays their round on it (`_repair`)
        self._unentered_guard = optimizer.register_step_pre_hook(_refuse_unentered(weakref.ref(self)))

    # ----- the user's loop -----
    def __enter__(self) -> "SyncProtocol":
        if self._entered:
            raise RuntimeError(f"this {self.name} protocol was entered before: its `with` block is the whole run "
                               "(leaving it finishes the run); make a new protocol for another")
        if self.optimizer in _HOOKED:
            raise RuntimeError(f"the optimizer is hooked by a {_HOOKED[self.optimizer]} protocol already (inside its "
                               "`with` block): one protocol per optimizer")
        self.start()
        self._entered = True
        self._unentered_guard.remove()
        _HOOKED[self.optimizer] = self.name
        self._hooks = [self.optimizer.register_step_post_hook(lambda *_: self._after_step())]
        if self.hook_before_step:
            self._hooks.append(self.optimizer.register_step_pre_hook(lambda *_: self.before_step()))
        return self

    def __exit__(self, exc_type, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        _HOOKED.pop(self.optimizer, None)
        if exc_type is None:
            self.finish()

    def _after_step(self) -> None:
        self._check_none_unsynced()
        self.step += 1
        report = self.after_step()
        if report is not None:
            self._report = report
        self.transport.set_progress(self.step, self.round)

    def _check_none_unsynced(self) -> None:
        """RuntimeError when a parameter of the model requires grad that did not when the protocol was made
        (unfrozen since): it trains, but is not synced, so each replica's copy of it would drift apart unseen.
        One frozen since is no error: it stays synced (and takes no outer momentum: `_drop_frozen_momentum`)."""
        if not self.syncs_parameters:
            return
        unsynced = [name for name, p in self.model.named_parameters()
                    if p.requires_grad and id(p) not in self._synced_ids]
        if unsynced:
            shown = ", ".join(unsynced[:3]) + (", ..." if len(unsynced) > 3 else "")
            raise RuntimeError(
                f"{len(unsynced)} parameter(s) of the model require grad now that did not when the {self.name} "
                f"protocol was made ({shown}): it syncs only those that did, so each replica would train its own copy "
                "of these. Make the protocol once they require grad (one that must not train yet stays out of the "
                "optimizer until optimizer.add_param_group), or leave its `with` block and make a new protocol after "
                "unfreezing")

    def pop_report(self) -> SyncReport | None:
        """The report of the latest synchronisation not yet popped, if any."""
        report, self._report = self._report, None
        return report

    # ----- what protocols override -----
    def start(self) -> None:
        """Join the swarm: catch up with its state, round and inner step (so the LR schedule and `--steps`
        are the swarm's), offer our own, announce the coming rounds. A round begins at our step unless a saved
        state (`load_state_dict`) said where ours began."""
        if self._round_start is None:
            self._round_start = self.step
        if self.shares_state:
            self._take_swarm_state(onlook=True, keep_asking_s=self.join_timeout_s)
            self._offer()
        self._join_rounds(self.first_round)

    def _join_rounds(self, round: int, first: bool = False) -> None:
        """Transport.join_rounds with our protocol's lead (`rounds_ahead`)."""
        self.transport.join_rounds(round, first=first, ahead=self.rounds_ahead)

    @property
    def first_round(self) -> int:
        """The first round we take part in: the one under way, or for an onlooker the next."""
        return self.round + 1 if self.onlooking else self.round

    def _take_swarm_state(self, *, onlook: bool = False, after_round: int | None = None, keep_asking_s: float = 0.0,
                          replay_ours: bool = False) -> bool:
        """Go on from the swarm's state, round and inner step when the swarm is ahead of us (see
        `_fetch_to_join`); False when it is not, or when nobody handed over the state offered. With
        `keep_asking_s`, StateUnavailable then instead, once asked again for that long (a newcomer that went
        on from step 0 would train the whole run on its own)."""
        got = self._fetch_to_join(onlook=onlook, after_round=after_round, keep_asking_s=keep_asking_s,
                                  replay_ours=replay_ours)
        if got is None:
            return False
        self.donor, meta, tensors, step = got
        self.load_snapshot(meta, tensors)
        self.round, self._round_start, self.step = int(meta["round"]), int(meta.get("step", step)), step
        return True

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the state a newcomer needs to go on with us, as flat named tensors."""
        raise NotImplementedError

    def snapshot_meta(self) -> dict:
        """JSON metadata that travels with `snapshot` (besides protocol, round and step)."""
        return {}

    def load_snapshot(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Take a donor's snapshot (its round and step are the caller's to take)."""
        raise NotImplementedError

    def check_snapshot(self, tensors: dict[str, torch.Tensor]) -> None:
        """ForeignState unless a donor's snapshot `tensors` is one we can take, checked before any of it is used
        (a round replayed on it, or `load_snapshot`); here: anything."""

    def _apply_average(self, tensors: dict[str, torch.Tensor], average: torch.Tensor) -> None:
        """A round's update, in place, of a snapshot's `tensors` by the round's committed `average`: what every
        member does to its own state at the round's end (protocols that `replays_rounds`)."""
        raise NotImplementedError

    def _on_repaired(self, before: dict[str, torch.Tensor]) -> None:
        """After `load_snapshot` replaced our state `before` in mid-training (a repair)."""

    def _on_rejoined(self) -> None:
        """After `_take_swarm_state` replaced our state, round and step in mid-training (see `_rejoin`)."""

    def memory_copies(self) -> list[str]:
        """What the protocol keeps besides the model and the inner optimizer: one name per model-sized
        float32 vector (on `outer_device`; the offered copies on the CPU; the worker prints them at start)."""
        return []

    def catch_up(self) -> None:
        """Called after waiting for peers (a worker's `--min-peers`), inside the `with` block before the first
        step: a protocol whose members share one state joins the ones that came since `start` when they are
        rounds ahead (what `start` does when they are there first)."""

    def finish(self) -> None:
        """Called when training ends without an error (leaving the `with` block): a protocol with work
        in the background completes it here, so the model holds everything trained."""

    def before_step(self) -> None:
        """Called after backward, before the inner optimizer step."""

    def after_step(self) -> SyncReport | None:
        """Called after each inner step; returns a report when it synchronised (or has news to log)."""
        return None

    def state_dict(self) -> dict:
        """Everything besides model and inner optimizer needed to resume (JSON meta + tensors)."""
        return {"meta": {"protocol": self.name, "step": self.step, "round": self.round,
                         "round_start": self._round_start}, "tensors": {}}

    def load_state_dict(self, state: dict) -> None:
        meta = state["meta"]
        if meta.get("protocol") != self.name:
            raise ValueError(f"state is for protocol {meta.get('protocol')!r}, this is {self.name!r}")
        self.step, self.round = int(meta["step"]), int(meta["round"])
        began = meta.get("round_start")  # None: saved before its start, or before the round's start was kept
        self._round_start = self.step if began is None else int(began)

    # ----- helpers -----
    def _timed_average(self, flat: torch.Tensor, group: list[str], tag: str, note: dict | None = None
                       ) -> tuple[AverageResult, float]:
        """The group's average of `flat` for this round (`note`: see Transport.average), waited for; (result,
        seconds waited)."""
        start = time.perf_counter()
        return self._counted(self.transport.average(flat, group, tag, self.round, note), group, start)

    def _await_average(self, future: Future[AverageResult]) -> tuple[AverageResult, float]:
        """The result of an average launched with `transport.average_async`, waited for."""
        start = time.perf_counter()
        result = future.result()
        return self._counted(result, result.group, start)

    def _counted(self, result: AverageResult, group: list[str], start: float) -> tuple[AverageResult, float]:
        """Count the wait for `result` since `start` in `wait_s`; note who averaged without us (replicas);
        `result` with its tensors on `outer_device`."""
        waited = time.perf_counter() - start
        self.wait_s += waited
        if self.identical_replicas:
            self._asked.update(group, result.left_out, result.elsewhere)  # a redo's group lacks these (CO2's)
            self._left_out.update(result.left_out, result.elsewhere)
        if result.tensor.device != self.outer_device:
            result = dataclasses.replace(result, tensor=result.tensor.to(self.outer_device),
                                         sent=result.sent.to(self.outer_device))
        return result, waited

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """The block's time counts in `wait_s`, once: a wait inside another (a replay inside a repair) is the
        outer one's."""
        if self._waiting_since is not None:
            yield
            return
        self._waiting_since = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - self._waiting_since
            self._waiting_since = None

    def _waiting_on(self, call: Callable[[], T]) -> T:
        """`call()` (a lookup on the network), its time counted in `wait_s`."""
        with self._waiting():
            return call()

    def _members(self, round: int) -> list[str]:
        """`round`'s members, with us: the lookup `_look_up_members_ahead` started for it, else one now."""
        ahead, self._members_ahead = self._members_ahead, None
        look_up = ahead[1].result if ahead is not None and ahead[0] == round else lambda: self.transport.members(round)
        return with_us(self._waiting_on(look_up), self.transport.peer_id)

    def _look_up_members_ahead(self) -> None:
        """Start the lookup of this round's members for `_members` at the round's end, so that its time (DHT
        reads on a swarm) overlaps the round's last inner step instead of adding to every member's wait at
        the boundary (the others wait for the slowest member's lookup too)."""
        self._members_ahead = (self.round, self.transport.members_async(self.round))  # started, not waited for

    def _offered_meta(self) -> dict:
        """The meta of our snapshot of this round (the step is where the round began)."""
        return {"protocol": self.name, "round": self.round, "step": self._round_start, **self.snapshot_meta()}

    def _offer(self, led_by: EncodedAverage | None = None) -> str:
        """Serve our snapshot of this round to newcomers and publish its digest; returns the digest. `led_by`:
        the committed average that turned the previous snapshot into this one (see Transport.offer_state)."""
        meta, tensors = self._offered_meta(), self.snapshot()
        digest = state_digest(tensors)
        self.transport.offer_state(meta, tensors, digest, led_by)
        if self.replays_rounds:
            self._offered = meta, tensors  # offered: never changed in place (the transport holds it too)
        self._digests = {r: d for r, d in self._digests.items() if r > self.round - KEPT_DIGESTS}
        self._digests[self.round] = digest
        self.transport.set_progress(self.step, self.round, digest)
        return digest

    def _fetch_to_join(self, *, onlook: bool = False, after_round: int | None = None, keep_asking_s: float = 0.0,
                       replay_ours: bool = False, poll_s: float = 0.25
                       ) -> tuple[str, dict, dict[str, torch.Tensor], int] | None:
        """(donor, meta, tensors, step): the swarm's state of a round and the inner step we go on from,
        when the swarm is ahead of us. A donor's snapshot is the state its current round began from.

        A donor at most `join_within_steps` into that round: we join the round under way at the donor's
        step (its heartbeat's, when that is further than when it served us), training its remaining
        steps from the round's starting state, so the round ends for us when it ends for the others and
        nobody waits for us; our announcement has the rest of the round to reach the members. A donor
        further in: we announce the rounds from the next one on; with `onlook`, where the protocol
        `_can_onlook`, we go on from the donor's step as an onlooker (`self.onlooking`: we train the rest
        of the round from its starting state, no member of it, and `_end_onlooking` takes the members'
        state of the next round at its end), or where it can `_join_next_step` we join the donor's group at
        its next step with its state there (DDP), else we wait for the donor's snapshot of the next round.
        `after_round`: only the state of a later round will do (we announced the one after it), waited for.
        Downloads that all fail: None without `keep_asking_s`; with it, asked again for that long, then
        StateUnavailable; so too when every peer has left since (we would otherwise go on from step 0, alone).
        When the donor has gone past the round we wait for before we fetch, we join at the snapshot it
        offers then: the rounds we announced and miss go on without us (we answer their pushes "not in
        this round").
        Where the protocol `replays_rounds`, a snapshot rounds older than its donor's round is brought up to
        that round by the rounds since (`_replayed`), and a later round's state is waited for by replaying the
        rounds after the one we hold, not by a download; with `replay_ours`, the rounds after our own state
        (our donor's, which we have not changed since) bring us to `after_round + 1` (without `after_round`: to
        the donor's round, joined as a newcomer joins it)."""
        target = None if after_round is None else after_round + 1  # the round we announced and wait for
        deadline, failed = time.monotonic() + keep_asking_s, None
        replays = self.replays_rounds  # until a replayed round's result differs from its digest: downloads then
        held = None  # (donor, meta, tensors): a state of a round before `target`, to replay from
        if replay_ours and replays and self.donor is not None:
            held = self.donor, self._offered_meta(), {k: v.clone() for k, v in self.snapshot().items()}
        while True:
            replaying = held is not None
            if replaying:
                if target is not None:
                    self._wait_for_round(held[0], target, poll_s)
                got, held = (held[0], held[1:]), None
            else:
                try:
                    got = self.transport.fetch_state(  # a newcomer that joins at the next step needs no snapshot
                        have=self.snapshot(), meta_if_past=onlook and target is None and self.joins_next_step)
                except StateUnavailable as e:
                    if not keep_asking_s:  # in mid-run: nobody served it this time
                        log.warning("%s", e)
                        return None
                    if time.monotonic() >= deadline:
                        raise StateUnavailable(f"{e}; asked for {keep_asking_s:.0f}s: the swarm may have ended its "
                                               "run, or its peers cannot reach us") from None
                    if failed is None:
                        log.warning("%s; asking again for up to %.0fs", e, keep_asking_s)
                    failed = e
                    time.sleep(ASK_STATE_AGAIN_S)  # the donors were busy, or left: their heartbeats say who is alive
                    continue
            if got is None:
                if failed is not None and set(self.transport.progress()) <= {self.transport.peer_id}:
                    raise StateUnavailable(f"{failed}; since then every peer has left (the swarm ended its run, or "
                                           "died): nothing to join")
                return None
            donor, (meta, tensors) = got
            if meta.get("protocol") != self.name or int(meta.get("round", -1)) < self.round:
                return None
            if tensors:
                self.check_snapshot(tensors)
            if replays and tensors:
                replayed = self._replayed(donor, meta, tensors)
                replays = replayed is not None
                if replayed is None or (replaying and replayed[0]["round"] == meta["round"]):
                    continue  # a round's result differed, or the donor kept no rounds since: download the state
                meta, tensors = replayed
            snapshot_round, snapshot_step = int(meta["round"]), int(meta.get("step", 0))
            if target is not None and snapshot_round >= target:
                if snapshot_round > target:
                    self._join_rounds(snapshot_round, first=True)
                return donor, meta, tensors, snapshot_step
            if target is None:
                heartbeat = self.transport.progress().get(donor)
                live = heartbeat.get("step") if isinstance(heartbeat, dict) else None
                donor_step = max(int(meta.get("donor_step", snapshot_step)), live if isinstance(live, int) else 0)
                if donor_step <= snapshot_step + self.join_within_steps:
                    return donor, meta, tensors, max(donor_step, snapshot_step)
                if onlook and self._can_onlook(snapshot_step, donor_step):
                    self._join_rounds(snapshot_round + 1, first=True)
                    self.onlooking = True
                    return donor, meta, tensors, donor_step
                joined = self._join_next_step(donor, snapshot_round) if onlook else None
                if joined is not None:
                    return donor, *joined
            target = max(target or 0, snapshot_round + 1)
            self._join_rounds(target, first=True)
            if replays and tensors:
                held = donor, meta, tensors  # waited for, then replayed up to that round
            else:
                self._wait_for_round(donor, target, poll_s)

    def _wait_for_round(self, donor: str, round: int, poll_s: float = 0.25, timeout_s: float = float("inf")) -> bool:
        """Until `donor`'s heartbeat reports `round` (or it is gone), counted in `wait_s`; False when `timeout_s`
        passed first."""
        start = time.perf_counter()
        with self._waiting():
            while heartbeat_round(self.transport.progress().get(donor), round) < round:
                if time.perf_counter() - start > timeout_s:
                    return False
                time.sleep(poll_s)  # polling the donor's heartbeat until its round ends
            return True

    def _replayed(self, donor: str, meta: dict, tensors: dict[str, torch.Tensor], upto: float = math.inf
                  ) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """The snapshot (meta, tensors) `donor` served, brought up to the donor's current round (at most to
        round `upto`) by the rounds it went through since (their committed averages, a fraction of a
        download: decentral.rounds), applied in place as the members applied them; each round's result is
        checked against the digest the donor listed with it, and the last against the one its heartbeat
        publishes (where it still does). Returns it as far as the donor's kept rounds reach (as it was when the
        donor kept none), its meta's `donor_step` the donor's step then; None when a round's result differed
        (`tensors` then hold neither state)."""
        digest, first, got_bytes = state_digest(tensors), int(meta["round"]), 0
        numel = tensors[self.weights_key].numel()
        while int(meta["round"]) < min(upto, heartbeat_round(self.transport.progress().get(donor), -1)):
            got = self._waiting_on(lambda: self.transport.fetch_rounds(donor, digest, numel))
            if not got or not got[0]:
                break
            rounds, step_now = got
            for missed in rounds:
                if int(missed.meta["round"]) > upto:
                    break
                if missed.average is not None:
                    self._apply_average(tensors, missed.average.decode())
                    digest = state_digest(tensors)
                    got_bytes += missed.average.nbytes
                if digest != missed.digest:
                    log.warning("round %d replayed from %s's averages differs from the state it published; "
                                "downloading the state instead", int(missed.meta["round"]) - 1, donor[-8:])
                    return None
                meta = {**missed.meta, "donor_step": step_now}
        if int(meta["round"]) > first:
            if heartbeat_digest(self.transport.progress().get(donor), int(meta["round"])) not in (None, digest):
                log.warning("the state of round %d replayed from %s's averages is not the one it publishes; "
                            "downloading the state instead", int(meta["round"]), donor[-8:])
                return None
            progress_log.info("caught up from round %d to %d with %s's averages (%.1f MiB; its state: %.1f MiB)",
                              first, int(meta["round"]), donor[-8:], got_bytes / 2**20,
                              sum(t.nbytes for t in tensors.values()) / 2**20)
        return meta, tensors

    def _join_next_step(self, donor: str, round: int) -> tuple[dict, dict[str, torch.Tensor], int] | None:
        """A newcomer whose donor is past `join_within_steps` of `round` (and that does not onlook): join the
        group at the donor's next step where the protocol can, returning (meta, tensors, step); None: it waits
        for the donor's next round."""
        return None

    def _can_onlook(self, round_start: int, donor_step: int) -> bool:
        """Whether a newcomer whose donor is at `donor_step` of the round that began at `round_start` (past
        `join_within_steps` of it) trains the rest of that round as an onlooker; if not, it waits for the
        round's end."""
        return False

    def _check_replicas(self, group: list[str], report: SyncReport,
                        base: tuple[dict, dict[str, torch.Tensor]] | None = None) -> None:
        """At a boundary, once our snapshot of `self.round` is offered: compare our digest of the round
        before with `group`'s, and when the group's majority held another state, repair ours (`base`: our
        snapshot of the round before, see `_repair`). Fills `report.spread` (0 when every digest we see
        agrees with ours) and `report.repaired`.

        When at least half of the members we averaged with in the round just ended said they averaged
        without us (their view of the swarm left us out: we joined as they fixed their members), or averaged
        over another member list (ours missed a member theirs holds: a newcomer's announcement reached them
        and not us), we take their state of this round at once, not a round later."""
        asked, left_out, majority = self._asked, self._left_out, self._majority_left_us_out()
        self._asked, self._left_out = set(), set()
        if majority:
            log.warning("round %d: %d of %d members averaged without us (or over another member list); taking "
                        "their state", self.round, len(left_out), len(asked))
            spread = self._repair(left_out, base)
            report.repaired, report.spread = bool(spread), spread  # 0.0: we held their state already
            return
        previous = self.round - 1
        ours = self._digests.get(previous)
        if ours is None:
            return
        others = [p for p in group if p != self.transport.peer_id]
        progress = self.transport.progress(max_age_s=float("inf"))  # digests published a round ago
        if any(heartbeat_digest(progress.get(p), previous) is None for p in others):
            progress = self.transport.progress()
        held = {p: heartbeat_digest(progress.get(p), previous) for p in others}
        held = {self.transport.peer_id: ours, **{p: d for p, d in held.items() if d is not None}}
        if len(held) < 2:
            return
        majority = majority_digest(held)
        if majority == ours:
            report.spread = 0.0
            return
        log.warning("round %d: our state differs from the one %d of %d members held; repairing it from theirs",
                    previous, sum(d == majority for d in held.values()), len(held))
        spread = self._repair({p for p, d in held.items() if d == majority}, base)
        report.repaired, report.spread = spread is not None, spread

    def _majority_left_us_out(self) -> bool:
        """Whether at least half of the members we averaged with in this round said they averaged without us,
        or over another member list."""
        return bool(self._left_out) and 2 * len(self._left_out) >= len(self._asked)

    def _repair(self, donors: set[str], base: tuple[dict, dict[str, torch.Tensor]] | None = None,
                poll_s: float = 0.25) -> float | None:
        """Take the state of round `self.round` that `donors` (the majority of the round before) publish
        the digest of, checked against that digest: where the protocol `replays_rounds` and `base`, our
        snapshot of the round before, is the state they held then (we were left out of their average), by
        replaying their last average on it (each member keeps its last round, a fraction of the state:
        decentral.rounds), else downloaded from one of them. When they are past that round, join
        them where they are (`_rejoin`), also when they went past it while the state was on its way (a large
        state over a slow link: as late again, we would miss their next round and repair again, round after
        round), by replaying the rounds since where the protocol `replays_rounds`. Returns the RMS distance of
        our `weights_key` tensor from theirs (0.0 without a download when we hold their state already), or None
        when no donor served it within `repair_timeout_s`, or once none of them has had a live heartbeat for
        `DONORS_GONE_S` (they left: a newcomer in a run's last round)."""
        deadline = time.monotonic() + self.repair_timeout_s
        why, listed_at = "none of them published a digest of it", time.monotonic()
        with self._waiting():
            while time.monotonic() < deadline:
                progress = self.transport.progress()
                if donors & set(progress):
                    listed_at = time.monotonic()
                elif time.monotonic() - listed_at >= DONORS_GONE_S:
                    log.warning("round %d: every peer that held the state to repair ours from has left (the "
                                "run ended?); going on from ours", self.round)
                    return None
                theirs = {p: heartbeat_digest(progress.get(p), self.round) for p in donors}
                theirs = {p: d for p, d in theirs.items() if d is not None}
                if theirs:
                    digest = majority_digest(theirs)
                    if digest == self._digests.get(self.round) and not self._past_our_round(donors, progress):
                        return 0.0  # we hold it (both sides of a split rolled back)
                    holders = {p for p, d in theirs.items() if d == digest}
                    got = self._replayed_their_round(holders, base, progress)
                    if got is None:
                        try:
                            got = self.transport.fetch_state(donors=holders)
                        except StateUnavailable:
                            got = None
                    served = -1 if got is None else int(got[1][0].get("round", -1))
                    if served > self.round:
                        break
                    why = ("no download succeeded" if got is None else f"a donor served round {served}"
                           if served != self.round else "its digest differed")
                    if served == self.round and state_digest(got[1][1]) == digest:
                        spread = self._repaired_with(*got[1])
                        if self.replays_rounds and self._past_our_round(donors):
                            self.donor = got[0]
                            self._rejoin(replay_ours=True)
                        return spread
                time.sleep(poll_s)  # polling the donors' heartbeats for their digest of this round
            else:
                log.warning("round %d: no member served the majority's state within %.0fs (last try: %s); trying "
                            "again next round", self.round, self.repair_timeout_s, why)
                return None
        return self._rejoin()  # they went past this round

    def _replayed_their_round(self, holders: set[str], base: tuple[dict, dict[str, torch.Tensor]] | None,
                              progress: dict[str, dict]) -> tuple[str, tuple[dict, dict[str, torch.Tensor]]] | None:
        """(holder, (meta, tensors)): the state `holders` publish for this round, as `base` (our snapshot of
        the round before, left unchanged) with their average of that round replayed on a copy (`_replayed`),
        from a holder whose heartbeat (in `progress`) says it held our state of that round too; None when
        none did, or kept no such round, or the result differs from the state it published."""
        if base is None or not self.replays_rounds or int(base[0]["round"]) != self.round - 1:
            return None
        ours = self._digests.get(self.round - 1)
        held = sorted(p for p in holders if heartbeat_digest(progress.get(p), self.round - 1) == ours)
        if not held:
            return None
        meta, tensors = base
        replayed = self._replayed(held[0], meta, {k: v.clone() for k, v in tensors.items()}, upto=self.round)
        return (held[0], replayed) if replayed is not None and int(replayed[0]["round"]) == self.round else None

    def _repaired_with(self, meta: dict, tensors: dict[str, torch.Tensor]) -> float:
        """Replace our state of this round by the members' (`_on_repaired`) and offer it; the RMS distance of
        our `weights_key` tensor from theirs."""
        before = self.snapshot()
        self.load_snapshot(meta, tensors)
        self._on_repaired(before)
        self._offer()
        mine, now = before[self.weights_key], self.snapshot()[self.weights_key]
        return float((mine - now).pow(2).mean().sqrt())

    def _past_our_round(self, peers: set[str], progress: dict[str, dict] | None = None) -> bool:
        """Whether a heartbeat of one of `peers` reports a round past ours (in `progress`, else looked up)."""
        progress = self.transport.progress() if progress is None else progress
        return any(heartbeat_round(progress.get(p), -1) > self.round for p in peers)

    def _rejoin(self, replay_ours: bool = False) -> float | None:
        """The members we must match went past our round (we fell a round behind: slow, or left out and
        late): join them as a newcomer does, at their state, round and inner step (what of ours their
        state does not hold is lost, as in a repair); `replay_ours`: our state is our donor's of our round,
        brought up to theirs by the rounds since (`_fetch_to_join`). Returns the RMS distance of our
        `weights_key` tensor from theirs, or None when nobody served their state."""
        before, behind = self.snapshot(), self.round
        if not self._take_swarm_state(replay_ours=replay_ours):
            return None
        log.warning("round %d: the members went on to round %d without us; joined them there at step %d",
                    behind, self.round, self.step)
        self._on_rejoined()
        self._offer()
        self._join_rounds(self.round, first=True)  # pushes for the rounds we skipped: "not in this round"
        mine, now = before[self.weights_key], self.snapshot()[self.weights_key]
        return float((mine - now).pow(2).mean().sqrt())


def check_snapshot_names(protocol: str, tensors: dict[str, torch.Tensor], names: list[str]) -> None:
    """ForeignState unless a donor's snapshot `tensors` holds each of `names`."""
    missing = [name for name in names if name not in tensors]
    if missing:
        raise ForeignState(f"the {protocol} state handed over has no {' or '.join(missing)} (it has "
                           f"{', '.join(sorted(tensors)) or 'nothing'}): a peer of another protocol or version")


def check_count(value: object, name: str, least: int = 1) -> None:
    """ValueError unless `value` is an integer (not a bool) >= `least`; `name` names the argument in the message."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def check_flag(value: object, name: str) -> None:
    """ValueError unless `value` is True or False (a string such as "no" would count as true)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def check_outer_sgd(lr: float, momentum: float) -> None:
    """ValueError unless the outer SGD step's `lr` is a finite number > 0 (0 never moves φ, and below 0 φ moves
    away from the workers' progress: ALGORITHMS.md §1) and its `momentum` μ is in [0, 1) (from 1 on, the
    momentum never forgets an outer gradient and the steps grow without bound)."""
    if not 0 < lr < math.inf:
        raise ValueError(f"outer_lr (the outer step's learning rate) must be a finite number > 0, got {lr}")
    if not 0 <= momentum < 1:
        raise ValueError(f"outer_momentum (μ, the outer step's momentum) must be in [0, 1), got {momentum}")


class OuterProtocol(SyncProtocol):
    """Shared by protocols that keep slow weights φ and sync every `every` inner steps.

    φ and the outer state live as flat fp32 vectors on the CPU, or with `outer_on_device` on the model's
    device (no host memory for them, and the outer step runs there; what is offered, digested and
    checkpointed is a CPU copy, so replicas on either compare and trade states). After each outer step the
    protocol offers a snapshot of them to newcomers, and newcomers start from a donor's snapshot. On the
    CPU the snapshot is those very tensors, not a copy: once offered, a tensor is replaced, never changed
    in place (a protocol calls `_own` before it changes one in place), so it stays what was offered for
    as long as a download of it, or a caller of `snapshot`, holds it.
    """

    shares_state = True
    weights_key = "slow"
    looks_up_members = False  # the outer step averages over `_members(round)`: looked up during the round's last
    # inner step (`_look_up_members_ahead`)

    def __init__(self, model, optimizer, transport: Transport, *, every: int, outer_on_device: bool = False):
        super().__init__(model, optimizer, transport)
        check_count(every, "every (H, inner steps per outer step)")
        self.every = every
        if outer_on_device:
            self.outer_device = self.params[0].device
        self.join_within_steps = every // 2
        self.numel = sum(p.numel() for p in self.params)  # of θ's flat vector
        self.slow = self._fast_vector()
        # what averages did not count of our inputs (a lossy codec's loss), added to the next input
        self.residual = torch.zeros_like(self.slow) if transport.error_feedback else None
        self._shared: dict[str, weakref.ref] = {}  # name -> the tensor `snapshot` handed out under it
        self._led_by: EncodedAverage | None = None  # the committed average the outer step just applied, if kept
        self._closed: SyncReport | None = None  # the report of the last round closed (`finish` reads it)

    def _pieces(self, part: slice) -> list[tuple[torch.Tensor, int, int]]:
        """(parameter, start, stop) of each parameter's flat values that fall in `part` of θ's flat vector
        (every trained parameter, in order), in order."""
        pieces, offset = [], 0
        span = range(self.numel)[part]
        for p in self.params:
            start, stop = max(span.start, offset), min(span.stop, offset + p.numel())
            if start < stop:
                pieces.append((p, start - offset, stop - offset))
            offset += p.numel()
        return pieces

    def _fast_vector(self, part: slice = slice(None)) -> torch.Tensor:
        """θ[part] (by default all of it), flat fp32 on `outer_device`, a copy."""
        values = [p.detach().view(-1)[start:stop] for p, start, stop in self._pieces(part)]
        return torch.cat(values).to(device=self.outer_device, dtype=torch.float32)

    def _finite_fast(self, part: slice = slice(None)) -> torch.Tensor:
        """`_fast_vector(part)`; DivergedError when training made it non-finite (before any of it is sent)."""
        fast = self._fast_vector(part)
        if not all_finite(fast):
            raise DivergedError(f"non-finite weights after inner step {self.step}; not syncing them")
        return fast

    def _outer_gradient(self, fast: torch.Tensor, part: slice = slice(None)) -> torch.Tensor:
        """The outer gradient of θ[part]: where the round started (`round_start_weights`) minus `fast`, our
        copy of θ[part] (`_finite_fast`), computed in that copy: no model-sized tensor of its own."""
        return torch.sub(self.round_start_weights()[part], fast, out=fast)

    def _load_fast(self, vector: torch.Tensor, part: slice = slice(None)) -> None:
        """θ[part] ← vector (by default all of θ), copied into the parameters (moved to their device once, cast to
        each one's dtype: a model may keep some layers in float32 beside bfloat16 ones)."""
        offset = 0
        vector = vector.to(self.params[0].device)
        with torch.no_grad():
            for p, start, stop in self._pieces(part):
                p.view(-1)[start:stop].copy_(vector[offset:offset + stop - start])
                offset += stop - start

    def outer_tensors(self) -> dict[str, torch.Tensor]:
        """Outer state besides φ (momentum and the like), flat fp32, each under the name of the attribute
        that holds it."""
        return {}

    def _drop_frozen_momentum(self, momentum: torch.Tensor, part: slice = slice(None)) -> None:
        """Zero, in place, the values of θ[part]'s outer `momentum` whose parameter was frozen since the protocol
        was made (requires_grad False now), before an outer step: a frozen parameter takes no momentum, as
        torch's optimizers skip one without a gradient, so the step moves it by the averaged progress it made
        before it froze and then never again (the momentum kept moving it, round after round). Replicas that
        freeze it at the same step stay identical."""
        frozen = self._frozen(part)
        if frozen is not None:
            momentum.masked_fill_(frozen.to(momentum.device), 0.0)

    def _frozen(self, part: slice = slice(None)) -> torch.Tensor | None:
        """A mask over θ[part]'s flat values, True where the parameter was frozen since the protocol was made
        (requires_grad False now); None when none is."""
        if all(p.requires_grad for p in self.params):
            return None
        return torch.cat([torch.full((stop - start,), not p.requires_grad) for p, start, stop in self._pieces(part)])

    def _own(self, *names: str) -> None:
        """Before φ (`slow`) or outer tensors, by attribute name, are changed in place: each that `snapshot`
        handed out (offered to newcomers, perhaps being downloaded) is replaced by a copy of its own first."""
        for name in names:
            shared = self._shared.pop(name, None)
            if shared is not None and shared() is getattr(self, name):
                setattr(self, name, getattr(self, name).clone())

    def round_start_weights(self) -> torch.Tensor:
        """Where θ starts a round after an outer step: φ."""
        return self.slow

    def memory_copies(self) -> list[str]:
        """φ and the outer state (on a device, a CPU copy of both is offered to newcomers besides), and the
        error feedback's residual. An outer step copies what it changes of the offered state (`_own`)."""
        names = ["slow", *self.outer_tensors()]
        if self.outer_device.type == "cpu":
            return names + (["residual"] if self.residual is not None else [])
        where = f" (on {self.outer_device})"
        return ([n + where for n in names] + [f"{n} (offered)" for n in names]
                + ([f"residual{where}"] if self.residual is not None else []))

    def _with_residual(self, outer_grad: torch.Tensor, part: slice = slice(None)) -> torch.Tensor:
        """What goes into an average of φ[part]'s outer gradient: it plus what earlier averages did not count
        of ours (SparseLoCo's error feedback, g' = g + e; ALGORITHMS.md §9). That residual is in the input
        now: 0."""
        if self.residual is None:
            return outer_grad
        sent = outer_grad + self.residual[part]
        self.residual[part] = 0
        return sent

    def _keep_residual(self, given: torch.Tensor, counted: torch.Tensor, part: slice = slice(None)) -> None:
        """e[part] += what an average did not count of the input we gave it: `given − counted` (after a commit,
        counted is AverageResult.sent). Without error feedback, nothing (not even the difference) is computed."""
        if self.residual is not None:
            self.residual[part] += given - counted

    def start(self) -> None:
        super().start()
        if self.donor is not None:  # a newcomer joining a round under way trains its rest from φ; a peer resumed
            self._load_fast(self.slow)  # (load_state_dict) that took no state keeps what its model trained since

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Slow weights and the protocol's outer tensors on the CPU: the very tensors there (never changed in
        place from now on: `_own`), copies of those on a device."""
        tensors = {"slow": self.slow, **self.outer_tensors()}
        if self.outer_device.type != "cpu":
            return {k: v.to("cpu") for k, v in tensors.items()}
        self._shared = {k: weakref.ref(v) for k, v in tensors.items()}
        return dict(tensors)

    def check_snapshot(self, tensors: dict[str, torch.Tensor]) -> None:
        """φ and each of our outer tensors, each as large as ours."""
        ours = {"slow": self.slow, **self.outer_tensors()}
        check_snapshot_names(self.name, tensors, list(ours))
        check_same_model(tensors["slow"], self.slow)
        for name, value in ours.items():
            if tensors[name].numel() != value.numel():
                raise ForeignState(f"the {self.name} state handed over has {tensors[name].numel():,} values of "
                                   f"{name}, ours {value.numel():,}: a peer of another protocol or version")

    def load_snapshot(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.check_snapshot(tensors)
        for name, value in {"slow": self.slow, **self.outer_tensors()}.items():  # replaced: ours may be offered
            setattr(self, name, tensors[name].to(self.outer_device, torch.float32, copy=True).reshape(value.shape))

    def _on_repaired(self, before: dict[str, torch.Tensor]) -> None:
        """θ keeps its own progress, now relative to the repaired φ (θ = φ exactly, when it had none)."""
        self._load_fast(self.slow + (self._fast_vector() - before["slow"].to(self.outer_device)))

    def _on_rejoined(self) -> None:
        """θ starts the round from the members' state, as every round starts."""
        self._load_fast(self.round_start_weights())

    def catch_up(self) -> None:
        """A peer resumed first (waiting for the others) beside one resumed later from a newer checkpoint,
        which waits for nobody: it trained on from its older round, behind the other's, and they never shared
        a round again. A peer past our round that is no member of our first one (it will never average with us)
        is joined as a newcomer joins (`_rejoin`); one that is (a round ahead while its average with us is in
        flight, as CO2's are) is not."""
        if not self.shares_state:
            return
        apart = set(self.transport.progress()) - set(self.transport.members(self.first_round)) - {self.transport.peer_id}
        if self._past_our_round(apart):
            self._rejoin()

    def after_step(self) -> SyncReport | None:
        left = self._round_start + self.every - self.step
        if left == 1 and self.looks_up_members and not self.onlooking:
            self._look_up_members_ahead()
        if left > 0:
            return None
        if self.onlooking:
            self._end_onlooking()
            return None
        report = self.outer_step(self._finite_fast())
        if not report.rolled_back:
            self._load_fast(self.round_start_weights())
        return self._close_round(report)

    def _can_onlook(self, round_start: int, donor_step: int) -> bool:
        """While steps of the round are left to train (a donor at its end is about to offer the next one)."""
        return donor_step < round_start + self.every

    def _end_onlooking(self) -> None:
        """At the end of the round we trained as an onlooker (`_fetch_to_join`): take the members' state of
        the next round, waiting for it as a newcomer at a boundary does, and start it as they do
        (`_on_rejoined`); announce the rounds after it. What the onlooked steps leave is a warmed-up inner
        optimizer; their progress is dropped, being measured from an older φ and mostly a fresh optimizer's
        first, largest steps (carried into the next round, it put the onlooker's validation loss 0.07-0.53
        above the members' at the boundary in a soak, BENCHMARKS.md)."""
        self.onlooking = False
        onlooked = self.round
        if self._take_swarm_state(after_round=self.round, replay_ours=True):
            self._on_rejoined()
        else:  # nobody serves a later state (the members are gone): we go on into the next round on our own
            log.warning("round %d: no member served the state of the round after it; going on from ours", onlooked)
            self.round, self._round_start = self.round + 1, self.step
        self._offer()
        self._join_rounds(self.round + 1)

    def _close_round(self, report: SyncReport) -> SyncReport:
        """At a round boundary, once φ holds the round: count it, offer the state the next round starts
        from, compare our state with the group's (replicas), announce the coming rounds; `report`, completed."""
        self.round += 1
        self._round_start = self.step
        base, led_by, self._led_by = self._offered, self._led_by, None
        self._offer(led_by)
        if self.identical_replicas:
            self._check_replicas(report.group, report, base)
        report.digest = self._digests[self.round]
        self._join_rounds(self.round + 1)
        self._closed = report
        return report

    def outer_step(self, fast: torch.Tensor) -> SyncReport:
        """Update self.slow (and outer state) from our fast weights and the peers'; one round."""
        raise NotImplementedError

    def finish(self) -> None:
        """When an average did not count our progress (`_holds_uncounted`: the run's last, or for CO2 the one
        before it), the model holds progress φ lacks, and each member's differs. If it rolled back for everyone
        (the members' lists differed, a member died in it), average it once more (`_average_again`), a round of
        its own over the members still there, which are ending too and do the same (a member stopping alone,
        `--stop-at`, averages it into a round of the others still training, waiting at most the swarm's
        timeout for their boundary). If the others averaged without us (we took their state at the boundary),
        or the second try rolls back as well, the progress is dropped (`_drop_uncounted`): every member ends
        on φ, the state replicas agree on, not on its own."""
        last = self._closed
        if not self.identical_replicas or last is None or not self._holds_uncounted(last):
            return
        again = None if last.repaired else self._average_again()
        if again is None or not_committed(again):
            log.warning("round %d: the run's averages did not count all our progress%s; ending on the slow weights "
                        "the members hold, without it", self.round, "" if again is None else ", nor did a second try")
            self._drop_uncounted()
        else:
            progress_log.info("round %d: an average of the run rolled back; averaged what it held again at the end, "
                              "over %d members", self.round, again.contributors)
        self._load_fast(self.round_start_weights())
        if again is not None:
            self._close_round(again)

    def _holds_uncounted(self, last: SyncReport) -> bool:
        """Whether, the run's last average (`last`) done, our model holds progress no average counted: here
        when `last` did not commit (a rolled-back round's progress goes out with the next round's)."""
        return not_committed(last)

    def _average_again(self) -> SyncReport:
        """At the run's end, average the progress the last average did not count (θ holds it) once more: an
        outer step (see `finish`)."""
        return self.outer_step(self._finite_fast())

    def _drop_uncounted(self) -> None:
        """Forget the progress no average counted, so that θ starts from φ (`round_start_weights`) without it;
        θ alone holds it here: nothing to forget."""

    def state_dict(self) -> dict:
        """φ and the outer state, and our own residual (never offered: it is ours, not the replicas')."""
        state = super().state_dict()
        residual = {} if self.residual is None else {"residual": self.residual}
        state["tensors"] = {k: v.cpu() for k, v in {"slow": self.slow, **self.outer_tensors(), **residual}.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        slow = state["tensors"].get("slow")
        if slow is not None and slow.numel() != self.numel:  # refused before any of it is taken
            raise ValueError(f"state is of a model with {slow.numel():,} trained parameters, this one has {self.numel:,}")
        super().load_state_dict(state)
        self.load_snapshot(state["meta"], state["tensors"])
        if self.residual is not None and "residual" in state["tensors"]:
            self.residual.copy_(state["tensors"]["residual"])


def _refuse_unentered(made: weakref.ref) -> Callable:
    """An optimizer step pre-hook: RuntimeError while the protocol `made` for the optimizer (until its `with`
    block is entered) was never entered and no other protocol runs on it, since the loop would train without
    ever syncing and say nothing. A protocol dropped unused guards nothing."""
    def hook(optimizer, *_) -> None:
        protocol = made()
        if protocol is not None and optimizer not in _HOOKED:
            raise RuntimeError(f"a {protocol.name} protocol was made for this optimizer, but its `with` block was "
                               "not entered: without it the optimizer trains alone and never syncs. Train inside "
                               "`with protocol:` (or drop the protocol if it is not meant to run)")
    return hook


def not_committed(outcome: SyncReport | AverageResult) -> bool:
    """Whether an average (or the report of the round that applied it) did not commit over a group of two or
    more: nobody used it, and each member still holds its own part (a group of one commits its own)."""
    return not outcome.complete and len(outcome.group) > 1


def heartbeat_round(info: object, default: int) -> int:
    """The round a peer's heartbeat (an entry of Transport.progress) reports; `default` without one."""
    round = info.get("round") if isinstance(info, dict) else None
    return round if isinstance(round, int) else default


def majority_digest(held: dict[str, str]) -> str:
    """The digest most peers of `held` ({peer: digest}) hold; among equally many, the one the lowest peer
    id holds, so every peer that sees the same digests picks the same."""
    counts = Counter(held.values())
    most = max(counts.values())
    return held[min(p for p, d in held.items() if counts[d] == most)]
