"""Random pairing from a shared seed: covers all pairs, partitions every round, agrees across peers."""

import itertools

import pytest

from decentral.sync.pairing import group_of, round_groups

PEERS = [f"peer{i}" for i in range(6)]


def test_every_round_is_a_partition_and_all_pairs_meet():
    met = set()
    for r in range(60):
        groups = round_groups(PEERS, seed=7, round=r)
        flat = [p for g in groups for p in g]
        assert sorted(flat) == sorted(PEERS)  # nobody missing, nobody in two groups
        assert all(len(g) == 2 for g in groups)
        met.update(tuple(g) for g in groups)
    assert met == set(itertools.combinations(sorted(PEERS), 2))


def test_peers_agree_whatever_order_they_list_members_in():
    for r in range(10):
        assert round_groups(PEERS, 3, r) == round_groups(list(reversed(PEERS)), 3, r)


def test_pairs_change_between_rounds_and_seeds():
    assert len({str(round_groups(PEERS, 0, r)) for r in range(10)}) > 5
    assert round_groups(PEERS, 0, 1) != round_groups(PEERS, 1, 1) or round_groups(PEERS, 0, 2) != round_groups(PEERS, 1, 2)


def test_odd_count_leaves_exactly_one_alone():
    groups = round_groups(PEERS[:5], 0, 4)
    assert sorted(len(g) for g in groups) == [1, 2, 2]
    lone = next(g for g in groups if len(g) == 1)[0]
    assert group_of(lone, groups) == [lone]
    assert group_of("stranger", groups) == ["stranger"]


def test_group_size_must_be_positive():
    with pytest.raises(ValueError):
        round_groups(PEERS, 0, 0, group_size=0)
