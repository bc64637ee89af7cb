"""The hivemind.Optimizer baseline: two real baseline processes on loopback learn and average parameters."""

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from conftest import TINY_MODEL, TINY_TRAIN, wait_for_file

STEPS = 60


def start_worker(root: Path, recipe: Path, data: Path, index: int, join: list[str]) -> subprocess.Popen:
    """Start baseline worker `index` of 2; it waits for both peers before training."""
    cmd = [sys.executable, "-m", "decentral.baselines.hivemind_optimizer", "--protocol", str(recipe),
           "--out", str(root / f"w{index}"), "--name", f"w{index}", "--worker-index", str(index),
           "--num-workers", "2", "--min-peers", "2", "--data", str(data), "--host", "127.0.0.1",
           "--maddr-file", str(root / f"w{index}.maddrs")]
    for maddr in join:
        cmd += ["--join", maddr]
    return subprocess.Popen(cmd, stdout=open(root / f"w{index}.log", "w"), stderr=subprocess.STDOUT)


def test_two_baseline_workers_learn_and_average(tmp_path, small_corpus):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "protocol": {"name": "diloco", "every": 10},
        "train": {**TINY_TRAIN, "steps": STEPS},
        "model": TINY_MODEL,
        "swarm": {"timeout": 10.0, "run": f"hm{time.monotonic_ns()}"},
    }))
    procs = [start_worker(tmp_path, recipe, small_corpus, 0, [])]
    try:
        first = wait_for_file(tmp_path / "w0.maddrs", procs[0], 60).split()
        procs.append(start_worker(tmp_path, recipe, small_corpus, 1, first))
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [(tmp_path / f"w{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], logs
    for i in range(2):
        path = tmp_path / f"w{i}" / "metrics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        vals = [r["val_loss"] for r in records if "val_loss" in r]
        assert vals[-1] < vals[0] - 0.5, (i, vals)
        assert 2 in [r.get("group_size") for r in records], logs[i]  # a round averaged with the other peer
        assert max(r["round"] for r in records) >= 2, logs[i]
        assert records[-1]["final"] and records[-1]["step"] == STEPS
        assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
        assert records[-1]["bytes_sent"] is None  # loopback traffic cannot be told apart
        assert (tmp_path / f"w{i}" / "checkpoint" / "meta.json").is_file()
