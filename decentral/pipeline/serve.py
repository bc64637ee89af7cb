"""`decentral pipeline node`: one node of a SkipPipe pipeline, as a process.

It joins the swarm's DHT (a SwarmPeer of run `swarm.run`, with the swarm key when given: then its
gRPC calls are signed with it too, decentral.pipeline.auth), builds its stage of the reference GPT
(every replica of a stage starts from the same seeded weights, and a node that finds a live replica
of its stage copies that replica's weights first), wraps the inner AdamW in the recipe's sync
protocol for the stage's replicas (a swarm group of run `{swarm.run}-stage{s}`; `local`: none),
serves the stage over gRPC and announces itself (decentral.pipeline.discovery).

The lead node (a head; `--lead`) also runs the coordinator: it waits for the network's nodes, runs
`--steps` iterations, writes OUT/metrics.jsonl (a record per iteration) and OUT/events.jsonl
(begins, deaths, re-launches, finished microbatches), and stops the others at the end. Every node
writes its stage's checkpoint (weights, AdamW, replica protocol) to OUT/stage every
`train.eval_every` iterations and at the end. With `resume`, each node starts from its checkpoint
and the lead from the iteration of its own, keeping the records up to it: microbatches and the LR
depend only on the iteration, so a resumed run trains on what the first would have.

Every other node probes the lead (the address its last `begin`, or a newer lead's takeover, came from) every
second. When the lead is gone (a refused or timed-out ping), the successor is the head (stage 0) with the lowest
name that is announced in the DHT and answers a ping: every node finds the same one, with no election (where views
differ and two heads take over, each claims a term of its own past the one it followed, `claimed_term`, and the
nodes follow the higher: the other stands by; a head whose node follows another's takeover by the time it has found
itself the successor follows that one). The successor takes over (Coordinator.take_over) and leads from the
iteration the nodes last stepped to `--steps` (give every head the same); its metrics.jsonl begins with that last
step's record (`recovered`: its loss and microbatches), and the iteration in flight runs again. When no head is
left (none has been in view for a record's lifetime, RECORD_TTL_S: a view may miss a live head's record for a
moment), every node says so in one line and exits 2: the stage checkpoints stay, for `resume` (a node that stepped
the run's last iteration and then finds its lead gone leaves as done, exit 0). A lead that finds the nodes
following a newer term (it was only slow) stands by as a head. A node leaves when told to, or when no command came
for `idle_s` seconds.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from decentral.checkpoint import checkpoint_present, sole_writer
from decentral.data.corpus import load_corpus
from decentral.metrics import MetricsLog, keep_records_until
from decentral.pipeline.auth import CallKey
from decentral.pipeline.coordinator import Coordinator, Deposed, claimed_term, ping
from decentral.pipeline.discovery import RECORD_TTL_S, Announcer, ServerView, lookup_servers, new_server
from decentral.pipeline.network import Network, PipelineError
from decentral.pipeline.node import StageNode
from decentral.pipeline.recipe import PipelineRecipe
from decentral.pipeline.stages import make_stage
from decentral.swarm.admission import SwarmKey
from decentral.swarm.peer import SwarmPeer
from decentral.swarm.reach import warn_if_unreachable

log = logging.getLogger(__name__)


@dataclass
class NodeOptions:
    name: str
    recipe: PipelineRecipe
    network: Network  # every node that may take part (the recipe's shape); the lead plans over it
    out: Path
    stage: int | None = None  # default: the stage the network pins this node to
    host: str = "127.0.0.1"  # where the gRPC server and the DHT node listen
    port: int = 0  # the gRPC server's port
    dht_port: int = 0
    announce_host: str | None = None  # the address others reach us at, when `host` is 0.0.0.0
    join: Sequence[str] = ()
    swarm_key: SwarmKey | None = None
    lead: bool = False
    steps: int | None = None  # iterations (heads: the lead, or a head taking over); default train.steps
    data: Sequence[str] | None = None  # training text (heads); None = the Python standard library
    maddr_file: Path | None = None  # where to write our DHT multiaddrs, for others to --join
    resume: bool = False  # start from OUT/stage (and the lead from its iteration)
    wait_s: float = 300.0  # the lead waits this long for the network's nodes
    idle_s: float = 600.0  # a node leaves after this long without a command
    print_fn: Callable[[str], None] = print


def run_node(opts: NodeOptions) -> int:
    """Run one node until the run ends (see the module docstring); returns an exit code."""
    torch.set_num_threads(1)
    network = opts.network
    entry = next((node for node in network.nodes if node.name == opts.name), None)
    if entry is None:
        raise PipelineError(f"{network.source} has no node named {opts.name!r}")
    index = opts.stage if opts.stage is not None else entry.stage
    if index is None:
        raise PipelineError(f"{opts.name}: give --stage, or pin the node to a stage in {network.source}")
    if opts.lead and index != 0:
        raise PipelineError(f"{opts.name}: the lead must be a head (stage 0), it holds stage {index}")
    if opts.host == "0.0.0.0" and not opts.announce_host:
        raise PipelineError("listening on 0.0.0.0 needs --announce-host (the address others reach us at)")
    opts.out.mkdir(parents=True, exist_ok=True)
    with sole_writer(opts.out):  # two nodes given one --out would share its identity (one peer id) and checkpoint
        return _run_stage(opts, entry, index)


def _run_stage(opts: NodeOptions, entry, index: int) -> int:
    """`run_node` once its options are checked and it alone writes to its --out."""
    recipe = opts.recipe
    tokens = load_corpus(opts.data).train if index == 0 else None
    swarm = recipe.recipe.swarm
    peer = SwarmPeer(swarm.run, opts.join, host=opts.host, port=opts.dht_port,  # --announce-host is gRPC's, and
                     announce_host=opts.announce_host if opts.dht_port else None,  # the DHT's with a fixed port
                     identity_path=opts.out / "identity.key", swarm_key=opts.swarm_key)
    closers: list[Callable[[], None]] = [peer.shutdown]
    try:
        warn_if_unreachable(peer, opts.join)
        if opts.maddr_file:
            opts.maddr_file.write_text("\n".join(peer.multiaddrs()) + "\n")
        stage = make_stage(recipe.recipe.model, recipe.pipeline.stages, index, recipe.recipe.train.seed,
                           recipe.recipe.model_source, recipe.recipe.train.context)
        node = StageNode(opts.name, stage, recipe, memory=entry.memory, host=opts.host, port=opts.port,
                         tokens=tokens, shared_uplink=entry.uplink_mbps is not None,
                         key=CallKey(opts.swarm_key) if opts.swarm_key else None,
                         make_protocol=_protocol_maker(opts, peer, index), out=opts.out)
        closers.insert(0, node.close)
        if opts.resume:
            opts.print_fn(f"[{opts.name}] resumes stage {index} at iteration {node.restore()}")
        else:
            saved = checkpoint_present(opts.out / "stage")  # a new run would write over it (the lead: its records too)
            source = None if saved and opts.lead else node.copy_replica(lookup_servers(peer).values())
            if source:  # (a node joining a live run takes its stage from it)
                opts.print_fn(f"[{opts.name}] copied stage {index}'s weights from {source}")
            elif saved:
                raise PipelineError(f"{opts.out / 'stage'} holds an earlier run's checkpoint"
                                    f"{'' if opts.lead else f' and no live node serves stage {index} to copy'}: "
                                    "--resume goes on from it; to start over, remove it or give another --out")
        if index == 0:  # the lead's records past its checkpoint are redone (a new run: none is kept)
            keep_records_until(opts.out / "metrics.jsonl", node.iterations_done or -1)
        node.start()
        address = f"{opts.announce_host or opts.host}:{node.address.rsplit(':', 1)[1]}"
        announcer = Announcer(peer, new_server(opts.name, address, index))
        closers.insert(0, announcer.close)
        opts.print_fn(f"[{opts.name}] stage {index} at {address}")
        return _serve(node, peer, address, opts, closers)
    finally:
        for close in closers:
            try:
                close()
            except Exception as e:
                log.debug("closing %s: %s", close, e)


def _protocol_maker(opts: NodeOptions, peer: SwarmPeer, index: int):
    """How the stage's replicas stay in sync: the recipe's protocol over a swarm group of this stage."""
    recipe = opts.recipe.recipe
    if recipe.protocol == "local":
        return None

    def make(stage, optimizer):
        from decentral.swarm import SwarmTransport
        from decentral.sync import PROTOCOLS

        s = recipe.swarm
        transport = SwarmTransport(f"{s.run}-stage{index}", peer.multiaddrs(), host=opts.host,
                                   announce_host=opts.announce_host, timeout=s.timeout, codec=s.codec,
                                   max_norm_ratio=s.max_norm_ratio, aggregation=s.aggregation,
                                   hang_s=s.hang_s, heartbeat_s=s.heartbeat_s, identity_path=str(opts.out / "stage-identity.key"),
                                   swarm_key=opts.swarm_key)
        return PROTOCOLS[recipe.protocol](stage, optimizer, transport, **recipe.protocol_args)

    return make


def _serve(node: StageNode, peer: SwarmPeer, address: str, opts: NodeOptions, closers: list) -> int:
    """Lead (with `--lead`), else follow the lead and take over from it when it is gone and we are its
    successor (module docstring); the exit code."""
    views: list[ServerView] = []

    def view() -> ServerView:
        if not views:
            views.append(ServerView(peer))
            closers.insert(0, views[0].close)
        return views[0]

    lead, gone, followed, headless_since = opts.lead, None, 0, None
    while True:
        if lead:
            try:
                return _lead(node, view(), address, opts, closers, gone, followed)
            except Deposed as e:
                opts.print_fn(f"[{opts.name}] stands by: {e}")
                node.coordinator, lead = None, False
        if node.stopped.wait(1.0):
            return 0
        if time.monotonic() - node.last_command > opts.idle_s:
            opts.print_fn(f"[{opts.name}] no command for {opts.idle_s:.0f}s; leaving")
            return 1
        followed = node.term  # (read before the ping: the term of the lead found gone, or older)
        gone = _lead_gone(node)
        if gone is None:
            headless_since = None
            continue
        if node.ended:  # the lead's stop did not reach us
            opts.print_fn(f"[{opts.name}] the run ended at iteration {node.iterations_done}; its lead is gone; leaving")
            return 0
        successor = _successor(node, view(), gone, address)
        if successor is None:
            headless_since = headless_since or time.monotonic()
            if time.monotonic() - headless_since < RECORD_TTL_S:
                continue
            opts.print_fn(f"[{opts.name}] the lead ({gone}) is gone and no head is left to take over; leaving "
                          f"(checkpoint: {opts.out / 'stage'}, iteration {node.iterations_done})")
            return 2
        headless_since = None
        lead = successor == opts.name and node.lead_address() == gone  # (not when another head's takeover came first)


def _lead_gone(node: StageNode) -> str | None:
    """The address of the lead we follow when it no longer answers; None while it does (or before any)."""
    lead = node.lead_address()
    return lead if lead and ping(node.links, lead) is None else None


def _successor(node: StageNode, view: ServerView, gone: str, address: str) -> str | None:
    """The head with the lowest name that is announced, is not at `gone` and answers; None when none does.
    A head at `address` counts itself whatever the view says: the DHT nodes that hold its record may be the
    lead's, gone with it (a view without it left the run with no lead while this head answered)."""
    heads = {(s.name, s.address) for s in view.get().values() if s.stage == 0 and s.address != gone}
    if node.stage.index == 0:
        heads.add((node.name, address))
    return next((name for name, at in sorted(heads) if ping(node.links, at) is not None), None)


def _lead(node: StageNode, view: ServerView, address: str, opts: NodeOptions, closers: list,
          gone: str | None = None, followed: int = 0) -> int:
    """Coordinate the run to `--steps`: from the start (or the resumed checkpoint), or, when the lead at
    address `gone`, of term `followed`, died, from where it left off. Deposed when another head leads."""
    recipe = opts.recipe
    train, config = recipe.recipe.train, recipe.pipeline
    first = node.iterations_done  # 0, or the resumed checkpoint's
    steps = opts.steps or train.steps
    metrics = MetricsLog(opts.out / "metrics.jsonl")
    events = open(opts.out / "events.jsonl", "a" if first or gone else "w", encoding="utf-8")
    closers.extend([metrics.close, events.close])

    def on_event(record: dict) -> None:
        events.write(json.dumps(record) + "\n")
        events.flush()

    coordinator = Coordinator(opts.network, view.get, node.links, address, seed=train.seed, effort=config.effort,
                              routing=config.routing, calibrate_at=config.calibrate_at,
                              term=claimed_term(followed, opts.name, [n.name for n in opts.network.nodes]) if gone
                              else node.term, steps=steps, on_event=on_event)
    node.coordinator = coordinator
    if gone:
        first, stepped = coordinator.take_over(gone)
        on_event({"event": "takeover", "term": coordinator.term, "iteration": first, "gone": gone})
        if stepped is not None:
            metrics.write(worker=opts.name, step=first, loss=stepped["loss"], microbatches=len(stepped["finished"]),
                          recovered=True)
        opts.print_fn(f"[{opts.name}] the lead ({gone}) is gone; leading from iteration {first + 1} "
                      f"(term {coordinator.term})")
    else:
        live = coordinator.wait_for_servers(opts.wait_s)
        opts.print_fn(f"[{opts.name}] leading {len(live)} nodes: " + ", ".join(
            f"{name} (stage {server.stage})" for name, server in sorted(live.items())))
    start = time.perf_counter()
    deposed = False
    try:
        for iteration in range(first, steps):
            last = iteration + 1 == steps
            record = coordinator.run_iteration(iteration, save=last or (iteration + 1) % train.eval_every == 0,
                                               last=last)
            metrics.write(worker=opts.name, step=iteration + 1, wall_s=time.perf_counter() - start,
                          **{**record, "dead": ",".join(record["dead"]), "sync": None,
                             "sync_wait_s": max((s["wait_s"] for s in record["sync"]), default=None)})
            if last or iteration % train.eval_every == 0 or record["dead"] or record["replanned"]:
                opts.print_fn(_progress(opts.name, record))
    except Deposed:
        deposed = True
        raise
    finally:
        if not deposed:
            coordinator.stop_all()
    return 0


def _progress(name: str, record: dict) -> str:
    line = (f"[{name}] iteration {record['iteration'] + 1} loss {record['loss']:.3f} microbatches "
            f"{record['microbatches']} makespan {record['makespan_ms'] / 1e3:.2f} s "
            f"wall {record['wall_ms'] / 1e3:.2f} s")
    if record["replanned"]:
        line += " re-planned"
    if record["dead"]:
        line += f"; lost {', '.join(record['dead'])}, re-sent {record['relaunched']} microbatches"
    return line
