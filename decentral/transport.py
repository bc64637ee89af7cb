"""What a sync protocol (and the worker) needs from the network, and nothing more.

Protocols never import hivemind or torch.distributed: they get a `Transport`. `SwarmTransport`
(decentral.swarm) implements it over hivemind, `IslandTransport` (decentral.island) over
torch.distributed, `LoopbackTransport` (decentral.loopback) between peers of one process, and
`SoloTransport` (here) for a peer alone.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Iterable, Protocol, TypeVar

import torch

from decentral.codec import Codec

T = TypeVar("T")


def state_digest(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of names, dtypes, shapes and values: equal exactly when two states are bit-identical."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes, not a copy of them
    return digest.hexdigest()


FINITE_CHECK_NUMEL = 1 << 22  # values `all_finite` checks at once


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite. In slices, so that the check's temporaries (isfinite of a float
    tensor builds its absolute value) take 4M values' memory, not a model's."""
    return all(bool(torch.isfinite(piece).all()) for piece in t.reshape(-1).split(FINITE_CHECK_NUMEL))


KEPT_DIGESTS = 3  # rounds whose state digest a peer's progress carries
ROUNDS_AHEAD = 2  # averages up to this many rounds past the latest one a member began may wait for it (a
# later round went on without it: it was frozen, or fell behind, and takes no part in it, `Transport.average`),
# unless its protocol says fewer (`join_rounds`' `ahead`): CO2's member launches round r + 1 before it waits for
# round r, which needs the part of one that began r - 1; in DiLoCo and Streaming DiLoCo a member in step began
# round r before any member begins r + 1, so they say 1 (SyncProtocol.rounds_ahead)


def check_group(group: list[str] | None, round: int | None) -> None:
    """ValueError when an average is to run over a round's members (`group` None) without naming the round."""
    if group is None and round is None:
        raise ValueError("an average over a round's members (group None) needs that round")


def with_us(members: list[str], peer_id: str) -> list[str]:
    """`members` of a round, sorted, with us among them (our own announcement may not have propagated yet)."""
    return sorted({*members, peer_id})


def with_digest(digests: dict[str, str], round: int, digest: str) -> dict[str, str]:
    """A peer's published digests ({str(round): digest}) with `digest` for `round`, beside those of the
    previous `KEPT_DIGESTS - 1` rounds."""
    return {**{r: d for r, d in digests.items() if int(r) > round - KEPT_DIGESTS}, str(round): digest}


def heartbeat_digest(info: object, round: int) -> str | None:
    """The state digest a peer's heartbeat (an entry of Transport.progress) publishes for `round`, if any."""
    digests = info.get("digests") if isinstance(info, dict) else None
    digest = digests.get(str(round)) if isinstance(digests, dict) else None
    return digest if isinstance(digest, str) else None


def trained_past(meta: dict, step_now: int) -> bool:
    """Whether a donor now at inner step `step_now` has trained since the snapshot whose meta is `meta` (its
    step: where the snapshot's round began): then it no longer holds exactly that state."""
    return step_now > int(meta.get("step", 0))


class StateUnavailable(RuntimeError):
    """Peers offered the swarm's state, and none of them handed it over (each left, refused or closed the
    stream): unlike a swarm that offers none, there is state we should have and do not."""


class ForeignState(StateUnavailable):
    """The state the swarm handed over is of another model than ours: the members' recipes differ."""


def check_same_model(theirs: torch.Tensor, ours: torch.Tensor) -> None:
    """ForeignState unless the swarm's flat weights `theirs` have as many elements as `ours`."""
    if theirs.numel() != ours.numel():
        raise ForeignState(f"the swarm's model has {theirs.numel():,} parameters, ours has {ours.numel():,}: the "
                           "recipes differ (every member must train the same model; compare the recipes' model "
                           "sections and --model/--set)")


@dataclass
class EncodedAverage:
    """A committed average as it travelled: each chunk's encoding in `codec` and its element count, in order.
    `decode()` gives back, bit for bit, the average the members applied."""

    codec: Codec
    chunks: list[tuple[bytes, int]]

    @property
    def nbytes(self) -> int:
        return sum(len(data) for data, _ in self.chunks)

    def decode(self) -> torch.Tensor:
        return torch.cat([self.codec.decode(data, numel) for data, numel in self.chunks])

    def __getstate__(self) -> dict:
        """Pickled with its chunks as bytes of their own (a received average's may be views of the frame that
        brought them), e.g. to reach an island's other ranks."""
        return {"codec": self.codec, "chunks": [(bytes(data), numel) for data, numel in self.chunks]}


@dataclass
class MissedRound:
    """A round a donor's state went through after the state a newcomer holds (Transport.fetch_rounds): the
    meta and `state_digest` of the state it led to, and the committed average that led there (None: the
    round left the state as it was, e.g. it rolled back)."""

    meta: dict
    digest: str
    average: EncodedAverage | None


@dataclass
class AverageResult:
    """Outcome of one group average: committed (`complete`: every member that answered holds exactly
    this `tensor`, averaged over the whole group) or rolled back (`tensor` is our own input, unchanged)."""

    tensor: torch.Tensor
    sent: torch.Tensor  # our input as the average counted it: rounded to the wire precision (the input
    # itself when nothing was rounded, or when the average did not commit). `tensor - sent` is exactly 0
    # where every member's input equals ours, whatever the rounding.
    group: list[str]
    complete: bool
    contributors: int  # peers that every part of `tensor` was averaged over (1 = only ourselves)
    rejected: dict[str, str] = field(default_factory=dict)  # peer -> why its data was dropped
    absent: list[str] = field(default_factory=list)  # members that sent nothing (of a phase, in time):
    # gone, silent, or left us out
    disagree: list[str] = field(default_factory=list)  # members that ended with another result than ours
    left_out: list[str] = field(default_factory=list)  # absent members that said they average without us
    elsewhere: list[str] = field(default_factory=list)  # members whose parts came averaged over another member list
    # (their view of the swarm differs from ours): neither counted the other's part
    notes: dict[str, dict] = field(default_factory=dict)  # member -> the note it sent with its input
    # (`average(note=...)`), for every member a committed average counted, ours included, where the transport
    # carries notes (an island's collectives carry none)
    encoded: EncodedAverage | None = None  # a committed `tensor` as it travelled, where the transport has it (the
    # members' bytes it was decoded from: a fraction of `tensor` in a lossy codec), for `offer_state(led_by=)`
    held_by: tuple[str, float] | None = None  # of a committed average, where the transport times it: the member
    # (ourselves included) that held it up longest, and by how many seconds (decentral.swarm.averaging.held_up)


def longest_hold(holds: Iterable[tuple[str, float] | None]) -> tuple[str, float] | None:
    """Of several averages' `held_by`, the one that held its average up longest (None when none says)."""
    return max((held for held in holds if held), key=lambda held: held[1], default=None)


@dataclass
class JoinRequest:
    """A newcomer that asks to average with us from our next step on (`Transport.join_requests`). The
    protocol answers with the state the newcomer goes on from, `(meta, tensors)`, or None to refuse."""

    peer: str
    answer: Future  # cancelled when the newcomer stopped waiting

    @property
    def waiting(self) -> bool:
        return not self.answer.done()

    def grant(self, state: tuple[dict, dict[str, torch.Tensor]] | None) -> None:
        """Hand `state` over (None: refuse), unless the newcomer stopped waiting."""
        try:
            self.answer.set_result(state)
        except InvalidStateError:
            pass


def present_for(transport: "Transport", round: int) -> set[str]:
    """The peers there for `round`: those taking part in it, and live ones already past it (the round's
    announcements of a swarm under way have expired; a peer that resumed or joined late waits for no one)."""
    ahead = {peer for peer, info in transport.progress().items()
             if isinstance(info.get("round"), int) and info["round"] > round}
    return set(transport.members(round)) | ahead


class Transport(Protocol):
    peer_id: str
    error_feedback: bool  # averages travel in a codec that drops most of a tensor (top-k): a protocol keeps
    # what the average did not count of its input (input − AverageResult.sent) and adds it to its next input

    @property
    def bytes_sent(self) -> int: ...

    @property
    def bytes_received(self) -> int: ...

    def join_rounds(self, round: int, *, first: bool = False, ahead: int = ROUNDS_AHEAD) -> None:
        """Announce that we take part in outer rounds from `round` on (a few rounds ahead). `first`: we
        take part in none before it, even where we announced them (a newcomer that missed the round it
        meant to join). `ahead`: we take no part in a round more than this many past the latest we began an
        average of (`ROUNDS_AHEAD`)."""

    def members(self, round: int) -> list[str]:
        """Sorted ids of the peers taking part in `round`; every peer derives the same list."""

    def members_async(self, round: int) -> Future[list[str]]:
        """`members` looked up in the background where the lookup waits on the network (a DHT read), so a
        protocol can start it before it needs the list; done at once where the lookup is not."""

    def set_progress(self, step: int, round: int, digest: str | None = None) -> None:
        """Report our progress to the others (heartbeat); `digest`: the `state_digest` of the state we
        hold after `round` rounds, which the others see soon (a transport keeps the last few rounds')."""

    def progress(self, max_age_s: float = 0.0) -> dict[str, dict]:
        """{peer: {"step", "round", "digests": {str(round): digest}}} of the live peers, as they last
        reported it ({} where unknown). `max_age_s`: a view that old will do, where the transport keeps
        one (then nothing waits on the network)."""

    def set_card(self, now: bool = True, **fields) -> None:
        """Small JSON fields our heartbeat carries from now on beside the progress (replacing those of the
        same name), which the others see in `progress()`; `now`: published at once, else with the next
        regular heartbeat (nothing waits on the network). A transport without heartbeats ignores them."""

    def average(self, tensor: torch.Tensor, group: list[str], tag: str, round: int | None = None,
                note: dict | None = None) -> AverageResult:
        """Mean of a flat tensor over `group`, every member counting once, within the transport's timeout.
        Weights are the protocol's to fix, never a member's to claim: in every round each member has done
        the same number of inner steps. `round`: the outer round the average belongs to (a member that
        does not take part in it, or that began no average of the rounds its protocol may lead by before it
        (`join_rounds`' `ahead`), is left out at once rather than waited for). `note`: a small JSON object
        that travels with our input; a committed average hands every member the notes of all the members
        it counted (`AverageResult.notes`), so what they say is known to each member that committed."""

    def average_async(self, tensor: torch.Tensor, group: list[str] | None, tag: str, round: int | None = None,
                      note: dict | None = None) -> Future[AverageResult]:
        """`average` started in the background: returns at once, and training may go on while it runs
        (the result is the future's). `tensor` must not change until the future is done. `group` None:
        `round`'s members (`with_us`), looked up in the background too, as the average starts (`check_group`)."""

    def wait_for_peers(self, count: int, timeout_s: float, round: int = 0) -> None:
        """Block until `count` peers (us included) are there for `round` (`present_for`: so peers started
        together train their first round together, and one joining a swarm under way waits for nobody); an
        error naming the shortfall after `timeout_s`. A transport whose peers meet otherwise (an island's
        rendezvous), or that has none, returns at once."""

    def multiaddrs(self) -> list[str]:
        """Where other peers join us ([] where nobody can)."""

    def offer_state(self, meta: dict, tensors: dict[str, torch.Tensor], digest: str | None = None,
                    led_by: EncodedAverage | None = None) -> None:
        """Serve this snapshot of outer state to newcomers until the next offer (`digest`: its
        `state_digest`, when the caller has it already). `led_by`: the committed average that turned the
        previous offer into this one (the same for every member), which a transport may keep for newcomers
        whose state is older (`fetch_rounds`)."""

    def fetch_rounds(self, donor: str, digest: str, numel: int) -> tuple[list[MissedRound], int] | None:
        """The rounds `donor` went through since it held the state whose digest is `digest`, each an average
        of `numel` values (or no change), and the donor's inner step now; None when it kept no such rounds,
        is gone, or the transport cannot do this."""

    def fetch_state(
        self, have: dict[str, torch.Tensor] | None = None, donors: set[str] | None = None, meta_if_past: bool = False
    ) -> tuple[str, tuple[dict, dict[str, torch.Tensor]]] | None:
        """(donor, (meta, tensors)) from a live peer (one of `donors` when given), or None when nobody
        serves one. `meta` is what the donor offered, plus `donor_step` (its inner step when it served
        the snapshot) where the transport knows it. `have` is the state we would offer ourselves: a
        transport may return None when the donor holds exactly that and has not trained since. With
        `meta_if_past`, a donor that has trained past its snapshot's step sends only the meta (tensors {}):
        a caller that then joins at the donor's next step (`request_join`) needs no snapshot. Raises
        StateUnavailable when peers offered state and every download of it failed."""

    def request_join(self, donor: str) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """Ask `donor` to take us into its averages from its next step on, and wait for the state it grants
        (its own when it gets there, see `join_requests`); None when it refused, did not answer within the
        transport's timeout, or the transport cannot do this."""

    def join_requests(self) -> list[JoinRequest]:
        """The `request_join`s that newcomers sent us since the last call (each answered at most once)."""

    def close(self) -> None: ...


class SoloTransport:
    """A transport with nobody else on it: no network, no background threads.

    Used for training with no communication at all (the compute reference of benchmarks,
    independent experts): every average is over ourselves alone.
    """

    peer_id = "solo"
    error_feedback = False
    bytes_sent = 0
    bytes_received = 0

    def join_rounds(self, round: int, *, first: bool = False, ahead: int = ROUNDS_AHEAD) -> None:
        pass

    def members(self, round: int) -> list[str]:
        return [self.peer_id]

    def members_async(self, round: int) -> Future[list[str]]:
        return finished(self.members(round))

    def set_progress(self, step: int, round: int, digest: str | None = None) -> None:
        pass

    def progress(self, max_age_s: float = 0.0) -> dict[str, dict]:
        return {self.peer_id: {}}

    def set_card(self, now: bool = True, **fields) -> None:
        pass

    def average(self, tensor: torch.Tensor, group: list[str], tag: str, round: int | None = None,
                note: dict | None = None) -> AverageResult:
        flat = tensor.detach().float().reshape(-1).clone()
        return AverageResult(tensor=flat, sent=flat.clone(), group=[self.peer_id], complete=True, contributors=1,
                             notes=own_note(self.peer_id, note))

    def average_async(self, tensor: torch.Tensor, group: list[str] | None, tag: str, round: int | None = None,
                      note: dict | None = None) -> Future[AverageResult]:
        return finished(self.average(tensor, [self.peer_id], tag, round, note))

    def wait_for_peers(self, count: int, timeout_s: float, round: int = 0) -> None:
        """Nobody to wait for: training alone (the compute reference of a benchmark) starts at once."""

    def offer_state(self, meta: dict, tensors: dict[str, torch.Tensor], digest: str | None = None,
                    led_by: EncodedAverage | None = None) -> None:
        pass

    def fetch_rounds(self, donor: str, digest: str, numel: int) -> None:
        return None

    def fetch_state(self, have: dict[str, torch.Tensor] | None = None, donors: set[str] | None = None,
                    meta_if_past: bool = False) -> None:
        return None

    def request_join(self, donor: str) -> None:
        return None

    def join_requests(self) -> list[JoinRequest]:
        return []

    def multiaddrs(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


def own_note(peer_id: str, note: dict | None) -> dict[str, dict]:
    """`AverageResult.notes` of an average that counted only us."""
    return {peer_id: note} if note else {}


def finished(result: T) -> Future[T]:
    """A future already done with `result` (a transport whose average or lookup is over when it returns)."""
    future: Future[T] = Future()
    future.set_result(result)
    return future
