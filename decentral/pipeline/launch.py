"""A whole pipeline on this machine: one `decentral pipeline node` process per node of the network, on
loopback or each in its own netlab host (a network namespace behind a tc-capped uplink).

The allocation (which node serves which stage) is planned once, from the network, and written into
OUT/network.json with every node pinned to its stage; the nodes read that file. The first node
starts the swarm's DHT, the others join it; the first head leads (runs the coordinator) and, when
it dies, another head takes over (decentral.pipeline.serve).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from decentral.checkpoint import sole_writer
from decentral.cli import stop_processes
from decentral.config import recipe_differences
from decentral.pipeline.network import Network, PipelineError, load_network
from decentral.pipeline.planner import plan
from decentral.pipeline.recipe import loopback_network, network_shape, shaped_network
from decentral.progress import progress_bar

TICK_S = 1.0  # how often `pipeline train`'s progress (a bar, or lines in a log) reads the lead's metrics
START_S = 120.0  # how long the first node may take to start the swarm
STOP_S = 10.0  # how long `LocalPipeline.close` lets a node shut down before killing it
COULD_NOT_RUN = 2  # a node's exit code when it could not run as asked (a corrupt checkpoint, a bad recipe): for good
LAUNCHER = (sys.executable, "-m", "decentral")  # what runs `decentral` for a node


def pinned(network: Network, seed: int = 0, effort: float = 0.3) -> Network:
    """`network` with every node pinned to a stage: its own pin where it has one, else the planner's."""
    if all(node.stage is not None for node in network.nodes):
        return network
    stage_of = plan(network, seed=seed, effort=effort).stage_of
    return replace(network, nodes=tuple(replace(node, stage=int(s)) for node, s in zip(network.nodes, stage_of)))


class LocalPipeline:
    """Start, watch and end the node processes of one run (module docstring).

    `recipe`: the recipe file every node reads; `network`: pinned (see `pinned`); `lab`: a NetLab with
    at least one host per node, else loopback. `node_args`: more arguments for every node (--data ...).
    """

    def __init__(self, recipe: Path, network: Network, out: Path, *, steps: int | None = None, lab=None,
                 node_args: list[str] | None = None, env: dict[str, str] | None = None):
        if lab is not None and len(lab.hosts) < len(network.nodes):
            raise PipelineError(f"the lab has {len(lab.hosts)} hosts for {len(network.nodes)} nodes")
        self.recipe, self.network, self.out, self.steps, self.lab = Path(recipe), network, Path(out), steps, lab
        self.node_args, self.env = list(node_args or []), env
        self.procs: dict[str, subprocess.Popen] = {}
        self.heads = [node.name for node in network.nodes if node.stage == 0]
        if not self.heads:
            raise PipelineError("the network pins no node to stage 0")
        self.lead = self.heads[0]  # the first; after its death, the head that took over

    def log(self, name: str) -> str:
        path = self.out / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def last_line(self, name: str) -> str:
        """The last line node `name` wrote to its log (what it said as it ended)."""
        lines = [line for line in self.log(name).splitlines() if line.strip()]
        return lines[-1].strip() if lines else "(nothing)"

    def _could_not_run(self, name: str) -> PipelineError:
        return PipelineError(f"node {name} could not run as asked and exited: {self.last_line(name)} (its log: "
                             f"{self.out / (name + '.log')})")

    def start(self, timeout_s: float = START_S) -> None:
        """Start every node; the first one's DHT address must appear within `timeout_s`."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.network.save(self.out / "network.json")
        self.join: list[str] = []
        for node in self.network.nodes:
            self.procs[node.name] = self._spawn(node.name, self.join)
            if not self.join:
                self.join = self._bootstrap(node.name, timeout_s)

    def restart(self, name: str) -> subprocess.Popen:
        """Node `name` again (after `kill`): a new process that joins through the first node's DHT address,
        as a node on another machine would."""
        self.procs[name] = self._spawn(name, self.join)
        return self.procs[name]

    def _spawn(self, name: str, join: list[str]) -> subprocess.Popen:
        index = next(i for i, node in enumerate(self.network.nodes) if node.name == name)
        host = self.lab.hosts[index] if self.lab is not None else None
        cmd = [*LAUNCHER, "pipeline", "node", "--recipe", str(self.recipe),
               "--network", str(self.out / "network.json"), "--name", name, "--out", str(self.out / name),
               "--host", host.address if host else "127.0.0.1", *self.node_args]
        if join:
            cmd += [arg for maddr in join for arg in ("--join", maddr)]
        else:
            (self.out / f"{name}.maddrs").unlink(missing_ok=True)  # an earlier run's (a resumed run's folder)
            cmd += ["--maddr-file", str(self.out / f"{name}.maddrs")]
        if name == self.lead:
            cmd += ["--lead"]
        if name in self.heads and self.steps:  # any head may take over
            cmd += ["--steps", str(self.steps)]
        return self._start(cmd, self.out / f"{name}.log", host)

    def _start(self, cmd: list[str], log: Path, host) -> subprocess.Popen:
        """Run `cmd` on the lab's `host` (None: here), its output appended to `log`; its environment: ours,
        `env`, and the host's DECENTRAL_* variables. In a session of its own: a terminal's Ctrl-C reaches
        us alone, and `close` stops each node once."""
        with open(log, "a") as out:
            if host is not None:
                return host.popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            return subprocess.Popen(cmd, env={**os.environ, **(self.env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def _bootstrap(self, name: str, timeout_s: float) -> list[str]:
        path, proc = self.out / f"{name}.maddrs", self.procs[name]
        deadline = time.monotonic() + timeout_s
        while not path.exists() or not path.read_text().strip():
            if proc.poll() is not None:
                raise PipelineError(f"node {name} exited with {proc.returncode} before starting the swarm:\n"
                                    f"{self.log(name)[-2000:]}")
            if time.monotonic() > deadline:
                raise PipelineError(f"node {name} did not start the swarm within {timeout_s:.0f}s")
            time.sleep(0.1)  # polling a file the node writes
        return path.read_text().split()

    def kill(self, name: str) -> None:
        """SIGKILL node `name` (its DHT child notices and follows within a second)."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def wait(self, timeout_s: float, tick: Callable[[], None] | None = None) -> int:
        """Wait for the lead to end the run, then for the others to leave; returns the lead's exit code.
        When the lead dies and heads are left, the one with the lowest name takes over (as the nodes
        choose it) and ends the run. A node that exits with COULD_NOT_RUN ends the wait at once (PipelineError
        with its last line): no other node would go on in its place. `tick` is called about every TICK_S
        seconds meanwhile (it shows the progress)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                code = self.procs[self.lead].wait(timeout=max(0.0, min(left, TICK_S)))
                if code == COULD_NOT_RUN:
                    raise self._could_not_run(self.lead)
                left_heads = sorted(name for name in self.heads if self.procs[name].poll() is None)
                if code == 0 or not left_heads:
                    break
                self.lead = left_heads[0]
            except subprocess.TimeoutExpired:
                stopped = [name for name, proc in self.procs.items() if proc.poll() == COULD_NOT_RUN]
                if stopped:
                    raise self._could_not_run(stopped[0]) from None
                if time.monotonic() >= deadline:
                    raise PipelineError("the run did not end in the time given (--timeout); "
                                        f"{resume_hint(self.out, self.recipe)} "
                                        f"(the nodes' logs: {self.out}/*.log)") from None
                if tick:
                    tick()
        deadline = time.monotonic() + 30.0
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return code

    def iterations_done(self) -> int:
        """The last iteration the leads recorded in their metrics (0 before the first)."""
        records = run_metrics(self.out)
        return records[-1]["step"] if records else 0

    def close(self) -> None:
        """End every node process still running: SIGINT (it closes its DHT and server as on Ctrl-C), after
        STOP_S SIGKILL."""
        stop_processes(self.procs.values(), signal.SIGINT, STOP_S)

    def __enter__(self) -> "LocalPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_metrics(out: str | Path) -> list[dict]:
    """The records of a run's iterations, by step, from every lead's OUT/<node>/metrics.jsonl (a head
    that took over begins with a `recovered` record of the last step, which the dead lead may have
    written too: then the lead's is kept)."""
    from decentral.metrics import read_metrics

    found: dict[int, dict] = {}
    for path in sorted(Path(out).glob("*/metrics.jsonl")):
        for record in read_metrics(path):
            if record["step"] not in found or found[record["step"]].get("recovered"):
                found[record["step"]] = record
    return [found[step] for step in sorted(found)]


def stage_checkpoints(out: str | Path) -> dict[str, int | None]:
    """The nodes of run folder `out` that left a stage checkpoint (OUT/<node>/stage), each with the iteration
    it holds (None when its meta.json cannot be read: loading it says why)."""
    from decentral.checkpoint import CheckpointError, checkpoint_present, read_checkpoint_meta

    found: dict[str, int | None] = {}
    folders = sorted(p for p in Path(out).iterdir() if p.is_dir()) if Path(out).is_dir() else []
    for folder in folders:
        if checkpoint_present(folder / "stage"):  # (read as loading reads it: a save cut off left it aside)
            try:
                found[folder.name] = int(read_checkpoint_meta(folder / "stage")["iteration"])
            except (CheckpointError, ValueError, KeyError, TypeError):
                found[folder.name] = None
    return found


def resume_hint(out: str | Path, recipe_path: str | Path) -> str:
    """Where a stopped run in `out` of the recipe at `recipe_path` can go on from: its nodes' last checkpoints, or
    none yet."""
    iterations = [i for i in stage_checkpoints(out).values() if i is not None]
    if not iterations:
        return f"no node had checkpointed yet (every train.eval_every iterations): {out} cannot be resumed"
    return (f"the nodes' last checkpoints (iteration {min(iterations)}) are in {out}: `decentral pipeline train "
            f"--resume --recipe {recipe_path} --out {out}` goes on from them")


def node_network(recipe, path: str | Path | None = None) -> Network:
    """The network a run plans over: the file at `path` (else the recipe's pipeline.network, else the
    recipe's loopback network), shaped as the recipe says (stages, skip, microbatches, activation size)."""
    path = path or recipe.pipeline.network
    return load_network(path, network_shape(recipe)) if path else loopback_network(recipe)


def train_run(recipe_path: str | Path, out: str | Path, *, network_path: str | Path | None = None,
              netlab: str | None = None, latency_ms: float = 0.0, steps: int | None = None, data=None,
              drop: float = 0.5, timeout_s: float = 3600.0, evaluate: bool = True, resume: bool = False) -> dict:
    """`decentral pipeline train`: plan the allocation, run every node as a process (on netlab hosts
    when `netlab` is a rate), wait for the end, evaluate (unless told not to). Returns {"evaluation"
    (None when not evaluated), "metrics" (`run_metrics`), "lead" (the one that ended the run)}.

    The nodes share a swarm key made for the run (OUT/swarm.key). `resume`: every node goes on from its
    checkpoint in OUT, with the network and allocation of OUT/network.json (a `network_path` too is
    refused). `timeout_s` counts the nodes' start-up too.
    PipelineError when the run fails; CheckpointError when another process writes to `out`."""
    from decentral.pipeline.evaluate import check_drop
    from decentral.pipeline.recipe import load_pipeline_recipe

    recipe = load_pipeline_recipe(recipe_path)
    if steps is not None and steps < 1:
        raise PipelineError(f"steps must be at least 1, got {steps}")
    if evaluate:
        check_drop(drop)  # before the run, not after it
    if data:
        from decentral.data import load_corpus

        load_corpus(data)  # what every node reads: a bad --data fails here, not in each node after its start-up
    out = Path(out)
    if resume:
        if not (out / "network.json").exists():
            raise PipelineError(f"--resume: {out} holds no run to resume (no network.json)")
        if network_path:
            raise PipelineError(f"--resume keeps the run's network and allocation ({out / 'network.json'}), so "
                                f"--network {network_path} would not be read: drop it, or start a new run in "
                                "another --out to plan for that network")
        saved_network = load_network(out / "network.json")  # the first run's allocation
        if saved_network.stages != recipe.pipeline.stages:
            raise PipelineError(f"--resume: the run in {out} has {saved_network.stages} stages, the recipe "
                                f"{recipe_path} has {recipe.pipeline.stages}: give the recipe the run was started "
                                "with (--recipe)")
        network = shaped_network(saved_network, recipe)
        saved = stage_checkpoints(out)
        missing = [node.name for node in network.nodes if node.name not in saved]
        if missing:
            raise PipelineError(f"--resume: no stage checkpoint of node(s) {', '.join(missing)} in {out} (nodes "
                                "checkpoint every train.eval_every iterations): to start over, remove it or give "
                                "another --out")
        try:
            run_metrics(out)  # what the progress reads while the nodes train, and the lead keeps up to its checkpoint
        except ValueError as e:  # (read_metrics names the file and line)
            raise PipelineError(f"--resume: {e}: the lead keeps the run's records up to its checkpoint; mend that "
                                "file, or move it aside") from None
        done, target = min((i for i in saved.values() if i is not None), default=0), steps or recipe.recipe.train.steps
        _note_another_recipe(out / sorted(saved)[0] / "stage", recipe.to_dict(), recipe_path)
        if done >= target:
            raise PipelineError(f"--resume: the nodes' checkpoints in {out} are at iteration {done}, {target} were "
                                f"asked for: nothing to train (give more --steps; `decentral pipeline eval {out}` "
                                "scores the model)")
    else:
        network = pinned(node_network(recipe, network_path), seed=recipe.recipe.train.seed,
                         effort=recipe.pipeline.effort)
        done = None
    out.mkdir(parents=True, exist_ok=True)
    with sole_writer(out):
        return _train_locked(recipe, Path(recipe_path), network, out, netlab=netlab, latency_ms=latency_ms,
                             steps=steps, data=data, drop=drop, timeout_s=timeout_s, evaluate=evaluate,
                             resume_from=done)


def _note_another_recipe(stage: Path, ours: dict, recipe_path: str | Path) -> None:
    """A note on stderr when the recipe the stage checkpoint `stage` was trained with differs from `ours` (besides
    train.steps, which --steps sets): a resume without the run's --recipe goes on with the shipped one's settings."""
    from decentral.checkpoint import CheckpointError, read_checkpoint_meta

    try:
        theirs = read_checkpoint_meta(stage).get("recipe")
    except CheckpointError:  # (loading the stage says what is wrong with it)
        return
    differ = recipe_differences(theirs, ours) if isinstance(theirs, dict) else ""
    if differ:
        print(f"note: the run in {stage.parent.parent} was trained with another recipe than {recipe_path} ({differ}"
              "): it goes on with this one's; give the run's --recipe to go on as it was", file=sys.stderr, flush=True)


def _train_locked(recipe, recipe_path: Path, network: Network, out: Path, *, netlab, latency_ms, steps, data, drop,
                  timeout_s, evaluate, resume_from: int | None) -> dict:
    """`train_run` once its inputs are checked and it alone writes to `out`; `resume_from`: the iteration its
    nodes' checkpoints are at (None: a run that starts)."""
    from decentral.pipeline.evaluate import evaluate_run
    from decentral.swarm.admission import SwarmKey

    deadline = time.monotonic() + timeout_s  # start-up counts
    key = out / "swarm.key"
    if not key.exists():
        SwarmKey.generate(key)
    node_args = ["--swarm-key", str(key)] + [a for path in data or () for a in ("--data", str(path))]
    node_args += ["--resume"] if resume_from is not None else []
    lab = None
    if netlab:
        from decentral.netlab import NetLab

        lab = NetLab(len(network.nodes), netlab, latency_ms=latency_ms, name="skp")
    try:
        with LocalPipeline(recipe_path, network, out, steps=steps, lab=lab, node_args=node_args,
                           env={"DECENTRAL_LINK_LATENCY_MS": f"{latency_ms:g}"}) as run:
            print(f"pipeline train: starting {len(network.nodes)} nodes (their logs: {out}/<node>.log)", flush=True)
            run.start(min(START_S, timeout_s))
            # on stdout, as a worker's steps are; a resumed run's from its checkpoints' iteration
            with progress_bar(steps or recipe.recipe.train.steps, "pipeline train", "iterations", file=sys.stdout,
                              initial=resume_from or 0) as bar:  # (a count done: the lead numbers iterations from 1)
                def tick() -> None:
                    bar.update(run.iterations_done() - bar.n)

                code = run.wait(deadline - time.monotonic(), tick)
                tick()
            if code != 0:
                raise PipelineError(f"the lead ({run.lead}) exited with {code} and no head was left to take over "
                                    f"(its last line: {run.last_line(run.lead)}); {resume_hint(out, recipe_path)}")
            lead = run.lead
            print("pipeline train: done; stopping the nodes" + (", then evaluating" if evaluate else ""), flush=True)
    finally:
        if lab is not None:
            lab.close()
    return {"evaluation": evaluate_run(out, drop=drop, data=data) if evaluate else None, "lead": lead,
            "metrics": run_metrics(out)}
