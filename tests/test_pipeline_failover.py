"""Lead failover in the SkipPipe runtime: when the lead dies, another head takes over, the iteration in
flight runs again, no node steps an iteration twice or skips one, and a replaced lead is refused."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import yaml

from decentral.checkpoint import load_checkpoint
from decentral.data.corpus import load_corpus
from decentral.pipeline.coordinator import Coordinator, Deposed, claimed_term
from decentral.pipeline.evaluate import load_run
from decentral.pipeline.frames import reply_of
from decentral.pipeline.launch import run_metrics
from decentral.pipeline.recipe import load_pipeline_recipe, parse_pipeline_recipe
from decentral.pipeline.discovery import RECORD_TTL_S, Announcer, ServerView, new_server
from decentral.pipeline import serve as serve_module
from decentral.pipeline.serve import NodeOptions, _serve, _successor
from decentral.swarm.admission import SwarmKey
from decentral.swarm.peer import SwarmPeer
from test_pipeline_runtime import InProcessPipeline, pinned_network, tiny_recipe


def test_a_new_lead_finishes_the_step_its_predecessor_left_half_sent_and_the_old_lead_is_refused(small_corpus):
    """The lead steps iteration 1 on h but not on a (it died sending the step); a coordinator of the next
    term takes over: a steps iteration 1 on the same microbatches, the old coordinator's next command is
    refused (Deposed) before any node steps, and after iteration 2 every weight and AdamW state equals
    a run without the failure (same microbatches, each iteration stepped once everywhere)."""
    recipe = parse_pipeline_recipe(tiny_recipe(2, 0.0, 2))
    tokens = load_corpus([small_corpus]).train
    reference = InProcessPipeline(recipe, {"h": 0, "a": 1}, tokens)
    failing = InProcessPipeline(recipe, {"h": 0, "a": 1}, tokens)
    try:
        for i in range(3):
            reference.coordinator.run_iteration(i)
        old = failing.coordinator
        old.run_iteration(0)
        send = old._command_all

        def dies_while_stepping(names, kind, body, timeout_s=None):
            return send([n for n in names if kind != "step" or n != "a"], kind, body, timeout_s)

        old._command_all = dies_while_stepping
        old.run_iteration(1)
        h, a = failing.nodes["h"], failing.nodes["a"]
        assert (h.iterations_done, a.iterations_done) == (2, 1)
        new = Coordinator(old.network, lambda: dict(failing.servers), h.links, h.address,
                          seed=recipe.recipe.train.seed, term=1)
        h.coordinator = new
        first, last = new.take_over(None)
        assert first == 2 and last["iteration"] == 1 and sorted(last["finished"]) == ["0", "1"]
        assert (h.iterations_done, a.iterations_done, h.term, a.term) == (2, 2, 1, 1)
        old._command_all = send
        with pytest.raises(Deposed, match="follows the lead of term 1"):
            old.run_iteration(2)
        assert (h.iterations_done, a.iterations_done) == (2, 2)
        record = new.run_iteration(2)
        assert record["microbatches"] == 2 and record["relaunched"] == 0
        for name in ("h", "a"):
            ours, theirs = failing.nodes[name], reference.nodes[name]
            expected = theirs.stage.global_state_dict()
            assert all(torch.allclose(v, expected[k], atol=1e-6) for k, v in ours.stage.global_state_dict().items())
            steps = {int(s["step"]) for s in ours.optimizer.state_dict()["state"].values()}
            assert steps == {3}, (name, steps)
    finally:
        reference.close()
        failing.close()


def test_a_new_lead_has_the_nodes_behind_save_and_end_as_the_step_they_missed_asked(tmp_path, small_corpus):
    """The lead died sending the run's last step, a saving one, to a: the new lead re-sent it to a with
    `save: False` and without `last`, so a's checkpoint stayed an iteration behind h's (a resume met a pipeline
    of two iterations) and a did not know the run had ended."""
    recipe = parse_pipeline_recipe(tiny_recipe(2, 0.0, 2))
    pipeline = InProcessPipeline(recipe, {"h": 0, "a": 1}, load_corpus([small_corpus]).train)
    try:
        h, a = pipeline.nodes["h"], pipeline.nodes["a"]
        h.out, a.out = tmp_path / "h", tmp_path / "a"
        old = pipeline.coordinator
        old.run_iteration(0, save=True)
        send = old._command_all
        old._command_all = lambda names, kind, body, timeout_s=None: send(
            [n for n in names if kind != "step" or n != "a"], kind, body, timeout_s)
        old.run_iteration(1, save=True, last=True)
        assert (h.iterations_done, a.iterations_done, h.ended, a.ended) == (2, 1, True, False)
        new = Coordinator(old.network, lambda: dict(pipeline.servers), h.links, h.address,
                          seed=recipe.recipe.train.seed, term=1)
        h.coordinator = new
        assert new.take_over(None)[0] == 2
        assert a.iterations_done == 2 and a.ended
        assert [load_checkpoint(node.out / "stage")[1]["iteration"] for node in (h, a)] == [2, 2]
    finally:
        pipeline.close()


@pytest.mark.parametrize("first", ["h1", "h2"])
def test_two_heads_that_both_take_over_claim_two_terms_and_the_higher_leads_alone(first, small_corpus):
    """The lead h0 is gone and the views of h1 and h2 differ, so each takes over: both claimed term 1, and each
    node followed whichever takeover reached it first (two leads, whose steps both went through). Each now
    claims a term of its own: in either order h2's is the higher and h2 leads (h1's microbatches report to it,
    not to h1's own coordinator, which has not learnt it is deposed) and h1's next command is refused."""
    recipe = parse_pipeline_recipe(tiny_recipe(2, 0.0, 2))
    stage_of = {"h0": 0, "h1": 0, "h2": 0, "a": 1}
    pipeline = InProcessPipeline(recipe, stage_of, load_corpus([small_corpus]).train)
    try:
        pipeline.coordinator.run_iteration(0)
        pipeline.nodes["h0"].close()
        del pipeline.servers["h0"]
        heads, followed = {}, pipeline.nodes["h1"].term  # both find h0 gone at once: the term they followed
        for name in (first, *({"h1", "h2"} - {first})):
            node = pipeline.nodes[name]
            heads[name] = Coordinator(pipeline.coordinator.network, lambda: dict(pipeline.servers), node.links,
                                      node.address, seed=recipe.recipe.train.seed,
                                      term=claimed_term(followed, name, list(stage_of)))
            node.coordinator = heads[name]
            try:
                heads[name].take_over(None)
            except Deposed:
                assert name == "h1"  # it came second
        assert heads["h2"].term > heads["h1"].term > 0
        assert heads["h2"].run_iteration(1)["microbatches"] == 2
        with pytest.raises(Deposed):
            heads["h1"].run_iteration(2)
        assert {name: node.term for name, node in pipeline.nodes.items() if name != "h0"} == dict.fromkeys(
            ("h1", "h2", "a"), heads["h2"].term)
        assert {node.iterations_done for name, node in pipeline.nodes.items() if name != "h0"} == {2}
    finally:
        pipeline.close()


def test_a_head_whose_node_follows_another_takeover_by_the_time_it_found_itself_successor_follows_it(
        tmp_path, small_corpus, monkeypatch):
    """h1 finds the lead h0 gone and, while it pings the heads to find the successor, h2's takeover reaches h1's
    node (h1's DHT view lacks h2's record, so h1 finds itself the successor). h1 took over too, with a term past
    h2's, deposing the lead that had already taken over (the iteration in flight ran a third time). It now
    follows h2: it never leads, steps the iteration h2 runs, and leaves when h2 stops the run."""
    recipe = parse_pipeline_recipe(tiny_recipe(2, 0.0, 2))
    stage_of = {"h0": 0, "h1": 0, "h2": 0, "a": 1}
    pipeline = InProcessPipeline(recipe, stage_of, load_corpus([small_corpus]).train)
    peer = SwarmPeer(f"t{time.monotonic_ns()}")  # (h1's view of the DHT: the successor search is replaced)
    closers: list = []
    try:
        pipeline.coordinator.run_iteration(0)
        pipeline.nodes["h0"].close()
        del pipeline.servers["h0"]
        h1, h2 = pipeline.nodes["h1"], pipeline.nodes["h2"]
        lead_of_h2 = Coordinator(pipeline.coordinator.network, lambda: dict(pipeline.servers), h2.links, h2.address,
                                 seed=recipe.recipe.train.seed, term=claimed_term(h2.term, "h2", list(stage_of)))
        h2.coordinator = lead_of_h2
        searched, led = threading.Event(), []

        def h2_takes_over_meanwhile(node, view, gone, address):
            lead_of_h2.take_over(gone)
            searched.set()
            return "h1"

        monkeypatch.setattr(serve_module, "_successor", h2_takes_over_meanwhile)
        monkeypatch.setattr(serve_module, "_lead", lambda *args: led.append(args) or 0)
        said: list[str] = []
        opts = NodeOptions("h1", recipe, pipeline.coordinator.network, tmp_path, print_fn=said.append)
        code: list[int] = []
        serving = threading.Thread(target=lambda: code.append(_serve(h1, peer, h1.address, opts, closers)),
                                   daemon=True)
        serving.start()
        assert searched.wait(60), "h1 never found its lead gone"
        assert h1.lead_address() == h2.address and h1.term == lead_of_h2.term
        assert lead_of_h2.run_iteration(1, last=True)["microbatches"] == 2
        lead_of_h2.stop_all()
        serving.join(60)
        assert code == [0] and led == [], said
        assert h1.iterations_done == 2 and pipeline.nodes["a"].iterations_done == 2
    finally:
        for close in closers:
            close()
        peer.shutdown()
        pipeline.close()


def test_a_head_claims_the_first_term_past_the_last_that_is_its_own():
    names = ["b", "a", "c"]  # sorted: a owns 0, 3, 6, ...; b 1, 4, ...; c 2, 5, ...
    assert [claimed_term(after, "a", names) for after in (0, 1, 2, 3)] == [3, 3, 3, 6]
    assert [claimed_term(after, "b", names) for after in (0, 1, 2, 3)] == [1, 4, 4, 4]
    assert [claimed_term(after, "c", names) for after in (0, 1, 2, 3)] == [2, 2, 5, 5]


@pytest.mark.parametrize("reply", [b"\xff\xff", reply_of(False, "refused", body={"term": "7"})],
                         ids=["no reply frame", "a term that is no integer"])
def test_a_reply_the_new_lead_cannot_read_counts_its_node_out_instead_of_waiting_for_it(reply, small_corpus):
    """A node of another build answered the takeover with a reply the lead could not read: the callback raised,
    the reply was never recorded, and the lead waited for it for good."""
    recipe = parse_pipeline_recipe(tiny_recipe(2, 0.0, 2))
    pipeline = InProcessPipeline(recipe, {"h": 0, "a": 1, "a2": 1}, load_corpus([small_corpus]).train)
    try:
        pipeline.coordinator.run_iteration(0)
        pipeline.nodes["a2"]._takeover = lambda body: reply
        h = pipeline.nodes["h"]
        new = Coordinator(pipeline.coordinator.network, lambda: dict(pipeline.servers), h.links, h.address,
                          seed=recipe.recipe.train.seed, term=1)
        h.coordinator = new
        took: list = []
        taking = threading.Thread(target=lambda: took.append(new.take_over(None)), daemon=True)  # (waits for good
        taking.start()  # where the reply is left unread: the test must end)
        taking.join(timeout=60)
        assert [first for first, _ in took] == [1]
        assert "a2" in new.dead and "a" not in new.dead
        assert new.run_iteration(1)["microbatches"] == 2
    finally:
        pipeline.close()


def test_a_node_that_stepped_the_last_iteration_leaves_as_done_when_its_lead_is_gone(tmp_path, small_corpus):
    """The lead's stop does not reach a node (its lead ended the run and left): a node that stepped the
    run's last iteration finds its lead gone and leaves with 0, without looking for a successor (a node
    that did not would look for one, and with no head left exit 2)."""
    recipe = parse_pipeline_recipe(tiny_recipe(2, 0.0, 2))
    pipeline = InProcessPipeline(recipe, {"h": 0, "a": 1}, load_corpus([small_corpus]).train)
    try:
        a = pipeline.nodes["a"]
        pipeline.coordinator.run_iteration(0)
        assert not a.ended
        pipeline.coordinator.run_iteration(1, last=True)
        assert a.ended and a.iterations_done == 2
        pipeline.nodes["h"].close()
        said: list[str] = []
        opts = NodeOptions("a", recipe, pipeline.coordinator.network, tmp_path, print_fn=said.append)
        assert _serve(a, None, a.address, opts, []) == 0  # no DHT peer: a successor search would fail
        assert said == ["[a] the run ended at iteration 2; its lead is gone; leaving"]
    finally:
        pipeline.close()


def test_the_live_nodes_records_stay_in_view_while_a_dht_member_is_frozen():
    """A frozen DHT member (SIGSTOP) makes every store wait out its RPC timeout, twice: renewals that waited
    for the one before (and for lookups, under one lock) let the live nodes' records lapse on every node for
    about 2 s, 7 s into the freeze (the view read []: a head found no head left, the slow-lead test below in
    loaded suites). Watched for 11 s from the freeze, the two live nodes never leave the view."""
    peers = [SwarmPeer(f"t{time.monotonic_ns()}")]
    peers += [SwarmPeer(peers[0].run, peers[0].multiaddrs()) for _ in range(2)]
    announcers = [Announcer(peer, new_server(f"n{i}", f"127.0.0.1:{1000 + i}", 0)) for i, peer in enumerate(peers)]
    view = ServerView(peers[1])
    try:
        while sorted(view.get()) != ["n0", "n1", "n2"]:
            time.sleep(0.1)  # polling the view until every record is in
        os.kill(peers[0].dht.pid, signal.SIGSTOP)
        frozen, lapses = time.monotonic(), []
        while time.monotonic() < frozen + 11:
            seen = set(view.get())
            if not {"n1", "n2"} <= seen:
                lapses.append((round(time.monotonic() - frozen, 1), sorted(seen)))
            time.sleep(0.1)  # sampling the view through the freeze
        assert not lapses, lapses
    finally:
        os.kill(peers[0].dht.pid, signal.SIGCONT)
        view.close()
        for announcer in announcers:
            announcer.close()
        for peer in peers:
            peer.shutdown()


def test_a_head_counts_itself_a_successor_when_the_dht_view_lacks_its_record(small_corpus):
    """The DHT nodes holding the heads' records may be the lead's, gone with it: a head that found the lead gone
    names itself its successor even when the view it reads lacks its own record (it said no head was left and
    exited 2 while it answered itself: the slow-lead test below, once in a loaded suite). A node of another
    stage has only the view to go by."""
    recipe = parse_pipeline_recipe(tiny_recipe(2, 0.0, 2))
    pipeline = InProcessPipeline(recipe, {"h0": 0, "h1": 0, "a": 1}, load_corpus([small_corpus]).train)
    peer = SwarmPeer(f"t{time.monotonic_ns()}")  # a DHT where no server announced itself
    view = ServerView(peer)
    try:
        h0, h1, a = (pipeline.nodes[name] for name in ("h0", "h1", "a"))
        h0.close()
        assert view.get() == {}
        assert _successor(h1, view, h0.address, h1.address) == "h1"
        assert _successor(a, view, h0.address, a.address) is None
    finally:
        view.close()
        peer.shutdown()
        pipeline.close()


def test_a_node_whose_lead_is_gone_leaves_only_once_no_head_was_in_view_for_a_records_lifetime(tmp_path, small_corpus):
    """A view may miss a live head's record for a moment (its renewal late under load): a node that finds its lead
    gone and no head in view looks again for RECORD_TTL_S before it says none is left and exits 2 (it left at
    once). Here the head h1 is announced 1.5 s after the lead h0 closed: a stays past that wait, following h1."""
    recipe = parse_pipeline_recipe(tiny_recipe(2, 0.0, 2))
    pipeline = InProcessPipeline(recipe, {"h0": 0, "h1": 0, "a": 1}, load_corpus([small_corpus]).train)
    dht = SwarmPeer(f"t{time.monotonic_ns()}")
    member = SwarmPeer(dht.run, dht.multiaddrs())
    said: list[str] = []
    announcer = None
    try:
        h0, h1, a = (pipeline.nodes[name] for name in ("h0", "h1", "a"))
        pipeline.coordinator.run_iteration(0)  # a follows h0
        h0.close()
        closed = time.monotonic()
        opts = NodeOptions("a", recipe, pipeline.coordinator.network, tmp_path, print_fn=said.append)
        with ThreadPoolExecutor(1) as pool:
            serving = pool.submit(_serve, a, dht, a.address, opts, [])
            time.sleep(1.5)  # no head in view for a while
            assert not serving.done(), said
            announcer = Announcer(member, new_server("h1", h1.address, 0))
            while time.monotonic() < closed + RECORD_TTL_S + 3 and not serving.done():
                time.sleep(0.1)  # past the wait for a head: a node that found none would have returned 2 by now
            assert not serving.done(), said
            a.stopped.set()  # (as the new lead's stop would)
            assert serving.result(timeout=10) == 0, said
        assert not [line for line in said if "no head is left" in line], said
    finally:
        if announcer:
            announcer.close()
        member.shutdown()
        dht.shutdown()
        pipeline.close()


def test_a_head_takes_over_when_the_lead_is_killed_and_the_run_finishes(tmp_path, small_corpus, local_pipeline):
    """Three `decentral pipeline node` processes (heads h0, h1; a serves stage 1) with a swarm key; the
    lead h0 is SIGKILLed mid-run. h1 (the live head with the lowest name) takes over and runs to
    --steps: every iteration is in the metrics once (h0's, then h1's from the last step the nodes took),
    each with every microbatch, the loss keeps falling, a's AdamW stepped exactly --steps times, and
    every process but the killed one ends with 0."""
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(tiny_recipe(2, 0.0, 4, train={"eval_every": 4})))
    recipe = load_pipeline_recipe(recipe_path)
    network = pinned_network(recipe, {"h0": 0, "h1": 0, "a": 1})
    SwarmKey.generate(tmp_path / "swarm.key")
    out, steps = tmp_path / "run", 14
    with local_pipeline(recipe_path, network, out, steps=steps,
                        node_args=["--data", str(small_corpus), "--swarm-key", str(tmp_path / "swarm.key")],
                        env={"DECENTRAL_LINK_LATENCY_MS": "30"}) as run:
        run.start()
        assert run.lead == "h0"
        metrics = out / "h0" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not metrics.exists() or metrics.read_text().count("\n") < 4:
            assert time.monotonic() < deadline and run.procs["h0"].poll() is None, run.log("h0")
            time.sleep(0.01)  # polling the lead's metrics
        run.kill("h0")
        assert run.wait(120) == 0, run.log("h1")
        assert run.lead == "h1"
        assert {name: proc.returncode for name, proc in run.procs.items()} == {"h0": -9, "h1": 0, "a": 0}
    before = [json.loads(line) for line in metrics.read_text().splitlines()]
    after = [json.loads(line) for line in (out / "h1" / "metrics.jsonl").read_text().splitlines()]
    took_over = after[0]
    assert took_over["recovered"] and took_over["step"] in (len(before), len(before) + 1)  # the last step taken
    assert [r["step"] for r in after] == list(range(took_over["step"], steps + 1))
    records = run_metrics(out)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["microbatches"] == 4 for r in records)
    assert sum(r["loss"] for r in records[-2:]) / 2 < records[0]["loss"] - 0.3
    assert "the lead (127.0.0.1:" in run.log("h1") and "leading from iteration" in run.log("h1")
    takeover = [json.loads(line) for line in (out / "h1" / "events.jsonl").read_text().splitlines()
                if '"takeover"' in line]
    term = claimed_term(0, "h1", [node.name for node in network.nodes])  # (2: h1 is second of a, h0, h1)
    assert [(e["term"], e["iteration"]) for e in takeover] == [(term, took_over["step"])]
    for name in ("h1", "a"):
        tensors, meta = load_checkpoint(out / name / "stage")
        assert meta["iteration"] == steps
    tensors, _ = load_checkpoint(out / "a" / "stage")
    assert {int(v) for k, v in tensors.items() if k.startswith("inner.") and k.endswith(".step")} == {steps}
    model, _ = load_run(out)  # stage 0 from h1, which trained to the end, not from the killed h0
    head, _ = load_checkpoint(out / "h1" / "stage")
    ours = model.state_dict()
    assert all(torch.equal(ours[k[len("model."):]], v) for k, v in head.items() if k.startswith("model."))


def test_a_lead_that_was_only_slow_is_refused_and_stands_by(tmp_path, small_corpus, local_pipeline):
    """The lead h0 is frozen (SIGSTOP) mid-iteration: after the link timeout the others count it gone and
    h1 takes over. Thawed (SIGCONT), h0 finds the nodes following h1's term and stands by without stepping
    anyone: every iteration is stepped once (a's AdamW steps == --steps) and h1 stops h0 at the end."""
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(tiny_recipe(2, 0.0, 2, pipeline={"link_timeout": 4.0})))
    recipe = load_pipeline_recipe(recipe_path)
    network = pinned_network(recipe, {"h0": 0, "h1": 0, "a": 1})
    out, steps = tmp_path / "run", 24
    with local_pipeline(recipe_path, network, out, steps=steps, node_args=["--data", str(small_corpus)],
                        env={"DECENTRAL_LINK_LATENCY_MS": "30"}) as run:
        run.start()

        def wait_for_records(path, count):
            deadline = time.monotonic() + 120
            while not path.exists() or path.read_text().count("\n") < count:
                assert time.monotonic() < deadline and run.procs["h1"].poll() is None, run.log("h1")
                time.sleep(0.01)  # polling a lead's metrics

        wait_for_records(out / "h0" / "metrics.jsonl", 3)
        run.procs["h0"].send_signal(signal.SIGSTOP)
        wait_for_records(out / "h1" / "metrics.jsonl", 2)
        run.procs["h0"].send_signal(signal.SIGCONT)
        assert run.wait(120) == 0, run.log("h1")
        assert {name: proc.returncode for name, proc in run.procs.items()} == {"h0": 0, "h1": 0, "a": 0}, \
            "\n".join(f"--- {name}\n{run.log(name)}" for name in run.procs)
    assert "stands by: another head leads now" in run.log("h0"), run.log("h0")
    took_over = json.loads((out / "h1" / "metrics.jsonl").read_text().splitlines()[0])["step"]
    assert max(json.loads(line)["step"] for line in (out / "h0" / "metrics.jsonl").read_text().splitlines()) \
        <= took_over
    assert [r["step"] for r in run_metrics(out)] == list(range(1, steps + 1))
    tensors, meta = load_checkpoint(out / "a" / "stage")
    assert meta["iteration"] == steps
    assert {int(v) for k, v in tensors.items() if k.startswith("inner.") and k.endswith(".step")} == {steps}
