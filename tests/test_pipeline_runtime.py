"""The SkipPipe runtime: stage servers over real gRPC on loopback, in this process (fast, exact checks)
and as separate `decentral pipeline node` processes found through the DHT (end to end, a killed node)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from decentral.checkpoint import CheckpointError, load_checkpoint
from decentral.config import RecipeError
from decentral.cpu import descendants
from decentral.data.corpus import load_corpus
from decentral.models.gpt import GPT
from decentral.pipeline.cli import add_pipeline_parser
from decentral.pipeline.coordinator import Coordinator
from decentral.pipeline.discovery import new_server
from decentral.pipeline.launch import _note_another_recipe, run_metrics, stage_checkpoints
from decentral.pipeline.network import NetworkError, PipelineError, load_network, parse_network
from decentral.pipeline.node import StageNode, microbatch
from decentral.pipeline.recipe import load_pipeline_recipe, parse_pipeline_recipe, shaped_network
from decentral.pipeline.simulator import simulate
from decentral.pipeline.stages import cut, make_stage, partial_loss
from decentral.swarm.admission import SwarmKey
from decentral.sync import DiLoCo
from decentral.worker import inner_lr

from conftest import kill_leftovers, running, wait_until


MODEL = {"n_layer": 4, "n_head": 2, "d_model": 32, "context": 32}
TRAIN = {"batch_size": 4, "context": 32, "lr": 3.0e-3, "warmup_steps": 2, "eval_batches": 2, "eval_every": 100}


def tiny_recipe(stages: int, skip: float, microbatches: int, **more) -> dict:
    return {"pipeline": {"stages": stages, "skip": skip, "microbatches": microbatches, **more.pop("pipeline", {})},
            "protocol": {"name": "local"}, "train": {**TRAIN, **more.pop("train", {})}, "model": MODEL,
            "swarm": {"run": f"pipe{time.monotonic_ns()}", "timeout": 10.0, "heartbeat_s": 0.5}, **more}


def pinned_network(recipe, stage_of: dict[str, int]):
    return shaped_network(parse_network({
        "stages": recipe.pipeline.stages, "skip": 0, "microbatches": 1, "activation_bytes": 0,
        "nodes": [{"name": name, "compute_ms": 1, "stage": stage} for name, stage in stage_of.items()],
        "default_link": {"latency_ms": 1, "bandwidth_mbps": 1000}}), recipe)


class InProcessPipeline:
    """Stage nodes of one pipeline as objects of this process (real gRPC servers on loopback); the
    first head coordinates, with a fixed list of servers instead of the DHT."""

    def __init__(self, recipe, stage_of: dict[str, int], tokens, make_protocol=None, network=None):
        self.recipe, self.events, self.tokens, self.make_protocol = recipe, [], tokens, make_protocol
        self.nodes: dict[str, StageNode] = {}
        self.servers = {}
        for name, stage in stage_of.items():
            self.add(name, stage)
        lead = next(node for node in self.nodes.values() if node.stage.index == 0)
        self.coordinator = Coordinator(network or pinned_network(recipe, stage_of), lambda: dict(self.servers),
                                       lead.links, lead.address, seed=recipe.recipe.train.seed,
                                       routing=recipe.pipeline.routing, on_event=self.events.append)
        lead.coordinator = self.coordinator

    def make(self, name: str, stage: int) -> StageNode:
        recipe = self.recipe
        return StageNode(name, make_stage(recipe.recipe.model, recipe.pipeline.stages, stage, recipe.recipe.train.seed),
                         recipe, memory=3, tokens=self.tokens if stage == 0 else None,
                         make_protocol=self.make_protocol(name) if self.make_protocol else None)

    def add(self, name: str, stage: int, node: StageNode | None = None) -> StageNode:
        """Start a node (made here unless given) and list it among the servers up."""
        node = node or self.make(name, stage)
        node.start()
        self.nodes[name] = node
        self.servers[name] = new_server(name, node.address, stage)
        return node

    def visits(self, iteration: int) -> list[str]:
        return [n for e in self.events if e["event"] == "begin" and e["iteration"] == iteration
                for route in e["routes"] for n in route]

    def close(self) -> None:
        for node in self.nodes.values():
            node.close()


def first_iteration_by_hand(model, order: list[int], tokens, recipe) -> float:
    """What a 4-stage pipeline's first iteration of one microbatch does, on the whole `model` along stage
    `order`: the loss (returned), its backward, each stage's gradient clipped, one AdamW step."""
    x, y = microbatch(tokens, 0, 0, TRAIN["batch_size"], TRAIN["context"], recipe.recipe.train.seed)
    loss = partial_loss(model, 4, order, x, y)
    loss.backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=inner_lr(0, recipe.recipe),
                                  weight_decay=recipe.recipe.train.weight_decay, betas=(0.9, 0.95))
    for stage in cut(model, 4):
        torch.nn.utils.clip_grad_norm_([p for p in stage.parameters() if p.grad is not None], 1.0)
    optimizer.step()
    return loss.item()


def test_one_microbatch_through_the_pipeline_is_the_whole_models_math(small_corpus):
    """Loss, gradients (a skipped stage gets none) and one AdamW step per stage, as the whole GPT along
    the same path computes them."""
    recipe = parse_pipeline_recipe(tiny_recipe(4, 0.25, 1))
    tokens = load_corpus([small_corpus]).train
    pipeline = InProcessPipeline(recipe, {"h": 0, "a": 1, "b": 2, "c": 3}, tokens)
    try:
        record = pipeline.coordinator.run_iteration(0)
        route = pipeline.events[0]["routes"][0]
        order = [pipeline.nodes[name].stage.index for name in route]
        torch.manual_seed(recipe.recipe.train.seed)
        model = GPT(recipe.recipe.model)
        loss = first_iteration_by_hand(model, order, tokens, recipe)
        assert record["microbatches"] == 1 and record["loss"] == pytest.approx(loss, rel=1e-6)
        skipped = ({0, 1, 2, 3} - set(order)).pop()
        for node in pipeline.nodes.values():
            ours, theirs = node.stage.global_state_dict(), model.state_dict()
            assert all(torch.allclose(ours[k], theirs[k], atol=1e-6) for k in ours), node.name
        untouched = make_stage(recipe.recipe.model, 4, skipped, recipe.recipe.train.seed).global_state_dict()
        name = next(n for n, node in pipeline.nodes.items() if node.stage.index == skipped)
        assert all(torch.equal(v, untouched[k]) for k, v in pipeline.nodes[name].stage.global_state_dict().items())
    finally:
        pipeline.close()


def test_the_nodes_learning_rate_spans_the_run_length_the_lead_says(small_corpus):
    """`pipeline train --steps 100` ran 100 iterations on the LR schedule of the recipe's train.steps (400): the
    learning rate had barely decayed at the end. The lead says its run's length with every step."""
    recipe = parse_pipeline_recipe(tiny_recipe(2, 0.0, 1))
    pipeline = InProcessPipeline(recipe, {"h": 0, "a": 1}, load_corpus([small_corpus]).train)
    pipeline.coordinator.steps = 4
    try:
        for iteration in range(4):
            pipeline.coordinator.run_iteration(iteration)
        expected = inner_lr(3, recipe.recipe, 4)  # past the 2 warmup steps, half-way down a 4-step cosine
        assert expected < 0.6 * inner_lr(3, recipe.recipe)  # (a 400-step schedule's is near its peak)
        assert {g["lr"] for node in pipeline.nodes.values() for g in node.optimizer.param_groups} == {expected}
    finally:
        pipeline.close()


def test_two_stages_train_with_replicas_kept_together_by_diloco_and_random_routing(small_corpus, make_swarm):
    recipe = parse_pipeline_recipe(tiny_recipe(2, 0.0, 4, pipeline={"routing": "random"}))
    swarm = dict(zip(("a1", "a2"), make_swarm(2)))
    protocols = {}

    def make_protocol(name):
        if name not in swarm:
            return None

        def make(stage, optimizer):
            protocols[name] = DiLoCo(stage, optimizer, swarm[name], every=4, outer_lr=1.0, outer_momentum=0.5)
            return protocols[name]
        return make

    pipeline = InProcessPipeline(recipe, {"h": 0, "a1": 1, "a2": 1}, load_corpus([small_corpus]).train, make_protocol)
    try:
        records = [pipeline.coordinator.run_iteration(i) for i in range(12)]
        assert all(r["microbatches"] == 4 for r in records)
        assert sum(r["loss"] for r in records[-3:]) / 3 < records[0]["loss"] - 0.5
        visited = [name for e in pipeline.events if e["event"] == "begin" for route in e["routes"] for name in route]
        assert visited.count("a1") > 4 and visited.count("a2") > 4  # random replicas, not always the planned one
        assert [r["sync"] and len(r["sync"]) for r in records[3::4]] == [2, 2, 2]  # both replicas synced every 4th
        a1, a2 = (pipeline.nodes[n].stage.global_state_dict() for n in ("a1", "a2"))
        assert all(torch.equal(a1[k], a2[k]) for k in a1)  # right after a DiLoCo round: θ = φ on both
        assert protocols["a1"].round == 3
    finally:
        pipeline.close()


def test_the_makespan_of_heads_on_machines_whose_clocks_differ_is_one_iterations(small_corpus):
    """Each head reports when its microbatches began and ended on its own monotonic clock (seconds since its
    machine booted); the makespan was the latest end less the earliest start over all heads, so heads on two
    machines made it the difference of their uptimes (here a day). Now it is the longest span on one clock."""
    recipe = parse_pipeline_recipe(tiny_recipe(2, 0.0, 4))
    pipeline = InProcessPipeline(recipe, {"h0": 0, "h1": 0, "a": 1}, load_corpus([small_corpus]).train)
    try:
        report = pipeline.coordinator.on_report
        booted_a_day_earlier = "h1"

        def on_report(body: dict) -> None:
            if body.get("node") == booted_a_day_earlier and "begun" in body:
                body = {**body, "begun": body["begun"] + 86400.0, "end": body["end"] + 86400.0}
            report(body)
        pipeline.coordinator.on_report = on_report
        records = [pipeline.coordinator.run_iteration(i) for i in range(2)]
        assert booted_a_day_earlier in pipeline.visits(0) + pipeline.visits(1)
        for record in records:
            assert 0 < record["makespan_ms"] <= record["wall_ms"], record
    finally:
        pipeline.close()


def test_a_joining_node_is_planned_in_with_its_stages_weights_and_a_leaving_one_planned_out(small_corpus):
    recipe = parse_pipeline_recipe(tiny_recipe(3, 0.0, 4))
    everyone = {"h": 0, "a1": 1, "b": 2, "a2": 1}
    pipeline = InProcessPipeline(recipe, {"h": 0, "a1": 1, "b": 2}, load_corpus([small_corpus]).train,
                                 network=pinned_network(recipe, everyone))
    try:
        records = [pipeline.coordinator.run_iteration(i) for i in range(3)]
        newcomer = pipeline.make("a2", 1)
        assert newcomer.copy_replica(pipeline.servers.values()) == "a1"
        trained = pipeline.nodes["a1"].stage.global_state_dict()
        assert all(torch.equal(v, trained[k]) for k, v in newcomer.stage.global_state_dict().items())
        pipeline.add("a2", 1, newcomer)
        records += [pipeline.coordinator.run_iteration(i) for i in range(3, 5)]
        assert records[3]["replanned"] and records[3]["nodes"] == 4 and not records[4]["replanned"]
        assert "a2" in pipeline.visits(3) + pipeline.visits(4)
        pipeline.nodes["a1"].close()  # leaves without a word: its server refuses connections
        records += [pipeline.coordinator.run_iteration(i) for i in range(5, 7)]
        assert records[5]["dead"] == ["a1"] and records[5]["microbatches"] == 4
        assert records[6]["nodes"] == 3 and "a1" not in pipeline.visits(6)
        assert all(r["microbatches"] == 4 for r in records) and records[-1]["loss"] < records[0]["loss"]
    finally:
        pipeline.close()


def test_after_calibrate_at_iterations_the_plan_takes_the_compute_the_nodes_measured(small_corpus):
    recipe = parse_pipeline_recipe(tiny_recipe(3, 0.0, 3))
    pipeline = InProcessPipeline(recipe, {"h": 0, "a": 1, "b": 2}, load_corpus([small_corpus]).train)
    pipeline.coordinator.calibrate_at = 2
    assumed = {node.name: node.compute_ms for node in pipeline.coordinator.network.nodes}
    try:
        records = [pipeline.coordinator.run_iteration(i) for i in range(4)]
        assert [r["replanned"] for r in records] == [False, False, True, False]
        measured = next(e["compute_ms"] for e in pipeline.events if e["event"] == "step" and e["iteration"] == 1)
        network = pipeline.coordinator.network
        assert {node.name: node.compute_ms for node in network.nodes} == {n: m["forward"] for n, m in measured.items()}
        heads = [m["loss"] / m["forward"] for m in measured.values() if m.get("loss")]
        assert network.loss_factor == pytest.approx(sum(heads) / len(heads))
        routes = next(e["routes"] for e in pipeline.events if e["event"] == "begin" and e["iteration"] == 3)
        expected = simulate(network, [[network.index(n) for n in route] for route in routes], record=False)
        assert records[3]["predicted_ms"] == pytest.approx(expected.makespan_ms)
        assert {node.name: node.compute_ms for node in network.nodes} != assumed  # measured, not the file's figures
    finally:
        pipeline.close()


def test_four_stage_processes_recover_from_a_killed_node(tmp_path, small_corpus, local_pipeline):
    """Six `decentral pipeline node` processes find each other through the DHT (with a swarm key); one
    replica of stage 1 is killed at the start of iteration 2. That iteration still finishes every
    microbatch: those that did not cross the dead node with their first attempt, the others re-sent
    along a re-plan; training goes on with five nodes and the loss falls. The killed node is started
    again, as a process joining from elsewhere would: it copies its stage from the live replica and
    is planned in."""
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(tiny_recipe(4, 0.25, 4)))
    recipe = load_pipeline_recipe(recipe_path)
    stage_of = {"h0": 0, "h1": 0, "a1": 1, "a2": 1, "b": 2, "c": 3}
    network = pinned_network(recipe, stage_of)
    SwarmKey.generate(tmp_path / "swarm.key")
    steps, doomed_iteration = 24, 2
    with local_pipeline(recipe_path, network, tmp_path / "run", steps=steps,
                        node_args=["--data", str(small_corpus), "--swarm-key", str(tmp_path / "swarm.key")],
                        env={"DECENTRAL_LINK_LATENCY_MS": "60"}) as run:
        run.start()  # its nodes forked from `prefork`: a restart is planned in within iterations, not seconds of imports
        events = tmp_path / "run" / run.lead / "events.jsonl"
        deadline = time.monotonic() + 120
        begin = None
        while begin is None:
            assert time.monotonic() < deadline and run.procs[run.lead].poll() is None, run.log(run.lead)
            if events.exists():
                begin = next((e for e in map(json.loads, events.read_text().splitlines())
                              if e["event"] == "begin" and e["iteration"] == doomed_iteration), None)
            time.sleep(0.01)  # polling the lead's event log
        crossing = [m for m, route in enumerate(begin["routes"]) if "a1" in route]
        victim = "a1" if crossing else "a2"
        crossing = [m for m, route in enumerate(begin["routes"]) if victim in route]
        run.kill(victim)
        run.restart(victim)
        assert run.wait(120) == 0, run.log(run.lead)
    records = [json.loads(line) for line in (tmp_path / "run" / run.lead / "metrics.jsonl").read_text().splitlines()]
    assert [r["microbatches"] for r in records] == [4] * steps
    doomed = records[doomed_iteration]
    assert doomed["dead"] == victim and doomed["relaunched"] == len(crossing) >= 1
    done = [e for e in map(json.loads, events.read_text().splitlines())
            if e["event"] == "done" and e["iteration"] == doomed_iteration]
    assert sorted((e["microbatch"], e["attempt"]) for e in done) == [(m, int(m in crossing)) for m in range(4)]
    nodes = [r["nodes"] for r in records[doomed_iteration + 1:]]
    back = nodes.index(6)  # the restarted node, planned in again
    assert set(nodes[:back]) == {5} and set(nodes[back:]) == {6} and records[doomed_iteration + 1 + back]["replanned"]
    other = next(name for name, stage in stage_of.items() if stage == 1 and name != victim)
    assert f"copied stage 1's weights from {other}" in run.log(victim)
    assert sum(r["loss"] for r in records[-2:]) / 2 < records[0]["loss"] - 0.3
    for name in stage_of:  # every node wrote its stage at the end, the restarted one too
        assert (tmp_path / "run" / name / "stage" / "meta.json").exists()


def test_a_run_whose_lead_died_resumes_from_the_checkpoints_where_it_left_off(tmp_path, small_corpus, local_pipeline,
                                                                              prefork, capsys):
    """The lead of a 2-stage run (its only head) is killed after its checkpoint at iteration 4: no head
    can take over, so the other node says so in one line and exits 2. `pipeline train --resume` goes on
    from there with every node's weights and AdamW state: its iterations 5.. have the losses the killed
    run logged for them (the same microbatches on the same state), and it ends at --steps."""
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(tiny_recipe(2, 0.0, 2, train={"eval_every": 4})))
    recipe = load_pipeline_recipe(recipe_path)
    network = pinned_network(recipe, {"h": 0, "a": 1})
    out = tmp_path / "run"
    with local_pipeline(recipe_path, network, out, steps=12, node_args=["--data", str(small_corpus)],
                        env={"DECENTRAL_LINK_LATENCY_MS": "40"}) as run:
        run.start()
        metrics = out / run.lead / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not metrics.exists() or metrics.read_text().count("\n") < 6:
            assert time.monotonic() < deadline and run.procs[run.lead].poll() is None, run.log(run.lead)
            time.sleep(0.01)  # polling the lead's metrics
        run.kill(run.lead)
        assert run.wait(60) == -9 and run.procs["a"].returncode == 2, run.log("a")
        assert run.log("a").count("no head is left to take over") == 1
    killed = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert 6 <= len(killed) < 8, len(killed)  # it died between the checkpoints of iterations 4 and 8
    done = prefork.run(["pipeline", "train", "--recipe", str(recipe_path), "--out", str(out), "--data", str(small_corpus),
                        "--steps", "12", "--resume"], tmp_path, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumes stage 0 at iteration 4" in (out / "h.log").read_text()
    said = [line for line in done.stdout.splitlines() if line.startswith("pipeline train: ") and "of 12" in line]
    assert said[0] == "pipeline train: 4 of 12 iterations" and said[-1].endswith("12 of 12 iterations"), said  # (not 0)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert [r["loss"] for r in records[:4]] == [r["loss"] for r in killed[:4]]  # kept
    for again, first in zip(records[4:len(killed)], killed[4:]):  # redone from the checkpoint
        assert again["loss"] == pytest.approx(first["loss"], rel=1e-4), (again, first)
    for name in ("h", "a"):
        tensors, meta = load_checkpoint(out / name / "stage")
        assert meta["iteration"] == 12 and any(k.startswith("inner.") for k in tensors)
    assert "another recipe" not in done.stderr  # resumed with its own
    # resumed with another recipe (the shipped one, when --recipe is left out): its settings go on, as said
    other = recipe.to_dict()
    other["train"] = {**other["train"], "eval_every": 100, "steps": 400}
    _note_another_recipe(out / "h" / "stage", other, "other.yaml")
    assert capsys.readouterr().err == (f"note: the run in {out} was trained with another recipe than other.yaml "
                                       "(train.eval_every 4 there, 100 here): it goes on with this one's; give the "
                                       "run's --recipe to go on as it was\n")

    # a lead whose metrics file is malformed cannot keep its records up to its checkpoint: said before any node
    # starts, naming the line, the file left as it was (the run's progress ended in a traceback; the lead, run by
    # hand, ended in one too)
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:3] + ["{not json"] + lines[3:]) + "\n")
    malformed = metrics.read_text()
    done = prefork.run(["pipeline", "train", "--recipe", str(recipe_path), "--out", str(out), "--data", str(small_corpus),
                        "--steps", "14", "--resume"], tmp_path, timeout=120)
    assert done.returncode == 2 and f"{metrics}:4: malformed metrics line" in done.stderr, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and "pipeline train: starting" not in done.stdout
    with local_pipeline(recipe_path, network, out, steps=14, node_args=["--data", str(small_corpus), "--resume"]) as run:
        run.start()
        with pytest.raises(PipelineError, match=f"node h could not run as asked .*{metrics}:4: malformed metrics line"):
            run.wait(60)
    assert "Traceback" not in run.log(run.lead) and metrics.read_text() == malformed
    metrics.write_text("\n".join(lines) + "\n")

    # a node whose checkpoint is corrupt cannot go on: the run ends at once, saying why (not after the lead's --wait)
    stage_file = next((out / "a" / "stage").glob("*.safetensors"))
    stage_file.write_bytes(stage_file.read_bytes()[:1000])
    done = prefork.run(["pipeline", "train", "--recipe", str(recipe_path), "--out", str(out), "--data", str(small_corpus),
                        "--steps", "14", "--resume"], tmp_path, timeout=120)
    assert done.returncode == 2 and "node a could not run as asked" in done.stderr, done.stdout + done.stderr
    assert "corrupt checkpoint" in done.stderr and done.stderr.count("\n") == 1


def test_train_and_eval_from_the_command_line(tmp_path, small_corpus, prefork):
    """`decentral pipeline train` runs a 2-stage pipeline of processes and evaluates it; `pipeline eval`
    scores the run again; a recipe with a typo is one line and exit code 2."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(2, 0.0, 2, pipeline={"nodes": 2}, train={"steps": 15})))
    out = tmp_path / "run"
    done = prefork.run(["pipeline", "train", "--recipe", str(recipe), "--out", str(out), "--data", str(small_corpus)],
                       tmp_path, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "whole model (2 stages)" in done.stdout and "1 of 2 stages" in done.stdout
    assert "pipeline train: 15 of 15 iterations" in done.stdout  # progress where no terminal shows a bar: a log
    evaluation = json.loads((out / "eval.json").read_text())
    lead = next(p.parent.name for p in out.glob("*/metrics.jsonl"))
    records = [json.loads(line) for line in (out / lead / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 15 and records[-1]["loss"] < records[0]["loss"] - 0.5
    assert evaluation["full_loss"] < records[0]["loss"] - 0.5 and evaluation["kept_stages"] == 1
    again = prefork.run(["pipeline", "eval", str(out), "--data", str(small_corpus)], tmp_path, timeout=120)
    assert again.returncode == 0 and f"{evaluation['full_loss']:.4f}" in again.stdout
    assert f"wrote {out / 'eval.json'} (in place of the last evaluation)" in again.stdout  # it was silent
    checkpoints = {path: path.read_bytes() for path in out.glob("*/stage/*")}
    refused = prefork.run(["pipeline", "train", "--recipe", str(recipe), "--out", str(out), "--data",
                           str(small_corpus), "--steps", "2"], tmp_path, timeout=60)  # without --resume: kept
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stdout + refused.stderr
    assert "holds an earlier run" in refused.stderr and "--resume" in refused.stderr
    assert {path: path.read_bytes() for path in out.glob("*/stage/*")} == checkpoints
    kept = (out / lead / "metrics.jsonl").read_bytes()
    for name in sorted({path.parent.parent.name for path in checkpoints}):  # a node started by hand: it wrote over
        refused = prefork.run(["pipeline", "node", "--recipe", str(recipe), "--network", str(out / "network.json"),
                               "--name", name, "--out", str(out / name), "--data", str(small_corpus),
                               *(["--lead"] if name == lead else [])], tmp_path, timeout=60)
        assert refused.returncode == 2 and f"{out / name / 'stage'} holds an earlier run's checkpoint" in refused.stderr
        assert "--resume goes on from it" in refused.stderr, refused.stderr
    assert {path: path.read_bytes() for path in out.glob("*/stage/*")} == checkpoints
    assert (out / lead / "metrics.jsonl").read_bytes() == kept
    refused = prefork.run(["pipeline", "train", "--recipe", str(recipe), "--out", str(out), "--resume"], tmp_path,
                          timeout=60)  # the recipe's 15 steps are done: said at once, not a run that does nothing
    assert refused.returncode == 2 and "at iteration 15, 15 were asked for: nothing to train" in refused.stderr
    unsaved = tmp_path / "unsaved"  # a run stopped before its first checkpoint: --resume says so before any node starts
    unsaved.mkdir()
    (unsaved / "network.json").write_bytes((out / "network.json").read_bytes())
    refused = prefork.run(["pipeline", "train", "--recipe", str(recipe), "--out", str(unsaved), "--resume"], tmp_path,
                          timeout=60)
    assert refused.returncode == 2 and "no stage checkpoint of node(s)" in refused.stderr, refused.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"pipeline": {"stagse": 2}}))
    refused = prefork.run(["pipeline", "train", "--recipe", str(bad), "--out", str(tmp_path / "bad")], tmp_path,
                          timeout=60)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "stagse" in refused.stderr
    refused = prefork.run(["pipeline", "train", "--recipe", str(recipe), "--out", str(tmp_path / "nodata"), "--data",
                           str(tmp_path / "missing.txt")], tmp_path, timeout=60)  # before any node starts
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stdout + refused.stderr
    assert refused.stderr.startswith("decentral: corpus path does not exist") and not (tmp_path / "nodata").exists()


def test_an_interrupted_train_ends_every_node_and_says_where_to_resume_from(tmp_path, small_corpus):
    """`pipeline train` stopped by a SIGTERM to it alone (a scheduler's cancel; a terminal's Ctrl-C takes the
    same way, as KeyboardInterrupt, and reaches no node either: each runs in a session of its own): exit 130
    within seconds, one line on stderr naming the nodes' last checkpoint and `--resume`, and no node process
    (nor its DHT) left running."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(2, 0.0, 2, pipeline={"nodes": 2}, train={"steps": 500,
                                                                                           "eval_every": 2})))
    out = tmp_path / "run"
    repo = Path(__file__).resolve().parent.parent
    train = subprocess.Popen(
        [sys.executable, "-m", "decentral", "pipeline", "train", "--recipe", str(recipe), "--out", str(out), "--data",
         str(small_corpus)], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)  # its own group, as a terminal's job is
    nodes: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while not (run_metrics(out) and run_metrics(out)[-1]["step"] >= 3 and len(stage_checkpoints(out)) == 2):
            assert time.monotonic() < deadline and train.poll() is None, train.stderr.read() if train.poll() else ""
            time.sleep(0.1)  # polling the lead's metrics and the checkpoints
        nodes = descendants(train.pid)  # the nodes and their DHT processes
        assert len(nodes) >= 4
        os.kill(train.pid, signal.SIGTERM)
        _, stderr = train.communicate(timeout=30)
        assert train.returncode == 130, stderr
        saved = min(stage_checkpoints(out).values())
        assert stderr.startswith("pipeline train: interrupted;") and stderr.count("\n") == 1, stderr
        assert f"last checkpoints (iteration {saved})" in stderr
        assert f"`decentral pipeline train --resume --recipe {recipe} --out {out}`" in stderr  # the recipe, by name
        wait_until(lambda: not any(running(pid) for pid in nodes), timeout=5, what="the nodes to end")
        for log in out.glob("*.log"):
            assert "Traceback" not in log.read_text(), log.read_text()
    finally:
        train.kill()
        kill_leftovers(nodes)


@contextlib.contextmanager
def held(folder: Path):
    """Another process holds `folder`'s run lock (checkpoint.sole_writer) within the block, as a running
    `pipeline train` or node does."""
    folder.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from decentral.checkpoint import sole_writer\n"
         "with sole_writer(sys.argv[1]):\n    print('held', flush=True); sys.stdin.read()", str(folder)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield
    finally:
        holder.communicate("")


def test_a_second_train_or_node_given_the_out_a_running_one_writes_to_stops_before_it_starts(tmp_path):
    """Two `pipeline train` runs given one --out, both before the first checkpoint, both ran and wrote over each
    other's network.json, swarm key and stage checkpoints; two nodes given one --out shared its identity (one
    peer id). The second now stops at once (decentral.cli: one line, exit 2), as a second `train` does."""
    parser = argparse.ArgumentParser(prog="decentral")
    add_pipeline_parser(parser.add_subparsers(dest="command", required=True))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(2, 0.0, 2, pipeline={"nodes": 2})))
    for command in (["train", "--recipe", str(recipe)], ["node", "--recipe", str(recipe), "--name", "n00", "--stage", "0"]):
        out = tmp_path / command[0]
        with held(out):
            args = parser.parse_args(["pipeline", *command, "--out", str(out)])
            with pytest.raises(CheckpointError, match=f"another process is writing to {out}"):
                args.func(args)
        assert sorted(p.name for p in out.iterdir()) == [".lock"], command  # no network.json, key, identity, log


def test_a_node_whose_port_is_taken_says_so(small_corpus):
    """A --port another process listens on is a PipelineError naming it (decentral.cli: one line, exit 2)."""
    recipe = parse_pipeline_recipe(tiny_recipe(2, 0.0, 2))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PipelineError, match=f"cannot listen on 127.0.0.1:{port}: the port is in use"):
            StageNode("h", make_stage(recipe.recipe.model, 2, 1, 0), recipe, memory=3, port=port)


def test_resume_refuses_a_network_file_it_would_not_read_and_a_recipe_of_another_shape(tmp_path):
    """`pipeline train --resume` keeps the run's OUT/network.json: a --network beside it is refused, before any
    node starts, rather than silently ignored; so is a recipe with other stages than the run's (the nodes started,
    then each stopped saying its checkpoint holds another stage)."""
    networks = Path(__file__).resolve().parent.parent / "examples" / "networks"
    out = tmp_path / "run"
    load_network(networks / "two_sites.json").save(out / "network.json")  # a run stopped before its checkpoints
    parser = argparse.ArgumentParser(prog="decentral")
    add_pipeline_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["pipeline", "train", "--out", str(out), "--resume", "--network",
                              str(networks / "regions20.json")])
    with pytest.raises(PipelineError, match=r"--resume keeps the run's network .* --network .*regions20.json would "
                                            "not be read: drop it"):
        args.func(args)
    assert sorted(p.name for p in out.iterdir()) == ["network.json"]
    args = parser.parse_args(["pipeline", "train", "--out", str(out), "--resume"])  # the shipped recipe: 6 stages
    with pytest.raises(PipelineError, match=r"the run in .* has 4 stages, the recipe .*skippipe.yaml has 6: give the "
                                            r"recipe the run was started with \(--recipe\)"):
        args.func(args)
    assert sorted(p.name for p in out.iterdir()) == ["network.json"]


def test_every_command_ends_its_help_with_an_example_and_refuses_bad_input_as_one_error(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="decentral")
    add_pipeline_parser(parser.add_subparsers(dest="command", required=True))
    for command in ("plan", "train", "eval", "node"):
        with pytest.raises(SystemExit):
            parser.parse_args(["pipeline", command, "--help"])
        lines = capsys.readouterr().out.rstrip().splitlines()
        assert lines[-2] == "example:" and lines[-1].strip().startswith(f"decentral pipeline {command} ")
    args = parser.parse_args(["pipeline", "eval", str(tmp_path)])
    with pytest.raises(NetworkError, match="holds no stage checkpoints"):  # decentral.cli.main: one line, exit 2
        args.func(args)
    args = parser.parse_args(["pipeline", "eval", str(tmp_path / "typo")])
    with pytest.raises(NetworkError, match="typo: no such folder"):
        args.func(args)
    args = parser.parse_args(["pipeline", "train", "--out", str(tmp_path), "--resume"])
    with pytest.raises(NetworkError, match="holds no run to resume"):
        args.func(args)
    with pytest.raises(RecipeError, match="calibrate_at >= 0"):
        parse_pipeline_recipe(tiny_recipe(2, 0.0, 2, pipeline={"calibrate_at": -1}))
    with pytest.raises(RecipeError, match=r"pipeline.skip is the share .* got 1.5"):  # not the loopback network's
        parse_pipeline_recipe(tiny_recipe(2, 1.5, 2))
    with pytest.raises(RecipeError, match="pipeline.nodes 2 cannot hold 3 stages"):
        parse_pipeline_recipe(tiny_recipe(3, 0.0, 2, pipeline={"nodes": 2}))
    with pytest.raises(RecipeError, match="3 stages need at least 3 transformer blocks"):
        parse_pipeline_recipe(tiny_recipe(3, 0.0, 2, model={**MODEL, "n_layer": 2}))
    args = parser.parse_args(["pipeline", "train", "--out", str(tmp_path / "never"), "--drop", "1.5"])
    with pytest.raises(NetworkError, match=r"--drop must be in \[0, 1\)"):  # before any node starts
        args.func(args)
    assert not (tmp_path / "never").exists()
    for bad, says in ((["train", "--steps", "0"], "must be"), (["eval", str(tmp_path), "--draws", "0"], "must be"),
                      (["plan", "n.json", "--effort", "0"], "must be"), (["train", "--latency-ms", "-5"], "must be"),
                      (["train", "--netlab", "garbage"], "not a link rate")):  # a negative latency ran as none; a bad
        with pytest.raises(SystemExit):                                         # rate, after OUT/swarm.key was made
            parser.parse_args(["pipeline", *bad])
        assert says in capsys.readouterr().err, bad


def test_a_copy_of_a_nodes_weights_waits_for_the_update_under_way():
    """A step's update (AdamW's step, and a replica protocol's outer sync: seconds) ran after the step's commit
    point and outside the node's lock: a newcomer copying the stage got some weights before it and some after."""
    recipe = parse_pipeline_recipe(tiny_recipe(2, 0.0, 2))
    node = StageNode("h", make_stage(recipe.recipe.model, 2, 1, 0), recipe, memory=3)
    try:
        with node._cond:
            node._updating = True  # (as `_step` leaves it from its commit point to the end of its update)
        copied = threading.Event()
        copier = threading.Thread(target=lambda: (node._weights({}), copied.set()))
        copier.start()
        assert not copied.wait(0.5)  # it waits for the update
        with node._cond:
            node._updating = False
            node._cond.notify_all()
        assert copied.wait(10)
        copier.join()
    finally:
        node.close()


def test_a_step_command_waiting_while_its_node_stops_is_answered():
    """A step command waited on its task with no end: a task the node dropped, or one queued as it stopped, held
    the gRPC thread for good (and with it the process's exit)."""
    from decentral.pipeline.frames import decode_reply

    recipe = parse_pipeline_recipe(tiny_recipe(2, 0.0, 2))
    node = StageNode("h", make_stage(recipe.recipe.model, 2, 1, 0), recipe, memory=3)  # (its worker not started)
    try:
        replies = []
        waiting = threading.Thread(target=lambda: replies.append(node._step_command({"iteration": 0, "finished": {}})))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive()  # nobody steps it
        node.stopped.set()
        waiting.join(10)
        assert not waiting.is_alive()
        ok, message, _, _ = decode_reply(replies[0])
        assert not ok and "stopping" in message, message
    finally:
        node.close()


def test_a_stage_checkpoint_left_aside_by_a_save_cut_off_is_found_at_its_iteration(tmp_path):
    """A save killed between its two renames leaves the stage's last checkpoint aside (.stage.old), where loading
    finds it: the resume hint read meta.json by hand from the missing folder and called the stage unreadable."""
    from decentral.checkpoint import save_checkpoint
    from decentral.pipeline.launch import stage_checkpoints

    save_checkpoint(tmp_path / "n0" / "stage", {"w": torch.zeros(1)}, {"iteration": 7})
    save_checkpoint(tmp_path / "n1" / "stage", {"w": torch.zeros(1)}, {"iteration": 9})
    (tmp_path / "n1" / "stage").rename(tmp_path / "n1" / ".stage.old")
    assert stage_checkpoints(tmp_path) == {"n0": 7, "n1": 9}
