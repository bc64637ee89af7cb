"""Fast islands joined to a swarm, started as users start them: `decentral train --island-size 2` and real
torchrun (`python -m torch.distributed.run --nproc-per-node 2 -m decentral train ...`), 2 islands x 2
gloo ranks on CPU."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from conftest import free_port, running, wait_until
from decentral.config import RecipeError, parse_recipe
from decentral.ranks import LaunchError, rank_from_env, spawn_ranks

DILOCO = {"name": "diloco", "every": 10, "outer_lr": 1.0, "outer_momentum": 0.5}
RANKS = 2


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
            "--master-port", str(free_port()), "-m", "decentral"]


def syncs(records: list[dict]) -> list[dict]:
    return [r for r in records if "group_size" in r]


@pytest.mark.parametrize("mode", ["leader", "sharded"])
def test_two_islands_of_two_ranks_train_as_two_identical_members(workers, mode):
    w = workers(DILOCO, steps=40, num_workers=2)
    w.start(0, extra=["--island-size", str(RANKS), "--island-mode", mode])  # spawns its ranks
    w.start(1, extra=["--island-mode", mode], launcher=torchrun())  # torchrun sets WORLD_SIZE
    assert w.wait(timeout=300) == {0: 0, 1: 0}, w.log(0) + w.log(1)
    runs = {(i, r): w.metrics(i, r) for i in range(2) for r in range(RANKS)}
    finals = {key: records[-1] for key, records in runs.items()}
    assert all(f.get("final") and f["step"] == 40 for f in finals.values())
    first_val = runs[0, 0][0]["val_loss"]
    assert len({f["val_loss"] for f in finals.values()}) == 1  # every rank of both islands: one model
    assert finals[0, 0]["val_loss"] < first_val - 0.5
    for key, records in runs.items():  # 2 members, the islands; as in a flat swarm, islands starting together
        # may average their first round over different member lists (announcements cross) and be repaired
        # from the majority a round later; every later round is complete
        rounds = syncs(records)
        assert [r["round"] for r in rounds] == [1, 2, 3, 4], key
        assert all(r["group_size"] == 2 and r["complete"] for r in rounds[1:]), "\n".join(
            [f"{key}: (round, group size, complete) {[(r['round'], r['group_size'], r['complete']) for r in rounds]}",
             w.log(0), w.log(1)])
    for rnd in range(1, 4):  # the four ranks hold bit-identical outer state after every later round
        assert len({syncs(records)[rnd]["digest"] for records in runs.values()}) == 1, rnd
    for island in range(2):
        leader, other = finals[island, 0]["bytes_sent"], finals[island, 1]["bytes_sent"]
        assert leader > 0
        assert (other == 0) if mode == "leader" else (other > 0)  # sharded: every rank has its own connection


def test_a_single_process_joining_a_swarm_of_sharded_islands_stops_in_one_line(workers):
    """A flat peer's average is the whole vector, a sharded island's rank-0 connection averages a half: each
    refused the other's parts and both trained on apart, saying only "wrong size". The newcomer now stops (exit
    code 2) naming the island layout it should use; the island trains on. (Islands in leader mode average the
    whole vector, and mix with single processes: test_a_killed_rank_takes_its_island_out_and_the_restarted...)"""
    w = workers(DILOCO, steps=100_000, num_workers=2)
    island = w.start(0, min_peers=1, extra=["--island-size", str(RANKS), "--island-mode", "sharded"])
    try:
        wait_until(lambda: w.metrics(0), 240, "the island training")
        flat = w.start(1, min_peers=1)
        assert flat.wait(timeout=120) == 2, w.log(1)
        said = [line for line in w.log(1).splitlines() if line.startswith("decentral: ")]
        assert len(said) == 1 and "averages otherwise than this peer (island.shards 2 there, 1 here)" in said[0], \
            w.log(1)
        assert not [r for r in w.metrics(1) if "loss" in r]
        assert island.poll() is None, w.log(0)
    finally:
        w.kill_all()


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_an_island_whose_rank_a_signal_ended_exits_128_plus_the_signal_as_a_shell_says(tmp_path, monkeypatch):
    """A rank killed by signal N was returned as -N, and the launcher's exit status became 256 - N (247 for
    SIGKILL) where a shell, and the README's exit codes, say 128 + N (137)."""
    rank = tmp_path / "python"  # what the launcher runs as each rank: rank 0 ends well, rank 1 is killed
    rank.write_text('#!/bin/sh\n[ "$RANK" = 1 ] && kill -KILL $$\nexit 0\n')
    rank.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(rank))
    said: list[str] = []
    assert spawn_ranks(["train"], 2, print_fn=said.append) == 128 + signal.SIGKILL
    assert said[-1] == f"island: ranks [1] exited with codes [{-signal.SIGKILL}]"


def test_a_killed_rank_takes_its_island_out_and_the_restarted_island_rejoins(workers):
    w = workers(DILOCO, steps=100_000, num_workers=2, timeout=10.0)
    island = ["--island-size", str(RANKS)]
    spawner = w.start(0, extra=island)
    w.start(1, extra=island)
    wait_until(lambda: any(r.get("group_size") == 2 for r in w.metrics(0, 1)[1:]), 240, "island 0 rank 1 synced")
    ranks = children(spawner.pid)
    assert len(ranks) == RANKS
    killed_at = max(r["step"] for r in w.metrics(0, 1))
    waited_before = w.metrics(1)[-1]["wait_s"]
    os.kill(ranks[1], signal.SIGKILL)
    assert spawner.wait(timeout=60) == 4  # the surviving rank saw its island break and stopped with code 4
    assert "The island left the swarm" in w.log(0)

    # the other island goes on alone, without waiting out the timeout for the one that left
    wait_until(lambda: any(r.get("group_size") == 1 for r in w.metrics(1)), 120, "island 1 went on alone")
    alone = [r for r in w.metrics(1) if r.get("group_size") == 1]
    assert alone[-1]["wait_s"] - waited_before < 10.0, "island 1 waited a timeout for the island that left"

    # a single process averages its whole vector as an island in leader mode does: it joins island 1 and they
    # average together (sharded islands refuse it: test_a_single_process_joining_a_swarm_of_sharded_islands...)
    flat = w.start(2, min_peers=1, join=(w.root / "w1.maddrs").read_text().split(), extra=["--num-workers", "3"])
    wait_until(lambda: any(r.get("group_size") == 2 and r["complete"] for r in w.metrics(2)), 120,
               "the single process averaged with island 1")
    flat.terminate()  # it says it leaves: island 1 does not wait for it
    assert flat.wait(timeout=60) == 130, w.log(2)

    # restarted with --resume, the island joins at the swarm's step and trains with the other again
    before = len(w.metrics(0))
    w.start(0, extra=[*island, "--resume"], join=(w.root / "w1.maddrs").read_text().split(), min_peers=1)
    wait_until(lambda: any(r.get("group_size") == 2 for r in w.metrics(0)[before:]), 240,
               "the restarted island synced with the other")
    rejoined = w.metrics(0)[before:]
    assert rejoined[0]["step"] > killed_at  # it continued the swarm's step, not its own checkpoint's
    joint = next(r for r in syncs(rejoined) if r["group_size"] == 2)
    wait_until(lambda: any(r["round"] == joint["round"] for r in syncs(w.metrics(1))), 60, "island 1 ending that round")
    theirs = {r["round"]: r["digest"] for r in syncs(w.metrics(1))}
    assert theirs[joint["round"]] == joint["digest"]  # identical again

    ranks = [pid for i in (0, 1) for pid in children(w.procs[i].pid)]
    w.kill_all()  # SIGKILL the launchers: the kernel sends their ranks SIGTERM, and they stop too
    wait_until(lambda: not any(running(pid) for pid in ranks), 60, "the ranks of killed launchers stopped")


def test_rank_from_env_reads_torchrun_and_names_what_is_missing():
    assert rank_from_env({}) is None
    env = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "LOCAL_RANK": "1"}
    got = rank_from_env(env)
    assert (got.rank, got.world_size, got.local_rank, got.local_world_size) == (1, 4, 1, 4)
    assert rank_from_env({**env, "LOCAL_WORLD_SIZE": "2"}).local_world_size == 2  # torchrun over two machines
    with pytest.raises(LaunchError, match="MASTER_PORT"):
        rank_from_env({k: v for k, v in env.items() if k != "MASTER_PORT"})
    with pytest.raises(LaunchError, match="not in"):
        rank_from_env({**env, "RANK": "4"})


def test_island_recipe_section_is_checked():
    recipe = parse_recipe({"island": {"size": 2, "mode": "sharded"}})
    assert (recipe.island.size, recipe.island.mode, recipe.island.backend) == (2, "sharded", "auto")
    for bad, match in (({"mode": "ring"}, "island.mode"), ({"size": 0}, "island.size"),
                       ({"backend": "mpi"}, "island.backend"), ({"sise": 2}, "unknown key")):
        with pytest.raises(RecipeError, match=match):
            parse_recipe({"island": bad})


def test_an_island_needs_an_outer_protocol(tmp_path, capsys):
    from decentral.cli import main

    assert main(["train", "--protocol", "local", "--island-size", "2", "--out", str(tmp_path)]) == 2
    assert "give it an outer protocol" in capsys.readouterr().err
