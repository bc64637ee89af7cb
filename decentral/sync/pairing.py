"""Random groups for one outer round, derived by every peer alone from a shared seed.

Every peer that sees the same member list for round r computes the same partition, so no
matchmaking messages are needed (hivemind's arrival-order matchmaking is not random: DESIGN.md).
"""

from __future__ import annotations

import hashlib
import random
from typing import Sequence


def round_groups(members: Sequence[str], seed: int, round: int, group_size: int = 2) -> list[list[str]]:
    """Partition `members` into random groups of `group_size` for outer round `round`.

    The permutation depends only on (seed, round, sorted members). When the count does not divide,
    the last group is smaller (a lone peer skips the round).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    ordered = sorted(set(members))
    digest = hashlib.sha256(f"{seed}:{round}".encode()).digest()
    random.Random(int.from_bytes(digest[:8], "big")).shuffle(ordered)
    return [sorted(ordered[i : i + group_size]) for i in range(0, len(ordered), group_size)]


def group_of(peer: str, groups: Sequence[Sequence[str]]) -> list[str]:
    """The group that holds `peer` ([peer] alone if it is in none)."""
    for group in groups:
        if peer in group:
            return list(group)
    return [peer]
