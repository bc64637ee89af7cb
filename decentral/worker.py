"""The reference worker: one swarm member training a model (the reference GPT, or a Hugging Face causal LM:
decentral.models.build_model) on local text with a protocol.

Built on the library API: the protocol hooks the inner optimizer; this loop is a plain loop.
Writes `metrics.jsonl` (a record per inner step; `val_loss` every `eval_every` steps; the sync's
group on steps that synced; its numbers also as TensorBoard scalars with `tensorboard`) and a checkpoint every
`eval_every` steps and at the end. It stops cleanly: on divergence the last good checkpoint stays on disk; on
Ctrl-C (or the caller's `stop`) it saves the state it reached, once it trained a step.

Data is one corpus (`data`), or several domains (`domains`) mixed in balanced batches and validated on
each domain's dev split. A run may start from another model (`init_from`: weights, inner optimizer state
and step, so the LR schedule continues) and stop early (`stop_at`); checkpoints record the lineage (the
start model's hash, the step it started at, tokens seen) that expert folders carry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from decentral.checkpoint import (
    CheckpointError, checkpoint_present, load_checkpoint, load_training_state, model_tensors, read_checkpoint_meta,
    save_checkpoint, sole_writer, training_state,
)
from decentral.codec import make_codec
from decentral.config import Recipe, RecipeError, protocol_params, recipe_differences
from decentral.cpu import children_record, cpu_record, peak_rss_mib
from decentral.data.batches import eval_batches, evaluate, train_batches
from decentral.data.corpus import DataError, load_corpus
from decentral.data.domains import balanced_eval_batches, load_domains
from decentral.device import island_backend, pick_device
from decentral.experts.branch import StartPoint, load_start_point, model_differences
from decentral.experts.registry import RegistryError
from decentral.island import IslandError
from decentral.metrics import MetricsLog, TensorBoardSink, counters_reached, keep_records_until
from decentral.models import GPT_SOURCE, build_model, describe_model
from decentral.swarm import SwarmError, SwarmTransport
from decentral.swarm.admission import SwarmKey
from decentral.swarm.monitor import StatusCard
from decentral.swarm.reach import warn_if_unreachable
from decentral.sync import PROTOCOLS, DivergedError, SyncProtocol, SyncReport
from decentral.transport import SoloTransport, Transport


IDENTITY_FILE = "identity.key"  # in OUT: a restarted worker keeps its peer id
HELD_SHOWN_S = 0.5  # a progress line names the member whose part held the last average up by this long or more
# torch's RNG belongs to the process: workers in threads of one process (`bench sweep`, tests) seed it
# and build their models one at a time, so every worker starts from the recipe seed's weights
_SEEDED_BUILD = threading.Lock()


@dataclass
class WorkerOptions:
    out: Path
    join: Sequence[str] = ()
    data: Sequence[str] | None = None  # text files or folders; None = the Python standard library
    worker_index: int | None = None  # which shard of the data; None = derived from the peer id
    num_workers: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    announce_host: str | None = None
    resume: bool = False
    island: str | None = None  # torch.distributed init method (tcp://HOST:PORT, env://) of our fast island
    island_mode: str | None = None  # leader / sharded: the island trains as one member of the swarm
    # (decentral.hierarchy); None: the island is the whole run, its ranks the protocol's members
    rank: int = 0
    world_size: int = 1
    local_rank: int | None = None  # our rank on this machine (which GPU); None: `rank`
    local_world_size: int | None = None  # ranks of our island on this machine; None: `world_size`
    domains: Sequence[str] | None = None  # NAME or NAME=PATH (decentral.data.domains): balanced batches
    init_from: Path | None = None  # a checkpoint or expert folder to start from (ignored when resuming)
    stop_at: int | None = None  # stop at this inner step; the LR schedule still spans train.steps
    stop_at_from: str = "--stop-at"  # what set stop_at, named when it is not past the step the run starts from
    min_peers: int = 1  # wait until this many peers (us included) announced our first round before training
    wait_peers_s: float = 300.0
    name: str = "worker"
    tensorboard: Path | None = None  # also write the metrics as TensorBoard scalars into this folder
    on_ready: Callable[[list[str]], None] | None = None  # gets our multiaddrs once we have joined
    print_fn: Callable[[str], None] = print
    notes: Sequence[str] = ()  # said on stderr ("note: ...") once the run's own checks have passed
    transport: Transport | None = None  # given, the worker uses it (and closes it) instead of making one
    stop: threading.Event | None = None  # set, the run stops before its next step as Ctrl-C stops it (a worker
    # in a thread, which no signal reaches: `bench sweep`'s)


def inner_lr(step: int, recipe: Recipe, steps: int | None = None) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio at the last step (NoLoCo's inner schedule) of a
    schedule of `steps` (default: train.steps; a pipeline's lead says its run's)."""
    t = recipe.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, (steps or t.steps) - t.warmup_steps))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _save(protocol: SyncProtocol, opts: WorkerOptions, recipe: Recipe, lineage: dict) -> None:
    """OUT/checkpoint: the training state, and a model with files of its own (`write_files`: a Hugging Face
    model's save_pretrained layout) in them beside it instead of in the training state."""
    model = protocol.model
    files = model.write_files  # None for the reference GPT
    tensors, meta = training_state({} if files else model.state_dict(), protocol.optimizer, protocol.state_dict())
    tokens = lineage["start_tokens"] + (protocol.step - lineage["start_step"]) * recipe.train.batch_size * recipe.train.context
    meta.update(recipe=recipe.to_dict(), lineage={**lineage, "tokens": tokens}, data=_data_of(opts))
    save_checkpoint(opts.out / "checkpoint", tensors, meta, files=files)


def _check_stop_at_past(opts: WorkerOptions, source, step: int, error: type[Exception]) -> None:
    """`error` when `opts.stop_at` is not past `step`, the step that `source` (a checkpoint, a start point) is at:
    nothing would train. It names what set the stop (`opts.stop_at_from`)."""
    if opts.stop_at is not None and opts.stop_at <= step:
        raise error(f"the run stops at step {opts.stop_at} ({opts.stop_at_from}), and {source} is at step {step}: "
                    f"nothing would train; stop past step {step}")


def _check_left_to_train(path: Path, steps: int, opts: WorkerOptions) -> None:
    """CheckpointError when the checkpoint at `path`, which --resume goes on from, is at the run's last step
    (`opts.stop_at`, else the schedule's `steps`) or past it: nothing would train (only its meta is read here)."""
    sync = read_checkpoint_meta(path).get("sync")
    step = sync.get("step") if isinstance(sync, dict) else None
    if not isinstance(step, int):
        return  # metadata that does not fit: _restore says so
    _check_stop_at_past(opts, path, step, CheckpointError)
    if steps <= step:
        raise CheckpointError(f"{path} is at step {step}, {'the end' if step == steps else 'past the end'} of a "
                              f"{steps}-step schedule (train.steps): nothing would train; to train on, give --steps past "
                              f"{step} (the whole schedule's length)")


def _restore(protocol: SyncProtocol, opts: WorkerOptions, transport: Transport, recipe: Recipe) -> dict:
    """Load OUT/checkpoint into the protocol, its model and inner optimizer; returns the run's lineage.
    In an island every rank takes its leader's checkpoint (a rank killed between two saves holds an older
    one, and the island's replicas must be identical). A note says which settings (`recipe` is the run's) and
    which data differ from the checkpoint's: the run goes on with its own."""
    read = protocol.model.read_files  # the inverse of _save's `write_files`; None for the reference GPT
    files = (lambda folder: {f"model.{k}": v for k, v in read(folder).items()}) if read else None
    path = opts.out / "checkpoint"
    state = load_checkpoint(path, files) if not opts.island_mode or opts.rank == 0 else None
    tensors, meta = transport.from_leader(state) if opts.island_mode else state
    found = {k: v.shape for k, v in model_tensors(tensors).items()}
    if found != {k: v.shape for k, v in protocol.model.state_dict().items()}:
        theirs = meta.get("recipe", {}).get("model")
        source = theirs.get("source") if isinstance(theirs, dict) else None
        how = f"--model {source}" if source not in (None, GPT_SOURCE) else "the model it was written with"
        raise CheckpointError(f"{path} holds another model than this run's (its recipe's model: {theirs}); resume "
                              f"with {how}")
    saved = meta["sync"].get("protocol") if isinstance(meta.get("sync"), dict) else None
    if saved is not None and saved != protocol.name:
        raise CheckpointError(f"{path} is a {saved} run's checkpoint, this run is {protocol.name}: resume it with "
                              f"--protocol {saved}, or train into another --out")
    try:
        model, sync = load_training_state(tensors, meta, protocol.optimizer)
        protocol.model.load_state_dict(model)
        protocol.load_state_dict(sync)
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # (metadata another version wrote)
        raise CheckpointError(f"{path}: its metadata does not fit this run ({type(e).__name__}: {e}); resume with the "
                              "recipe it was written with") from None
    theirs, data = meta.get("recipe"), meta.get("data")
    differ = [recipe_differences(theirs, recipe.to_dict())] if isinstance(theirs, dict) else []
    if isinstance(data, dict) and data != _data_of(opts):  # (a checkpoint written before `data` was kept: none)
        differ.append(f"trained on {_data_said(data)} there, {_data_said(_data_of(opts))} here")
    if any(differ) and opts.rank == 0:
        print(f"note: {path} was trained with other settings ({'; '.join(d for d in differ if d)}): the run goes on "
              "with this run's; give the checkpoint's recipe, --set, --data and --domain to go on as it was",
              file=sys.stderr, flush=True)
    return meta.get("lineage", {"parent": None, "start_step": 0, "start_tokens": 0})


def _data_of(opts: WorkerOptions) -> dict:
    """What the run trains on, as its checkpoint keeps it."""
    return {"domains": list(opts.domains or []), "data": [str(Path(p).resolve()) for p in opts.data or []]}


def _data_said(data: dict) -> str:
    """`_data_of`'s record as the option that gives it."""
    if data.get("domains"):
        return "--domain " + ",".join(map(str, data["domains"]))
    return "--data " + ",".join(map(str, data["data"])) if data.get("data") else "the standard library"


def _start_from(start: StartPoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer, recipe: Recipe,
                opts: WorkerOptions) -> None:
    """Load a start point's weights (and inner optimizer state, when it has one: else the worker says so) into a
    fresh model of the same description (decentral.models.describe_model)."""
    ours = describe_model(model)
    if start.model_config != ours:
        raise RegistryError(f"--init-from {start.source}: its model differs from the recipe's ({recipe.model_source}): "
                            f"{model_differences(start.model_config, ours)}")
    model.load_state_dict(start.model)
    if start.optimizer is not None:
        optimizer.load_state_dict(start.optimizer)
    else:
        opts.print_fn(f"[{opts.name}] the start, {start.source}, holds no inner optimizer state "
                      f"({start.no_optimizer}): AdamW starts fresh at step {start.step}")


def make_transport(recipe: Recipe, opts: WorkerOptions, device: torch.device) -> Transport:
    """`opts.transport` when given; no network for `local`; a torch.distributed island when `opts.island`
    is set (recipe island.backend, see `island_backend`), joined to the
    swarm as one member when `opts.island_mode` is; else the swarm."""
    s = recipe.swarm
    if opts.transport is not None:
        return opts.transport
    if recipe.protocol == "local":
        return SoloTransport()
    if not opts.island:
        return _swarm_connection(recipe, opts, s.run, opts.join, opts.port)
    from decentral.island import IslandTransport

    backend = island_backend(recipe.island.backend, device, opts.local_world_size or opts.world_size)
    island = IslandTransport(opts.island, opts.rank, opts.world_size, backend=backend, timeout=s.timeout)
    if opts.island_mode is None:
        return island
    from decentral.hierarchy import HierarchicalTransport, shard_run

    def connect(rank: int, leader_addrs: list[str]) -> Transport:
        return _swarm_connection(recipe, opts, shard_run(s.run, rank), [*opts.join, *leader_addrs],
                                 opts.port + rank if opts.port else 0)

    return HierarchicalTransport(island, connect, mode=opts.island_mode,
                                 timeout_s=opts.wait_peers_s + 10 * s.timeout)


def _swarm_connection(recipe: Recipe, opts: WorkerOptions, run: str, join: Sequence[str], port: int) -> Transport:
    """Our swarm peer. Joining through `join` and seeing no live member of `run`, it looks whether the run's
    records are there but do not open with our key (or without one): AdmissionError then, not a run alone."""
    s = recipe.swarm
    key = SwarmKey.load(s.key_file) if s.key_file else None
    transport = SwarmTransport(
        run, join, host=opts.host, port=port, announce_host=opts.announce_host,
        timeout=s.timeout, codec=s.codec, max_norm_ratio=s.max_norm_ratio, aggregation=s.aggregation,
        hang_s=s.hang_s, heartbeat_s=s.heartbeat_s, identity_path=str(opts.out / IDENTITY_FILE), swarm_key=key,
    )
    if join and set(transport.progress()) == {transport.peer_id}:
        try:
            _check_admitted(run, join, key, transport.peer_id)
        except BaseException:
            transport.close()
            raise
    warn_if_unreachable(transport.peer, join)
    return transport


def _check_admitted(run: str, join: Sequence[str], key: SwarmKey | None, us: str) -> None:
    """AdmissionError when `run`'s records are in the swarm but none but ours (`us`) opens with `key` (or without
    one)."""
    from decentral.swarm.monitor import SwarmMonitor

    try:
        monitor = SwarmMonitor(run, join, swarm_key=key)
    except SwarmError:
        return  # nobody answers any more: nothing to tell
    try:
        monitor.rows(leave_out=frozenset([us]))
    finally:
        monitor.close()


def run_worker(recipe: Recipe, opts: WorkerOptions) -> dict:
    """Train until `recipe.train.steps` (or `opts.stop_at`) inner steps; returns a summary dict.

    In an island joined to the swarm (`opts.island_mode`), every rank runs this with its own `rank`; rank r > 0
    writes to OUT/rankR. The ranks' gradients are all-reduced every step (DistributedDataParallel), and
    each rank reads its own data shard.

    Raises DivergedError, DataError (bad data), RegistryError (a bad start point), IslandError (a rank of
    our island failed: the island left the swarm)."""
    torch.set_num_threads(1)
    t = recipe.train
    if opts.island_mode and opts.rank > 0:
        opts = dataclasses.replace(opts, out=opts.out / f"rank{opts.rank}", name=f"{opts.name}.rank{opts.rank}",
                                   tensorboard=opts.tensorboard and opts.tensorboard / f"rank{opts.rank}")
    slot = opts.local_rank if opts.local_rank is not None else opts.rank
    device = pick_device(t.device, slot if opts.island else (opts.worker_index or 0))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL collectives run on the current device
    if opts.data and opts.domains:
        raise DataError("give either --data (one corpus) or --domain (balanced domains), not both")
    recipe.check_context()  # a branch's model is its parent's, set after the recipe was read
    domains = load_domains(opts.domains) if opts.domains else None
    corpus = None if domains else load_corpus(opts.data)
    if opts.stop_at is not None and opts.stop_at > t.steps:
        raise RecipeError(f"--stop-at {opts.stop_at} is past the end of the {t.steps}-step schedule (train.steps): "
                          f"give --steps {opts.stop_at} or more, or an earlier --stop-at")
    own_checkpoint = opts.resume and not (opts.island_mode and opts.rank > 0)  # (those take their leader's)
    if own_checkpoint and not opts.out.is_dir():
        raise CheckpointError(f"--resume: no run to resume in {opts.out} (the folder does not exist)")
    start = load_start_point(opts.init_from) if opts.init_from and not opts.resume else None
    if start is not None:
        _check_stop_at_past(opts, start.source, start.step, RegistryError)
        if start.step >= t.steps:
            raise RegistryError(f"the start point, {start.source}, is at step {start.step}, "
                                f"{'the end' if start.step == t.steps else 'past the end'} of a {t.steps}-step "
                                "schedule: nothing would train; give more --steps (the schedule's total, the start "
                                "point's steps included)")
    opts.out.mkdir(parents=True, exist_ok=True)  # once the run's inputs are known to be good
    with sole_writer(opts.out):  # (before reading its checkpoint: a live run's is not ours to judge)
        if own_checkpoint:
            _check_left_to_train(opts.out / "checkpoint", t.steps, opts)
        if not opts.resume and checkpoint_present(opts.out / "checkpoint"):
            raise CheckpointError(f"{opts.out / 'checkpoint'} holds an earlier run: --resume goes on from it; to "
                                  "start over, remove it or give another --out")
        with _SEEDED_BUILD:
            torch.manual_seed(t.seed)
            model = build_model(recipe.model_source, recipe.model, t.context).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
        lineage = {"parent": None, "start_step": 0, "start_tokens": 0}
        if start is not None:
            _start_from(start, model, optimizer, recipe, opts)
            lineage = {"parent": start.parent, "start_step": start.step, "start_tokens": start.tokens}
        transport = make_transport(recipe, opts, device)
        try:
            net = model
            if opts.island_mode:
                from torch.nn.parallel import DistributedDataParallel

                net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
            protocol = PROTOCOLS[recipe.protocol](model, optimizer, transport, **recipe.protocol_args)
            protocol.join_timeout_s = recipe.swarm.timeout  # as long as one average may take
            protocol.step = lineage["start_step"]
            if opts.resume:
                lineage = _restore(protocol, opts, transport, recipe)
            index = opts.worker_index
            if index is None:  # a stranger joining: its own random windows over all the data
                index = int(hashlib.sha256(transport.peer_id.encode()).hexdigest()[:8], 16)
            shards = opts.num_workers
            if opts.island_mode:  # each rank of an island its own shard
                index, shards = index * opts.world_size + opts.rank, shards * opts.world_size
            shard = (index % shards, shards)
            sizes = dict(batch_size=t.batch_size, context=t.context, device=device)
            streams = [d.train for d in domains] if domains else corpus.train

            def batches_from(step: int):
                return train_batches(streams, worker=shard[0], num_workers=shard[1], seed=t.seed + index, skip=step,
                                     **sizes)

            if domains:
                val = balanced_eval_batches(domains, "dev", num_batches=t.eval_batches, **sizes)
            else:
                val = eval_batches(corpus.val, num_batches=t.eval_batches, **sizes)
            return _train(protocol, recipe, opts, batches_from, val, transport, lineage, net)
        finally:
            transport.close()


@contextlib.contextmanager
def _island_failures(opts: WorkerOptions):
    """A collective of our island's gradient all-reduce that failed (a rank died: its connections closed)
    as an IslandError; anything else as it is."""
    try:
        yield
    except RuntimeError as e:
        if not opts.island_mode:
            raise
        raise IslandError(f"the island's gradient all-reduce failed, a rank is gone: {str(e).splitlines()[0]}") from e


def _wait_for_peers(transport: Transport, opts: WorkerOptions, protocol: SyncProtocol) -> None:
    """Wait for `--min-peers` ready for our first round, then join any that came rounds ahead (`catch_up`)."""
    if opts.min_peers > 1:
        opts.print_fn(f"[{opts.name}] waiting for {opts.min_peers} peers")
        transport.wait_for_peers(opts.min_peers, opts.wait_peers_s, protocol.first_round)
        protocol.catch_up()


LOCAL_SETTINGS = ("outer_on_device",)  # protocol settings that are each member's own: where it keeps outer state


def _swarm_setup(recipe: Recipe, opts: WorkerOptions) -> dict:
    """How this member averages, which every member of a run must share (besides the model, whose size is checked
    on the state a newcomer takes), under the recipe's names: the protocol and its settings but LOCAL_SETTINGS
    (`protocol.every`: members of two round lengths would average different rounds' progress; the outer step's:
    replicas meant to stay identical would part at a round's end, and be repaired), the codec
    averages travel in (`swarm.codec`: each member refuses parts in another) and the shards its vector is cut
    into (`island.shards`: a sharded island's ranks each average one; a single process or an island in leader
    mode averages the whole vector)."""
    settings = {**protocol_params(recipe.protocol), **recipe.protocol_args}
    return {"protocol": recipe.protocol,
            **{f"protocol.{k}": v for k, v in sorted(settings.items()) if k not in LOCAL_SETTINGS},
            "swarm.codec": make_codec(recipe.swarm.codec).spec,
            "island.shards": opts.world_size if opts.island_mode == "sharded" else 1}


def _check_same_setup(transport: Transport, ours: dict, run: str) -> None:
    """SwarmError naming each setting in which a member of the swarm (its heartbeat's `setup` card field) averages
    otherwise than `ours` (`_swarm_setup`). A setting a member's card does not name (an older member's) is not
    compared."""
    for peer, card in transport.progress().items():
        theirs = card.get("setup")
        if not isinstance(theirs, dict):
            continue
        differ = [f"{key} {theirs[key]} there, {value} here" for key, value in ours.items()
                  if key in theirs and theirs[key] != value]
        if differ:
            raise SwarmError(f"member {card.get('name') or peer[-8:]} of run {run!r} averages otherwise than this peer "
                             f"({'; '.join(differ)}): the members of a run use one protocol with the same settings "
                             f"(but {', '.join(LOCAL_SETTINGS)}) and codec, and either all are islands sharded over "
                             "the same number of ranks or none is (--island-mode leader mixes islands of any size "
                             "with single processes)")


def _check_finite(what: str, value: float, step: int) -> float:
    """`value`; DivergedError when it is not finite (then nothing of this state is saved or sent)."""
    if not math.isfinite(value):
        raise DivergedError(f"the {what} is {value} at inner step {step}: training diverged (a learning rate too "
                            "high?); not saving or sending this state")
    return value


def counters(protocol: SyncProtocol, transport: Transport, wall_s: float, carried: dict[str, float]) -> dict:
    """The run's cumulative counters (metrics.CUMULATIVE_FIELDS): bytes, seconds of training and of waiting,
    each on from what a resumed run's earlier records reached (`carried`; {} for a run that starts)."""
    now = dict(bytes_sent=transport.bytes_sent, bytes_received=transport.bytes_received, wall_s=wall_s,
               wait_s=protocol.wait_s)
    return {k: v + carried.get(k, 0) for k, v in now.items()}


def step_record(name: str, protocol: SyncProtocol, transport: Transport, loss: torch.Tensor, wall_s: float,
                carried: dict[str, float]) -> tuple[dict, SyncReport | None]:
    """The metrics record of the inner step just done, and the sync report it popped (None when the step
    did not sync): the worker's per-step bookkeeping (`decentral bench overhead` times it)."""
    record = dict(worker=name, step=protocol.step, round=protocol.round, loss=loss.item(),
                  **counters(protocol, transport, wall_s, carried), **cpu_record())
    report = protocol.pop_report()
    if report is not None:
        record.update(group_size=len(report.group), complete=report.complete,
                      contributors=report.contributors, rejected=len(report.rejected))
        if report.spread is not None:
            record["spread"] = report.spread
        if report.digest is not None:
            record["digest"] = report.digest[:16]
        if report.repaired:
            record["repaired"] = True
        if report.held_by is not None:
            record.update(held_by=member_name(transport, report.held_by[0], name), held_s=round(report.held_by[1], 3))
    return record, report


def member_name(transport: Transport, peer: str, own_name: str) -> str:
    """The name `peer` goes by in its heartbeat's card (`own_name` for us), else the end of its id."""
    if peer == transport.peer_id:
        return own_name
    name = transport.progress(max_age_s=float("inf")).get(peer, {}).get("name")
    return name if isinstance(name, str) and name else peer[-8:]


def _left_alone(protocol: SyncProtocol, previous: SyncReport | None, report: SyncReport) -> bool:
    """Whether this sync is the first with nobody else after one with others, in a protocol whose groups are
    every live member (so a group of one means the swarm has nobody else for now)."""
    return protocol.identical_replicas and previous is not None and len(previous.group) > 1 and len(report.group) == 1


def _alone_from_the_start(opts: WorkerOptions, transport: Transport, previous: SyncReport | None,
                          report: SyncReport) -> bool:
    """Whether this is our first sync, with nobody else, though we joined a swarm (`--join`) and see no other
    member of our run: the peers we joined through run another --run (swarm.run), or none of ours is up."""
    return (previous is None and bool(opts.join) and not opts.island_mode and len(report.group) == 1
            and set(transport.progress(max_age_s=60.0)) <= {transport.peer_id})


def _progress_line(name: str, protocol: SyncProtocol, record: dict, sync: SyncReport | None,
                   transport: Transport) -> str:
    """The line a worker prints after each evaluation: where it is, and what its latest sync did (a member that
    held that average up by `HELD_SHOWN_S` or more beyond the others is named)."""
    line = (f"[{name}] step {protocol.step:5d} round {protocol.round:3d} loss {record['loss']:.3f} "
            f"val {record['val_loss']:.3f} sent {record['bytes_sent'] / 2**20:.1f} MiB wait {record['wait_s']:.1f}s")
    if sync is not None:
        line += f" group {len(sync.group)}{'' if sync.complete else ' (partial)'}"
        if sync.spread is not None:
            line += f" spread {sync.spread:.2e}"
        if sync.repaired:
            line += " (repaired from the majority)"
        if sync.held_by is not None and sync.held_by[1] >= HELD_SHOWN_S:
            line += f" held up {sync.held_by[1]:.1f}s by {member_name(transport, sync.held_by[0], name)}"
    return line


def _train(protocol: SyncProtocol, recipe: Recipe, opts: WorkerOptions, batches_from, val, transport, lineage: dict,
           net: torch.nn.Module) -> dict:
    """Train from wherever the protocol starts (a checkpoint, a start point, the swarm's step); the data
    goes on from that step too (`batches_from(step)`). `net` runs the forward pass: the model, or its
    DistributedDataParallel wrapper in an island."""
    t = recipe.train
    last_step = t.steps if opts.stop_at is None else min(t.steps, opts.stop_at)
    for note in opts.notes:  # (after the refusals: a refusal comes alone)
        print(f"note: {note}", file=sys.stderr, flush=True)
    model, optimizer = protocol.model, protocol.optimizer
    path = opts.out / "metrics.jsonl"  # resumed: its records past the checkpoint are redone, its counters go on
    carried = counters_reached(keep_records_until(path, protocol.step)) if opts.resume else {}
    if not opts.resume and path.is_file() and path.stat().st_size:  # (an --out with a checkpoint was refused)
        path.unlink()
        print(f"note: {path} held the records of an earlier run that saved no checkpoint; they are replaced",
              file=sys.stderr, flush=True)
    log = MetricsLog(path, sink=TensorBoardSink(opts.tensorboard) if opts.tensorboard else None)
    val_loss = None
    last_sync = None
    trained_from = None  # the step this process's training began at, once it did
    try:
        if opts.on_ready and transport.multiaddrs():
            opts.on_ready(transport.multiaddrs())
        card = StatusCard(transport, opts.name, t.batch_size * t.context * (opts.world_size if opts.island_mode else 1))
        setup = _swarm_setup(recipe, opts)
        transport.set_card(False, setup=setup)
        _check_same_setup(transport, setup, recipe.swarm.run)  # before the swarm's state is downloaded for nothing
        with protocol:  # joins the swarm: its state, round and step, and announces the round
            _wait_for_peers(transport, opts, protocol)
            _check_same_setup(transport, setup, recipe.swarm.run)  # (members seen since)
            if protocol.donor is not None and protocol.step >= last_step:
                raise RecipeError(f"the swarm is at step {protocol.step}, and this run ends at step {last_step} "
                                  f"({'--stop-at' if last_step == opts.stop_at else 'train.steps, --steps'}: the "
                                  f"swarm's step count, not ours): nothing would train; give a later one")
            batches = batches_from(protocol.step)
            first = dict(worker=opts.name, step=protocol.step, round=protocol.round)
            if protocol.donor is None or protocol.step == 0:  # one joining mid-run skips it: the round
                first["val_loss"] = val_loss = evaluate(model, val)  # under way goes on without waiting
            start = time.perf_counter()  # wall time counts training, not start-up and waiting for peers
            log.write(**first, **counters(protocol, transport, 0.0, carried), **cpu_record(), **children_record())
            copies = protocol.memory_copies()
            opts.print_fn(f"[{opts.name}] peer {transport.peer_id[-8:]} starts at round {protocol.round}, "
                          f"step {protocol.step}, " + (f"val {val_loss:.3f}" if val_loss is not None else
                                                       f"from the state of {protocol.donor[-8:]}")
                          + (f" (trains the rest of round {protocol.round} on its own, averages from round "
                             f"{protocol.round + 1} on)" if protocol.onlooking else "")
                          + (f"; {protocol.name} keeps {len(copies)} model-sized copies ({', '.join(copies)})"
                             if copies else ""))
            trained_from = protocol.step
            while protocol.step < last_step:
                if opts.stop is not None and opts.stop.is_set():
                    raise KeyboardInterrupt
                for group in optimizer.param_groups:
                    group["lr"] = inner_lr(protocol.step, recipe)
                x, y = next(batches)
                model.train()
                with _island_failures(opts):
                    _, loss = net(x, y)
                    loss.backward()  # in an island, DistributedDataParallel all-reduces the gradients here
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
                optimizer.step()  # the protocol's hooks run here
                optimizer.zero_grad(set_to_none=True)
                record, report = step_record(opts.name, protocol, transport, loss, time.perf_counter() - start, carried)
                _check_finite("loss", record["loss"], protocol.step)
                card.update(record["loss"], record["wall_s"])  # what `decentral status` shows of us
                if report is not None:
                    card.synced(report.held_by)
                    if _left_alone(protocol, last_sync, report):
                        opts.print_fn(f"[{opts.name}] step {protocol.step} round {protocol.round}: no other member "
                                      f"took part (they ended, left or did not answer); training on alone until one does")
                    elif _alone_from_the_start(opts, transport, last_sync, report):
                        opts.print_fn(f"[{opts.name}] step {protocol.step} round {protocol.round}: no member of run "
                                      f"{recipe.swarm.run!r} is in the swarm joined through --join: training alone "
                                      "until one joins (do its members run another --run, swarm.run?)")
                    last_sync = report
                if protocol.step % t.eval_every == 0:
                    val_loss = _check_finite("validation loss", evaluate(model, val), protocol.step)
                    record["val_loss"] = val_loss
                    record.update(children_record())
                    opts.print_fn(_progress_line(opts.name, protocol, record, last_sync, transport))
                    _save(protocol, opts, recipe, lineage)
                log.write(**record)
        val_loss = _check_finite("validation loss", evaluate(model, val), protocol.step)  # after the protocol finished
        log.write(worker=opts.name, step=protocol.step, round=protocol.round, val_loss=val_loss, final=True,
                  **counters(protocol, transport, time.perf_counter() - start, carried), **cpu_record(),
                  **children_record())
        _save(protocol, opts, recipe, lineage)
    except DivergedError as e:
        checkpoint = opts.out / "checkpoint"
        opts.print_fn(f"[{opts.name}] stopped: {e}; " + (f"the last good checkpoint is in {checkpoint}"
                                                         if checkpoint.exists() else "no checkpoint was saved before"))
        raise
    except SwarmError:  # the caller reports the error itself
        checkpoint = opts.out / "checkpoint"
        opts.print_fn(f"[{opts.name}] stopped at step {protocol.step}; " + (
            f"its last checkpoint is in {checkpoint} (--resume goes on from it)" if checkpoint_present(checkpoint)
            else "no checkpoint was saved"))
        raise
    except KeyboardInterrupt:
        if trained_from is None or protocol.step == trained_from:  # (a checkpoint of it would block a rerun)
            opts.print_fn(f"[{opts.name}] interrupted before training a step; nothing saved" +
                          (f" (the checkpoint in {opts.out / 'checkpoint'} is as it was)" if opts.resume else ""))
            raise
        _save(protocol, opts, recipe, lineage)
        opts.print_fn(f"[{opts.name}] interrupted at step {protocol.step}; checkpoint saved in {opts.out / 'checkpoint'}"
                      + ("" if opts.stop is not None else " (--resume goes on from it)"))  # (a caller's stop: no CLI)
        raise
    finally:
        log.close()
    return {"worker": opts.name, "step": protocol.step, "round": protocol.round, "val_loss": val_loss,
            **counters(protocol, transport, time.perf_counter() - start, carried), "peak_rss_mib": peak_rss_mib()}
