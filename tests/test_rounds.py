"""What a peer keeps of the rounds it went through (decentral.rounds): the last one always, more only while a
newcomer may want them, only as a chain that leads from a state it offered, and never more bytes than the
state."""

import torch

from decentral.codec import Dense
from decentral.rounds import RoundLog
from decentral.transport import EncodedAverage

F16 = Dense("float16")
STATE_BYTES = 8 * 100  # φ and momentum of 100 values


def average(value: float) -> EncodedAverage:
    return EncodedAverage(F16, [(F16.encode(torch.full((100,), value)), 100)])  # 200 bytes


def offer(log: RoundLog, round: int, digest: str, led_by: EncodedAverage | None, busy: bool = False) -> None:
    log.offered({"round": round}, digest, led_by, STATE_BYTES, busy=busy)


def test_the_last_round_is_kept_always_and_more_once_a_newcomer_wants_the_state_they_follow():
    log = RoundLog()
    offer(log, 1, "d1", None)
    offer(log, 2, "d2", average(1.0))
    offer(log, 3, "d3", average(2.0))
    (last,) = log.since("d2")  # nobody asked: the last round alone, for a member left out of it
    assert last.meta["round"] == 3 and torch.equal(last.average.decode(), torch.full((100,), 2.0))
    assert log.since("d1") is None
    log.want("d3")
    offer(log, 4, "d4", average(3.0))
    offer(log, 5, "d4", None)  # a round that rolled back: the state did not change
    offer(log, 6, "d6", average(4.0))
    rounds = log.since("d3")
    assert [(r.meta["round"], r.digest) for r in rounds] == [(4, "d4"), (5, "d4"), (6, "d6")]
    assert torch.equal(rounds[0].average.decode(), torch.full((100,), 3.0)) and rounds[1].average is None
    assert [r.digest for r in log.since("d4")] == ["d6"]  # from the latest state with that digest
    assert log.since("d6") == [] and log.since("d0") is None


def test_a_state_reached_otherwise_than_by_an_average_starts_the_chain_afresh():
    log = RoundLog()
    offer(log, 1, "d1", None)
    log.want("d1")
    offer(log, 2, "d2", average(1.0))
    offer(log, 3, "repaired", None)  # a repair or a rejoin: no average leads there
    assert log.since("d1") is None and log.since("d2") is None
    offer(log, 4, "d4", average(2.0))
    assert [r.digest for r in log.since("repaired")] == ["d4"]


def test_a_log_never_holds_more_bytes_of_averages_than_the_state():
    log = RoundLog()
    offer(log, 0, "d0", None)
    log.want("d0")
    for r in range(1, 7):  # 200 bytes each, the state 800
        offer(log, r, f"d{r}", average(float(r)))
    assert log.since("d1") is None  # a replay from there would cost more than a download
    assert [r.meta["round"] for r in log.since("d2")] == [3, 4, 5, 6]


def test_rounds_are_dropped_once_nobody_asked_for_keep_s_unless_a_transfer_is_under_way():
    log = RoundLog(keep_s=0.0)
    offer(log, 1, "d1", None)
    log.want("d1")
    offer(log, 2, "d2", average(1.0), busy=True)  # the newcomer's download is still on its way
    assert [r.digest for r in log.since("d1")] == ["d2"]
    offer(log, 3, "d3", average(2.0))
    assert log.since("d1") is None and [r.digest for r in log.since("d2")] == ["d3"]  # the last round only


def test_a_log_says_whether_it_wants_the_next_average_only_while_a_newcomer_may_replay_it():
    log = RoundLog(keep_s=60.0)
    offer(log, 1, "d1", None)
    assert not log.wanted()  # nobody asked: the next offer keeps only the round that led to it
    log.want("d1")
    assert log.wanted()
    expired = RoundLog(keep_s=0.0)
    offer(expired, 1, "d1", None)
    expired.want("d1")
    assert not expired.wanted() and expired.wanted(busy=True)
