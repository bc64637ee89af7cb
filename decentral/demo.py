"""`decentral demo`: a local swarm of worker processes on loopback, training one recipe.

Worker 0 starts the swarm; the others join through its multiaddr. Each is a separate
`decentral train` process, exactly what a user runs on separate machines (with `local`, the
no-communication reference, the workers start together and each trains alone). With `--island-size N`
each worker is a fast island of N ranks (decentral.hierarchy), one member of the swarm. Afterwards the demo
plots every worker's curves into OUT/report.png and prints a summary.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import yaml

from decentral.cli import stop_processes
from decentral.config import Recipe
from decentral.members import joining, train_command, wait_for_addresses
from decentral.metrics import read_metrics, write_report
from decentral.models import build_model
from decentral.swarm.admission import SwarmKey


def _relay(proc: subprocess.Popen) -> threading.Thread:
    def pump():
        for line in proc.stdout:
            print(line, end="", flush=True)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def ddp_bytes_per_step(num_params: int, workers: int) -> float:
    """Bytes one worker sends per step in a bandwidth-optimal fp32 gradient all-reduce."""
    return 2 * (workers - 1) / workers * 4 * num_params


def run_demo(recipe: Recipe, *, workers: int, out: Path, protocol_arg: str, tensorboard: Path | None = None) -> int:
    """Run the workers, then plot and summarise them; with `tensorboard`, worker wI also writes its metrics
    as TensorBoard scalars into TENSORBOARD/wI. Returns the exit code."""
    if workers < 1:
        raise ValueError("--workers must be >= 1")
    num_params = build_model(recipe.model_source, recipe.model, recipe.train.context).num_parameters()  # a bad
    # model source fails here, before any worker starts
    out.mkdir(parents=True, exist_ok=True)
    earlier = sorted(out.glob("w*/metrics.jsonl"))  # a worker appends to its file (a restart's lives): not a new demo's
    for path in earlier:
        path.unlink()
    for checkpoint in [*out.glob("w*/**/checkpoint"), *out.glob("w*/**/.checkpoint.old")]:  # (an island's ranks'
        shutil.rmtree(checkpoint)  # too) a worker refuses to start over a checkpoint it does not resume
    if earlier:
        print(f"demo: {out}/ held an earlier demo's records; they are replaced", flush=True)
    recipe.swarm.run = f"demo-{uuid.uuid4().hex[:8]}"
    key_file = out / "swarm.key"  # the demo's swarm admits only its own workers
    key_file.unlink(missing_ok=True)
    SwarmKey.generate(key_file)
    recipe.swarm.key_file = str(key_file.resolve())
    recipe_file = out / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    maddr_file = out / "bootstrap.maddrs"
    maddr_file.unlink(missing_ok=True)
    island = recipe.island.size
    swarm = recipe.protocol != "local"  # local averages nothing: no swarm to start or join
    members = f"{workers} islands of {island} ranks" if island > 1 else f"{workers} workers"
    print(f"demo: {members}, protocol {recipe.protocol}, {recipe.train.steps} inner steps each, "
          f"outputs in {out}/", flush=True)

    def launch(index: int, join: list[str]) -> subprocess.Popen:
        cmd = train_command(recipe_file, out, index, workers)
        cmd += joining(index, min_peers=workers, addresses_file=maddr_file, join=join) if swarm else []
        cmd += ["--tensorboard", str(tensorboard / f"w{index}")] if tensorboard else []
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)

    start = time.monotonic()
    procs = [launch(0, [])]
    relays = [_relay(procs[0])]
    try:
        try:
            bootstrap = wait_for_addresses(maddr_file, procs, timeout=120) if swarm else []
        except RuntimeError as e:  # the first worker failed (it said why) or hangs: nobody to join
            stop_processes(procs)
            relays[0].join(timeout=5)
            print(f"demo: {e}; its output is above", file=sys.stderr, flush=True)
            return 1
        for i in range(1, workers):
            procs.append(launch(i, bootstrap))
            relays.append(_relay(procs[-1]))
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        stop_processes(procs)
        print("demo: interrupted; each worker that trained saved its checkpoint (its line above says)", flush=True)
        return 130
    for r in relays:
        r.join(timeout=5)
    elapsed = time.monotonic() - start
    records = read_metrics(sorted(out.glob("w*/metrics.jsonl")))
    failed = [i for i, c in enumerate(codes) if c != 0]
    if not records:  # (each failed before its first step: a --device it lacks, say; it said why above)
        print(f"demo: no worker wrote a record; workers {failed} exited with errors (their output is above)",
              file=sys.stderr)
        return 1
    summary = write_report(records, out / "report.png", title=f"{recipe.protocol}, {members}")
    outer = recipe.protocol_args.get("every", None)
    per_step = [s["bytes_sent"] / max(1, s["final_step"]) for s in summary.values()]
    mean_per_step = sum(per_step) / len(per_step)
    ddp = ddp_bytes_per_step(num_params, workers)
    if not swarm or workers == 1:
        traffic = "no communication" + (" (local)" if not swarm else ": one worker")
    else:
        traffic = (f"sent per worker per inner step {mean_per_step / 1024:.1f} KiB vs {ddp / 1024:.1f} KiB for a DDP "
                   f"all-reduce ({ddp / max(mean_per_step, 1):.0f}x less)" + (f", H={outer}" if outer else ""))
    print(f"demo: {elapsed:.0f}s wall; {num_params:,} parameters; {traffic}")
    print(f"demo: plot {out / 'report.png'}, metrics {out}/w*/metrics.jsonl, checkpoints {out}/w*/checkpoint"
          + (f"; tensorboard --logdir {tensorboard}" if tensorboard else ""))
    if failed:
        print(f"demo: workers {failed} exited with errors", file=sys.stderr)
        return 1
    return 0
