"""The coordinator of a SkipPipe run: iterations over the live stage servers, re-planned when a node
dies or joins, without losing the microbatches that already finished. It runs inside the lead node.

Each iteration:
1. **Plan.** The live servers (their DHT records, less the incarnations found dead) are the network
   file's nodes that are up, each pinned to the stage it serves. The first plan is `plan`; when the
   set of nodes changes, `replan` (survivors keep their stages, newcomers take theirs).
2. **Begin.** Every node of the plan gets `begin`: the directory (name -> address) and, for heads,
   their microbatches and routes (the plan's paths; with `routing="random"`, each microbatch takes a
   random replica of every stage it visits instead of the planned one, as NoLoCo routes).
3. **Collect.** Heads report `done` when a microbatch's last backward ends; any node reports
   `failed` when a send fails. A node is gone when a send to it is refused or times out, or when a
   probe fails (the nodes on unfinished paths are probed whenever `probe_s` passes without a report).
   Then: re-plan without it, `abort` the unfinished microbatches whose path crosses it on every node
   of that path, and `launch` them again (next attempt) along the new plan's paths. A microbatch whose
   frame is refused (not a death: bad data) is dropped from the iteration.
4. **Step.** When every microbatch is done or dropped, `step` goes to every node with the finished
   (microbatch, attempt) pairs; each node steps its optimizer once, on those microbatches' gradients,
   and replies with the compute times it measured. After iteration `calibrate_at` (counting from 1),
   the network takes those times as its nodes' compute and the next iteration is re-planned: a
   network file's guesses (or a calibration on an idle machine) give way to what the nodes do.

**Terms.** When the lead dies, another head takes over (decentral.pipeline.serve) with a Coordinator of
the next `term`: `take_over` claims the term on every live node (they refuse the old one's commands
from then on, decentral.pipeline.node), finishes the step the dead lead left half-sent (the nodes that
had not stepped it step on the same microbatches: an iteration is stepped everywhere or nowhere) and
says which iteration comes next; the one in flight runs again from its start, its microbatches
numbered from `first_attempt(term)`. A coordinator whose command a node refuses for a newer term
raises `Deposed`.

Every iteration writes a record: loss (mean over the finished microbatches), the measured makespan
(first `begin` received at a head to the last backward end, on the heads' clocks: one machine, or
clocks in sync), the simulated one for the same paths (`predicted_ms`), wall time, and what was lost
and re-sent. The event log gets each iteration's routes (`begin`) and the compute times every node
measured in it (`step`: mean forward, loss and backward, ms).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from decentral.pipeline.discovery import Server
from decentral.pipeline.frames import command_of, decode_reply
from decentral.pipeline.links import CONTROL, Links, is_gone
from decentral.pipeline.network import Network, NetworkError, PipelineError
from decentral.pipeline.planner import Plan, plan, replan, simulated_ms

log = logging.getLogger(__name__)

ATTEMPTS_PER_TERM = 1 << 20  # attempts of a microbatch one lead may make


def first_attempt(term: int) -> int:
    """The first attempt number of the microbatches of a lead of `term`."""
    return term * ATTEMPTS_PER_TERM


def claimed_term(after: int, name: str, names: Sequence[str]) -> int:
    """The term the node `name` claims when it takes over from a lead of term `after`: the first one past it that
    is its own (≡ its index among the network's sorted node `names`, modulo their count). Two heads that both
    found themselves the successor (their DHT views differed) claim two terms, and every node follows the
    higher one, in whatever order the takeovers reach it; with one term for both, each node followed whichever
    came first, and the run had two leads."""
    index = sorted(names).index(name)
    return after + 1 + (index - after - 1) % len(names)


class Deposed(PipelineError):
    """A node follows a newer lead."""


def ping(links: Links, address: str) -> dict | None:
    """The ping reply of the node at `address` ({} for a refusal, which is an answer); None when it is gone."""
    try:
        return decode_reply(links.probe(address, command_of("ping"), links.timeout_s))[2]
    except Exception as e:
        return None if is_gone(e) else {}


@dataclass
class _Microbatch:
    route: tuple[str, ...]
    attempt: int = 0
    done: bool = False
    dropped: bool = False
    loss: float = math.nan
    begun: float = math.nan
    end: float = math.nan

    @property
    def open(self) -> bool:
        return not self.done and not self.dropped


class Coordinator:
    """Runs iterations (module docstring) for the nodes of `network` that `servers()` says are up.

    `links` carries the commands; `address` is the lead node's own (nodes send reports there); `term`:
    the lead's (module docstring).
    `on_event(record)`, when given, sees every begin, death, re-launch and finished microbatch.
    """

    def __init__(self, network: Network, servers: Callable[[], dict[str, Server]], links: Links, address: str, *,
                 seed: int = 0, effort: float = 0.3, routing: str = "planned", probe_s: float = 1.0,
                 stall_s: float = 600.0, step_timeout_s: float = 600.0, calibrate_at: int = 0, term: int = 0,
                 steps: int | None = None, on_event: Callable[[dict], None] | None = None):
        self.network, self.servers, self.links, self.address = network, servers, links, address
        self.steps = steps  # the run's iterations, which the nodes' LR schedule spans (None: their train.steps)
        self.term = term
        self.seed, self.effort, self.routing = seed, effort, routing
        self.probe_s, self.stall_s, self.step_timeout_s = probe_s, stall_s, step_timeout_s
        self.calibrate_at = calibrate_at
        self._calibrated = False  # the network's compute changed since the plan was made
        self.on_event = on_event or (lambda record: None)
        self.plan: Plan | None = None
        self.dead: dict[str, str] = {}  # name -> the incarnation found dead (a restart comes back with another)
        self._reports: queue.Queue = queue.Queue()
        self._live: dict[str, Server] = {}
        self._seen: dict[str, Server] = {}  # every server announced while we lead: `stop_all` reaches them all
        self._current: Network | None = None

    def on_report(self, body: dict) -> None:
        """A node's report (any thread)."""
        self._reports.put(body)

    # ----- membership -----
    def live_servers(self) -> dict[str, Server]:
        """Servers up now that the network names, less those found dead (unless restarted since)."""
        found = {}
        for name, server in self.servers().items():
            self._seen[name] = server
            if self.dead.get(name) == server.incarnation or name not in {n.name for n in self.network.nodes}:
                continue
            found[name] = server
        return found

    def wait_for_servers(self, timeout_s: float, poll_s: float = 0.2) -> dict[str, Server]:
        """Wait until every node of the network is up; after `timeout_s`, go on with those that are up
        when they hold every stage, else PipelineError."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = self.live_servers()
            if len(live) == len(self.network.nodes):
                return live
            if time.monotonic() > deadline:
                stages = {server.stage for server in live.values()}
                if stages >= set(range(self.network.stages)):
                    return live
                raise PipelineError(f"after {timeout_s:.0f}s no node serves stage(s) "
                                    f"{sorted(set(range(self.network.stages)) - stages)}")
            time.sleep(poll_s)  # polling the DHT view, which renews itself in the background

    def _network_of(self, live: dict[str, Server]) -> Network:
        """The network's nodes that are up, each pinned to the stage it serves."""
        absent = [node.name for node in self.network.nodes if node.name not in live]
        if len(absent) == len(self.network.nodes):
            raise PipelineError("no stage server is up")
        network = self.network.without(absent)
        for server in live.values():
            if not 0 <= server.stage < network.stages:
                raise PipelineError(f"{server.name} serves stage {server.stage}, the pipeline has {network.stages}")
        return replace(network, nodes=tuple(replace(node, stage=live[node.name].stage) for node in network.nodes))

    # ----- one iteration -----
    def run_iteration(self, iteration: int, save: bool = False, last: bool = False) -> dict:
        """Run `iteration` (module docstring) and return its record; `save` asks the nodes for checkpoints,
        `last` tells them it is the run's last (a node that loses its lead after it leaves as done)."""
        started = time.monotonic()
        self._live = self.live_servers()
        # a node found dead that is up again (a new incarnation: restarted) is one of the live ones again
        self.dead = {name: incarnation for name, incarnation in self.dead.items() if name not in self._live}
        network = self._network_of(self._live)
        replanned = self._plan_for(network, iteration)
        self._current = network
        base = first_attempt(self.term)
        state = {m: _Microbatch(self._route(path, iteration, m, base), base) for m, path in enumerate(self.plan.paths)}
        predicted = simulated_ms(network, [[network.index(name) for name in s.route] for s in state.values()])
        lost: list[str] = []
        self.on_event({"event": "begin", "iteration": iteration, "routes": [list(s.route) for s in state.values()],
                       "predicted_ms": predicted})
        directory = {name: self._live[name].address for name in self.plan.nodes}
        launches: dict[str, list] = {}
        for m, s in state.items():
            launches.setdefault(s.route[0], []).append([m, s.attempt, list(s.route)])
        replies = self._command_all(self.plan.nodes, "begin", lambda name: {
            "iteration": iteration, "coordinator": self.address, "directory": directory,
            "launches": launches.get(name, [])})
        self._lose([name for name, reply in replies.items() if reply is None], iteration, state, lost)
        self._collect(iteration, state, lost)
        finished = {str(m): s.attempt for m, s in state.items() if s.done}
        done = [s for s in state.values() if s.done]
        loss = float(np.mean([s.loss for s in done])) if done else math.nan
        step_started = time.monotonic()
        live_nodes = [name for name in self.plan.nodes if name not in self.dead]
        replies = self._command_all(live_nodes, "step", lambda name: {"iteration": iteration, "finished": finished,
                                                                       "loss": loss, "save": save, "last": last,
                                                                       "steps": self.steps},
                                    timeout_s=self.step_timeout_s)
        self._lose([name for name, reply in replies.items() if reply is None], iteration, {}, lost)
        compute = {name: reply["compute_ms"] for name, reply in replies.items() if reply and reply.get("compute_ms")}
        self.on_event({"event": "step", "iteration": iteration, "compute_ms": compute})
        if iteration + 1 == self.calibrate_at and compute:
            self.network, self._calibrated = self.network.with_measured_compute(compute), True
            log.info("iteration %d: re-planning with the compute the nodes measured", iteration)
        end = time.monotonic()
        return {"iteration": iteration, "loss": loss,
                "microbatches": len(done), "dropped": sum(s.dropped for s in state.values()),
                "relaunched": sum(s.attempt - base for s in state.values()), "dead": lost,
                "replanned": replanned or bool(lost), "nodes": len(self.plan.nodes),
                "makespan_ms": 1e3 * max(s.end - s.begun for s in done) if done else math.nan,  # (each on its head's
                # clock: from the begin's arrival; the heads' clocks, on other machines, have nothing in common)
                "predicted_ms": predicted, "step_ms": 1e3 * (end - step_started), "wall_ms": 1e3 * (end - started),
                "sync": [reply["sync"] for reply in replies.values() if reply and "sync" in reply]}

    def _plan_for(self, network: Network, iteration: int) -> bool:
        """Plan (first iteration) or re-plan (when the nodes or their compute changed); True when it re-planned."""
        names = {node.name for node in network.nodes}
        try:
            if self.plan is None:
                self.plan = plan(network, seed=self.seed, effort=self.effort)
                return False
            if set(self.plan.nodes) == names and not self._calibrated:
                return False
            self.plan = replan(self.plan, network, seed=self.seed + iteration, effort=self.effort)
            self._calibrated = False
        except NetworkError as e:
            raise PipelineError(f"iteration {iteration}: cannot plan the live nodes {sorted(names)}: {e}") from None
        return True

    def _route(self, path: tuple[int, ...], iteration: int, m: int, attempt: int) -> tuple[str, ...]:
        """Node names of `path`; with random routing, a random replica of each stage past the head."""
        names = [self.plan.nodes[n] for n in path]
        if self.routing == "random":
            rng = np.random.default_rng([self.seed, iteration, m, attempt])
            names = names[:1] + [self.plan.nodes[int(rng.choice(self.plan.members(self.plan.stage_of[n])))]
                                 for n in path[1:]]
        return tuple(names)

    def _collect(self, iteration: int, state: dict[int, _Microbatch], lost: list[str]) -> None:
        """Take reports until no microbatch is open."""
        progress = time.monotonic()
        while any(s.open for s in state.values()):
            try:
                report = self._reports.get(timeout=self.probe_s)
            except queue.Empty:
                self._lose(self._probe(state), iteration, state, lost)
                if time.monotonic() - progress > self.stall_s:
                    stuck = [m for m, s in state.items() if s.open]
                    log.warning("iteration %d: no progress for %.0fs; stepping without microbatches %s",
                                iteration, self.stall_s, stuck)
                    self._drop(iteration, state, stuck)
                continue
            if report.get("iteration") != iteration:
                continue
            m, attempt = report.get("microbatch"), report.get("attempt")
            s = state.get(m)
            if report.get("kind") == "done":
                if s is not None and s.open and attempt == s.attempt:
                    s.done, s.loss = True, float(report["loss"])
                    s.begun, s.end = float(report["begun"]), float(report["end"])
                    progress = time.monotonic()
                    self.on_event({"event": "done", "iteration": iteration, "microbatch": m, "attempt": attempt})
            elif report.get("gone"):
                self._lose([str(report.get("node"))], iteration, state, lost)
                progress = time.monotonic()
            elif s is not None and s.open and attempt == s.attempt:
                log.warning("iteration %d: dropping microbatch %s: %s", iteration, m, report.get("error"))
                self._drop(iteration, state, [m])

    def _drop(self, iteration: int, state: dict[int, _Microbatch], microbatches: Iterable[int]) -> None:
        for m in microbatches:
            state[m].dropped = True
            self._abort(iteration, state[m], m)

    def _abort(self, iteration: int, s: _Microbatch, m: int) -> None:
        for name in s.route:
            if name not in self.dead:
                self.links.post(self._live[name].address, CONTROL, command_of(
                    "abort", {"term": self.term, "iteration": iteration, "keys": [[m, s.attempt]]}))

    def _lose(self, names: Iterable[str], iteration: int, state: dict[int, _Microbatch], lost: list[str]) -> None:
        """Mark `names` dead, re-plan without them, abort and re-launch the open microbatches they were on."""
        new = sorted({n for n in names if n in self._live and n not in self.dead})
        if not new:
            return
        for name in new:
            self.dead[name] = self._live[name].incarnation
            self.on_event({"event": "dead", "iteration": iteration, "node": name})
            log.warning("iteration %d: node %s is gone; re-planning without it", iteration, name)
        lost.extend(new)
        self._current = self._current.without([n for n in new if n in {x.name for x in self._current.nodes}])
        try:
            self.plan = replan(self.plan, self._current, seed=self.seed + iteration, effort=self.effort)
        except NetworkError as e:
            raise PipelineError(f"iteration {iteration}: lost {', '.join(new)} and cannot go on: {e}") from None
        for m, s in state.items():
            if s.open and set(s.route) & set(new):
                self._abort(iteration, s, m)
                s.attempt += 1
                s.route = self._route(self.plan.paths[m], iteration, m, s.attempt)
                self.on_event({"event": "relaunch", "iteration": iteration, "microbatch": m, "attempt": s.attempt,
                               "route": list(s.route)})
                launch = {"term": self.term, "iteration": iteration, "launches": [[m, s.attempt, list(s.route)]]}
                self.links.post(self._live[s.route[0]].address, CONTROL, command_of("launch", launch),
                                self._gone_reporter(s.route[0], iteration))

    def _gone_reporter(self, name: str, iteration: int):
        def done(reply, error):
            if error is not None and is_gone(error):
                self.on_report({"kind": "failed", "iteration": iteration, "node": name, "gone": True})
        return done

    def _probe(self, state: dict[int, _Microbatch]) -> list[str]:
        """The nodes on open microbatches' paths that do not answer a ping; Deposed when one follows a
        newer lead (its reports go there: we were only slow)."""
        names = sorted({n for s in state.values() if s.open for n in s.route if n not in self.dead})
        with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
            replies = dict(zip(names, pool.map(lambda name: ping(self.links, self._live[name].address), names)))
        newer = [name for name, reply in replies.items() if reply and reply.get("term", 0) > self.term]
        if newer:
            raise Deposed(f"another head leads now: {newer[0]} follows term {replies[newer[0]]['term']}")
        return [name for name, reply in replies.items() if reply is None]

    def _command_all(self, names: Iterable[str], kind: str, body: Callable[[str], dict],
                     timeout_s: float | None = None) -> dict[str, dict | None]:
        """Send `kind` (with our term) to every node of `names` at once; their reply bodies, None for those
        gone. Deposed when one follows a newer lead."""
        names = list(names)
        replies: dict[str, dict | None] = {}
        newer: list[str] = []
        finished = threading.Condition()

        def done_for(name: str):
            def done(reply, error):
                with finished:
                    if error is not None:
                        if not is_gone(error):
                            log.warning("%s refused %s: %s", name, kind, error)
                        replies[name] = None if is_gone(error) else {}
                    else:
                        try:
                            ok, message, reply_body, _ = decode_reply(reply)
                            term = reply_body.get("term", -1)
                            if not ok and isinstance(term, int) and term > self.term:
                                newer.append(message)
                            elif not ok:
                                log.warning("%s: %s", name, message)
                            replies[name] = reply_body if ok else {}
                        except (AttributeError, TypeError, ValueError) as e:  # (frames.FrameError is one)
                            log.warning("%s: a reply to %s that cannot be read: %r", name, kind, e)
                            replies[name] = {}  # (no answer in it; left unset, the wait below never ended)
                    finished.notify_all()
            return done

        for name in names:
            self.links.post(self._live[name].address, CONTROL, command_of(kind, {**body(name), "term": self.term}),
                            done_for(name), timeout_s)
        with finished:
            finished.wait_for(lambda: len(replies) == len(names))
        if newer:
            raise Deposed(f"another head leads now: {newer[0]}")
        return replies

    def take_over(self, gone: str | None) -> tuple[int, dict | None]:
        """Lead from now on, as a lead of `self.term` after the one at address `gone` (None: any) died
        (module docstring). Returns the iteration to run next and the last step the nodes took (its
        command: iteration, finished, loss, steps, save, last), None before the first; the nodes that missed
        it take it now, as it was sent."""
        self.dead.update({name: server.incarnation for name, server in self.servers().items()
                          if server.address == gone})
        self._live = self.live_servers()
        replies = self._command_all(self._live, "takeover", lambda name: {"coordinator": self.address})
        states = {name: reply for name, reply in replies.items() if reply and "done" in reply}
        self.dead.update({name: self._live[name].incarnation for name in self._live if name not in states})
        if not states:
            raise PipelineError("no stage server answers")
        done = max(state["done"] for state in states.values())
        last = next((state["last_step"] for state in states.values()
                     if state["done"] == done and (state["last_step"] or {}).get("iteration") == done - 1), None)
        behind = [name for name, state in states.items() if state["open"] == done - 1 and state["done"] < done]
        if last is not None and behind:
            log.warning("the lead died stepping iteration %d; %s step it now", done - 1, ", ".join(behind))
            self._command_all(behind, "step", lambda name: last, timeout_s=self.step_timeout_s)  # (saving, ending)
        return done, last

    def stop_all(self) -> None:
        """Tell every other node announced now or at any time we led to leave (those found dead too: a
        lead we took over from may only have been slow; a node whose DHT record lapsed is still told)."""
        self._live = {**self._seen, **self.servers()}
        self._command_all([name for name, server in self._live.items() if server.address != self.address], "stop",
                          lambda name: {}, timeout_s=10.0)
