"""Baseline worker: `decentral train`'s training, synchronised by `hivemind.Optimizer` instead of our protocols.

Everything but the synchronisation is the reference worker's (`decentral.worker`): the recipe's model (the
reference GPT or a Hugging Face model: decentral.models.build_model), the same corpus, shard and batch seed per
`--worker-index`, AdamW with the same hyper-parameters, the same per-step `inner_lr` schedule, gradient clipping
and evaluation batches.

hivemind.Optimizer runs in its local-updates mode, its closest match to DiLoCo: each peer takes AdamW steps on
its own gradients, and whenever the swarm has processed `batch_size * num_workers * every` samples (hivemind's
"epoch", about `every` local steps per peer) the peers average their parameters in one all-reduce round.
Unlike DiLoCo there is no outer optimizer: the average simply replaces the parameters (DiLoCo with outer
lr 1 and no momentum). `make_optimizer` documents every setting.

Writes `OUT/metrics.jsonl` with the reference worker's fields (see `train`) and `OUT/checkpoint` at the end.
Exit status: 0 done, 1 failure (message on stderr), 2 bad recipe or model, 3 diverged, 130 interrupted.

    python -m decentral.baselines.hivemind_optimizer --protocol protocols/diloco.yaml --out runs/hm/w0 \\
        --name w0 --worker-index 0 --num-workers 4 [--join MADDR ...] [--maddr-file F] [--min-peers 4]
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterator, Sequence

os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")  # before hivemind is imported, as in decentral.cli

import torch
from hivemind.compression import Float16Compression
from hivemind.dht import DHT
from hivemind.optim import Optimizer
from hivemind.utils import get_dht_time

from decentral.checkpoint import save_checkpoint
from decentral.config import Recipe, RecipeError, load_recipe, recipe_path
from decentral.cpu import children_record, cpu_record
from decentral.data.batches import Batch, eval_batches, evaluate, train_batches
from decentral.data.corpus import load_corpus
from decentral.device import pick_device
from decentral.metrics import MetricsLog
from decentral.models import ModelError, build_model
from decentral.worker import inner_lr

DEFAULT_EVERY = 50  # local steps between averaging rounds when neither --every nor the recipe says
MATCHMAKING_S = 5.0  # hivemind's advice: 3-5 s for small runs, 10-15 s over the internet or with many peers
WAIT_PEERS_S = 300.0  # the most --min-peers waits, like decentral.worker
PEER_POLL_S = 0.25  # how often the --min-peers wait looks at hivemind's count of peers
GOODBYE_TIMEOUT_S = 5.0  # the most say_goodbye waits for one store (one takes up to ~3 s when a peer has left)
GOODBYE_ATTEMPTS = 2


class BaselineError(RuntimeError):
    """The baseline cannot run or finish; the message says why."""


class DivergedError(BaselineError):
    """The training loss is no longer finite."""


@dataclass
class BaselineOptions:
    out: Path
    name: str
    worker_index: int
    num_workers: int
    every: int
    join: Sequence[str] = ()
    host: str = "127.0.0.1"
    data: Sequence[str] | None = None  # text files or folders; None = the Python standard library
    maddr_file: Path | None = None
    min_peers: int = 1  # wait until this many peers (us included) have their optimizer up


def make_optimizer(dht: DHT, model: torch.nn.Module, recipe: Recipe, *, num_workers: int, every: int) -> Optimizer:
    """hivemind.Optimizer over `model`'s parameters, tuned for a few peers on slow links with local updates.

    The swarm averages parameters about every `every` local steps per peer; one round may take at most
    `recipe.swarm.timeout` seconds, the budget our protocols get for one average.
    """
    t, timeout = recipe.train, recipe.swarm.timeout
    matchmaking = min(MATCHMAKING_S, timeout / 2)  # leave at least half of the round's budget to the all-reduce
    opt = Optimizer(
        dht=dht,
        run_id=recipe.swarm.run,  # peers of one run share DHT keys; different runs ignore each other
        params=model.parameters(),
        # A factory, as hivemind requires for its own optimizer management. lr starts at 0 because hivemind
        # initialises AdamW's state with one zero-gradient step, and at lr 0 that step leaves the parameters
        # untouched (no decoupled weight decay); `_reset_adam_step_counts` then undoes its step count. The lr
        # itself is set before every step from decentral.worker.inner_lr (see `train`).
        optimizer=partial(torch.optim.AdamW, lr=0.0, weight_decay=t.weight_decay, betas=(0.9, 0.95)),
        # Local updates: AdamW steps on local gradients every step; parameters are averaged once per epoch.
        use_local_updates=True,
        # One epoch = the samples all peers process in `every` local steps, so a round comes about every
        # `every` steps per peer, the H of our DiLoCo recipe. hivemind counts samples, not steps, so with
        # uneven peer speeds the fast ones take more steps per round.
        target_batch_size=t.batch_size * num_workers * every,
        batch_size_per_step=t.batch_size,  # each opt.step() reports one local batch of progress
        # No scheduler: hivemind steps a scheduler once per epoch, far too coarse for inner_lr's per-step
        # warmup and cosine. All peers start together (--min-peers), so local step counts stay aligned.
        average_state_every=1,  # average at every epoch: local updates make peers drift apart quickly
        # Average in a background thread (the default, and what the docstring suggests); with local updates
        # hivemind then applies the result by the delta rule. The next local AdamW step waits for the round,
        # so the overlap is about one forward/backward pass.
        delay_state_averaging=True,
        # Nothing to offload on CPU, and hivemind's default for local updates; offloading would only add
        # parameter copies. Without offloading, delayed optimizer steps are unavailable (and delayed
        # gradient averaging is refused with local updates: no gradients are averaged at all).
        offload_optimizer=False,
        delay_optimizer_step=False,
        matchmaking_time=matchmaking,  # a few peers: the small-run end of the docstring's advice
        averaging_timeout=timeout,  # a round (matchmaking included) gives up after the budget our protocols get
        allreduce_timeout=timeout,  # one all-reduce attempt gets the same budget, as hivemind's default does
        # A peer that sends no chunk for this long is dropped from the round. hivemind's default
        # (matchmaking_time) is too short for a tensor part on a slow link; reducers wait twice this, which
        # keeps them within the round's budget.
        next_chunk_timeout=timeout / 2,
        load_state_timeout=timeout,  # a lagging peer's state download is bounded too (default 600 s)
        # Parameters travel as fp16, as the docstring recommends ("usually fine to use pure 16-bit"): half the
        # bytes on slow links, and fp16 rounding (~5e-4 relative) is far below the drift of `every` AdamW
        # steps. 8-bit codecs are not an option: hivemind 1.1.12's are silently broken with NumPy 2.
        # grad_compression is not set: local updates average no gradients.
        state_averaging_compression=Float16Compression(),
        # Like DiLoCo, AdamW moments stay local (average_opt_statistics left empty): averaging them would
        # triple the bytes per round. A group of all peers closes as soon as everyone has joined instead of
        # waiting out matchmaking_time.
        averager_opts=dict(target_group_size=num_workers),
        # A peer that vanished without a goodbye (see `say_goodbye`) keeps being counted, its progress
        # extrapolated, until its last progress record expires; forget it after the budget our protocols give
        # a dead peer (the default recipe's 60 s is also hivemind's default). Live peers re-announce every half
        # of this, even while blocked in a round.
        tracker_opts=dict(metadata_expiration=timeout),
    )
    _reset_adam_step_counts(opt.opt)
    return opt


def _reset_adam_step_counts(adam: torch.optim.Optimizer) -> None:
    """Undo the step count of hivemind's zero-gradient initialisation step, so that AdamW's bias correction
    matches a fresh AdamW's (its moments are still zero after a zero-gradient step)."""
    for state in adam.state.values():
        state["step"].zero_()


class _RoundOutcomes(logging.Filter):
    """Group sizes of finished averaging rounds (this peer included; 1 when the round failed).

    hivemind.Optimizer does not hand a round's group to the caller; its TrainingStateAverager logs
    "Averaged parameters with N peers" or "Averaging failed with ..." at DEBUG level (hivemind 1.1.12). While
    entered, this filter sees that logger's DEBUG records and passes on to handlers only the records the
    logger's own level would have passed, so the console stays as quiet as before.
    """

    LOGGER = "hivemind.optim.state_averager"

    def __init__(self) -> None:
        super().__init__()
        self._logger = logging.getLogger(self.LOGGER)
        self._saved_level = self._logger.level
        self._pass_level = self._logger.getEffectiveLevel()
        self._sizes: deque[int] = deque()  # appended by hivemind's background thread

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Averaged parameters with "):
            self._sizes.append(int(message.split()[3]))
        elif message.startswith("Averaging failed"):
            self._sizes.append(1)
        return record.levelno >= self._pass_level

    def latest(self) -> int | None:
        """The group size of the most recent round finished since the last call, or None if none finished."""
        size = None
        while self._sizes:
            size = self._sizes.popleft()
        return size

    def __enter__(self) -> _RoundOutcomes:
        self._logger.addFilter(self)
        self._logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeFilter(self)
        self._logger.setLevel(self._saved_level)


class _Traffic:
    """Bytes this host sent and received on its network interfaces since construction, from /proc/net/dev.

    hivemind counts no bytes, so the interface counters (all of them but `lo`) stand in; in a network
    namespace of our netlab they are exactly this peer's traffic. When the peers talk over a loopback
    address, or the host has no interface but `lo`, their traffic cannot be told apart and both are None.
    """

    def __init__(self, host: str) -> None:
        counts = None if ipaddress.ip_address(host).is_loopback else self._read()
        self._start = counts

    @property
    def sent_received(self) -> tuple[int | None, int | None]:
        if self._start is None:
            return None, None
        sent, received = self._read()
        return sent - self._start[0], received - self._start[1]

    @staticmethod
    def _read() -> tuple[int, int] | None:
        """(transmitted, received) bytes summed over every interface but `lo`; None when there is no other."""
        lines = Path("/proc/net/dev").read_text().splitlines()[2:]  # two header lines
        sent = received = 0
        found = False
        for line in lines:
            name, fields = line.split(":", 1)
            if name.strip() == "lo":
                continue
            numbers = fields.split()
            received += int(numbers[0])
            sent += int(numbers[8])
            found = True
        return (sent, received) if found else None


def start_dht(opts: BaselineOptions) -> DHT:
    """A running DHT joined to `opts.join` and listening on `opts.host`.

    Prints the join line in decentral.cli's format and writes `opts.maddr_file` atomically.
    """
    dht = DHT(initial_peers=list(opts.join), start=True, host_maddrs=[f"/ip4/{opts.host}/tcp/0"])
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    if not maddrs:
        dht.shutdown()
        raise BaselineError(f"the DHT reports no address to join it at (listening on {opts.host})")
    print(f"[{opts.name}] others join with --join {maddrs[0]}", flush=True)
    if opts.maddr_file:
        tmp = opts.maddr_file.with_name(opts.maddr_file.name + ".tmp")
        tmp.write_text("\n".join(maddrs) + "\n")
        tmp.replace(opts.maddr_file)
    return dht


def wait_for_peers(opt: Optimizer, opts: BaselineOptions) -> float:
    """Return once hivemind's own progress tracker counts `opts.min_peers` peers (us included); returns the
    seconds waited.

    Call it after the first opt.step(): a peer appears in the tracker only once it has reported samples. Waiting
    on the tracker, not on a key of our own, matters: until it sees the others, hivemind believes it is alone,
    ends epochs on its own samples and skips every averaging round. Raises BaselineError after WAIT_PEERS_S.
    """
    began = time.monotonic()
    deadline = began + WAIT_PEERS_S
    announced = False
    while (seen := opt.tracker.global_progress.num_peers) < opts.min_peers:
        if not announced:
            print(f"[{opts.name}] waiting for {opts.min_peers} peers", flush=True)
            announced = True
        if time.monotonic() > deadline:
            raise BaselineError(f"fewer than {opts.min_peers} peers joined within {WAIT_PEERS_S:.0f}s (saw {seen})")
        time.sleep(PEER_POLL_S)  # the tracker refreshes its view from the DHT in its own thread
    return time.monotonic() - began


def say_goodbye(opt: Optimizer, dht: DHT) -> None:
    """Tell the swarm that the shut-down `opt` has left; gives up after GOODBYE_ATTEMPTS * GOODBYE_TIMEOUT_S.

    hivemind's own goodbye, a last progress record marking us gone, is sent by opt.shutdown() without waiting for
    it, and in 1.1.12 it is often lost: the DHT process fails to receive the request ("Connection reset by peer",
    at times dying of it). The others would go on extrapolating our stale progress until it expires: their epochs
    race ahead and every round waits out its timeout for us. So the same record is stored again here.
    """
    tracker = opt.tracker
    for _ in range(GOODBYE_ATTEMPTS):
        if not dht.is_alive():
            break
        stored = dht.store(tracker.training_progress_key, subkey=tracker._local_public_key, value=None,
                           expiration_time=get_dht_time() + tracker.metadata_expiration, return_future=True)
        try:
            stored.result(timeout=GOODBYE_TIMEOUT_S)
            return
        except TimeoutError:
            pass  # the DHT process lost this request too: try again
    print(f"could not say goodbye in the DHT; the others count us for up to {tracker.metadata_expiration:.0f}s more",
          file=sys.stderr, flush=True)


def train(
    model: torch.nn.Module, opt: Optimizer, recipe: Recipe, opts: BaselineOptions,
    batches: Iterator[Batch], val: list[Batch], log: MetricsLog,
) -> dict[str, Any]:
    """Run `recipe.train.steps` local steps through `opt`, writing metrics to `log`; returns the last record.

    Records, like decentral.worker's: one at step 0 with `val_loss`; one per step with `worker, step, round
    (hivemind's local_epoch), loss, bytes_sent, bytes_received, wall_s, wait_s, cpu_s, thread_cpu_s`
    (`cpu_record`; records with `val_loss` add `children_cpu_s`, `children_record`), where the step after
    an epoch change also has `val_loss` (measured once that epoch's averaging round has been applied,
    which hivemind does at the start of the next opt.step()) and, when known, `group_size`. `wall_s`
    counts from after the first evaluation, less the wait for the other peers after step 1 (see
    `wait_for_peers`); `wait_s` is the cumulative time inside opt.step(), which includes the local AdamW
    update as well as waiting for rounds. Shuts the optimizer down (which applies a round still in
    flight), then writes a last record with `val_loss`, `final: true` and, when one finished since the
    last report, a round's `group_size`.
    Raises DivergedError when the loss stops being finite.
    """
    traffic = _Traffic(opts.host)
    first_val = evaluate(model, val)
    start = time.perf_counter()  # like decentral.worker's clock: training time, from after the first evaluation
    wait_s = joining_s = 0.0  # joining_s: the wait for the others after step 1, not counted as training time

    def counters() -> dict[str, Any]:
        sent, received = traffic.sent_received
        return dict(bytes_sent=sent, bytes_received=received, wall_s=time.perf_counter() - start - joining_s,
                    wait_s=wait_s, **cpu_record())

    record = dict(worker=opts.name, step=0, round=opt.local_epoch, val_loss=first_val, **counters(),
                  **children_record())
    log.write(**record)
    print(f"[{opts.name}] starts at epoch {opt.local_epoch}, val {record['val_loss']:.3f}", flush=True)
    seen_epoch, round_applied = opt.local_epoch, False
    with _RoundOutcomes() as rounds:
        for step in range(recipe.train.steps):
            for group in opt.opt.param_groups:  # the wrapped AdamW's; opt.param_groups returns copies
                group["lr"] = inner_lr(step, recipe)
            x, y = next(batches)
            model.train()
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.train.grad_clip)
            began = time.perf_counter()
            opt.step()
            wait_s += time.perf_counter() - began
            if step == 0:
                joining_s = wait_for_peers(opt, opts)
            opt.zero_grad(set_to_none=True)
            if not math.isfinite(loss.item()):
                raise DivergedError(f"loss {loss.item()} at step {step + 1}")
            record = dict(worker=opts.name, step=step + 1, round=opt.local_epoch, loss=loss.item(), **counters())
            if round_applied:
                record["val_loss"] = evaluate(model, val)
                record.update(children_record())
                group_size = rounds.latest()
                if group_size is not None:
                    record["group_size"] = group_size
                print(f"[{opts.name}] step {step + 1:5d} epoch {opt.local_epoch:3d} loss {record['loss']:.3f} "
                      f"val {record['val_loss']:.3f} group {group_size or '?'} wait {wait_s:.1f}s", flush=True)
            round_applied = opt.local_epoch != seen_epoch
            seen_epoch = opt.local_epoch
            log.write(**record)
        opt.shutdown()  # waits for a round still in flight and applies it
        record = dict(worker=opts.name, step=recipe.train.steps, round=opt.local_epoch,
                      val_loss=evaluate(model, val), final=True, **counters(), **children_record())
        group_size = rounds.latest()
        if group_size is not None:
            record["group_size"] = group_size
    log.write(**record)
    return record


def run(recipe: Recipe, opts: BaselineOptions) -> dict[str, Any]:
    """Join (or start) the swarm, train, save `opts.out/checkpoint`; returns the final metrics record."""
    torch.set_num_threads(1)
    t = recipe.train
    torch.manual_seed(t.seed)  # every peer starts from the same weights, as decentral.worker's do
    opts.out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(opts.data)
    device = pick_device(t.device, opts.worker_index)
    model = build_model(recipe.model_source, recipe.model, t.context).to(device)
    batches = train_batches(corpus.train, batch_size=t.batch_size, context=t.context,
                            worker=opts.worker_index % opts.num_workers, num_workers=opts.num_workers,
                            seed=t.seed + opts.worker_index, device=device)
    val = eval_batches(corpus.val, batch_size=t.batch_size, context=t.context, num_batches=t.eval_batches,
                       device=device)
    dht = start_dht(opts)
    try:
        opt = make_optimizer(dht, model, recipe, num_workers=opts.num_workers, every=opts.every)
        try:
            with MetricsLog(opts.out / "metrics.jsonl") as log:
                final = train(model, opt, recipe, opts, batches, val, log)
        finally:
            if opt.is_alive():  # train shuts it down itself before its final evaluation
                opt.shutdown()
            say_goodbye(opt, dht)
        meta = {
            "baseline": "hivemind.Optimizer", "hivemind_version": version("hivemind"), "recipe": recipe.to_dict(),
            "every": opts.every, "num_workers": opts.num_workers, "local_epoch": opt.local_epoch,
            "step": final["step"], "target_batch_size": opt.target_batch_size,
            "matchmaking_time": opt.matchmaking_time, "averaging_timeout": opt.averaging_timeout,
        }
        save_checkpoint(opts.out / "checkpoint", {f"model.{k}": v for k, v in model.state_dict().items()}, meta)
        return final
    finally:
        dht.shutdown()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m decentral.baselines.hivemind_optimizer",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", default="diloco", help="a recipe file (protocols/*.yaml) or a recipe name")
    parser.add_argument("--out", required=True, help="folder for metrics.jsonl and the checkpoint")
    parser.add_argument("--name", default="worker", help="name in logs and metrics")
    parser.add_argument("--worker-index", type=int, required=True, help="which data shard")
    parser.add_argument("--num-workers", type=int, required=True, help="number of data shards and of peers")
    parser.add_argument("--join", action="append", default=[], metavar="MADDR", help="multiaddr of any peer (repeatable)")
    parser.add_argument("--host", default="127.0.0.1", help="IPv4 address to listen on")
    parser.add_argument("--maddr-file", type=Path, help="write our multiaddrs to this file once the DHT is up")
    parser.add_argument("--min-peers", type=int, default=1, help="wait until this many peers (us included) are up")
    parser.add_argument("--steps", type=int, help="local steps (default: the recipe's)")
    parser.add_argument("--every", type=int, help=f"local steps per averaging round (default: the recipe's "
                                                  f"protocol.every, else {DEFAULT_EVERY})")
    parser.add_argument("--data", action="append", metavar="PATH", help="text file or folder (default: Python's stdlib)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        recipe = load_recipe(recipe_path(args.protocol))
    except RecipeError as e:
        print(f"hivemind baseline: {e}", file=sys.stderr)
        return 2
    if args.steps:
        recipe.train.steps = args.steps
    every = args.every or int(recipe.protocol_args.get("every", DEFAULT_EVERY))
    opts = BaselineOptions(
        out=Path(args.out), name=args.name, worker_index=args.worker_index, num_workers=args.num_workers,
        every=every, join=args.join, host=args.host, data=args.data, maddr_file=args.maddr_file,
        min_peers=args.min_peers,
    )
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM shuts hivemind down like Ctrl-C
    try:
        final = run(recipe, opts)
    except DivergedError as e:
        print(f"[{args.name}] diverged: {e}", file=sys.stderr, flush=True)
        return 3
    except KeyboardInterrupt:
        print(f"[{args.name}] interrupted", file=sys.stderr, flush=True)
        return 130
    except ModelError as e:
        print(f"hivemind baseline: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:  # any failure, hivemind's included: one clear line and a non-zero status
        print(f"[{args.name}] hivemind baseline failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    sent = "-" if final["bytes_sent"] is None else f"{final['bytes_sent'] / 2**20:.1f} MiB"
    print(f"[{args.name}] done: step {final['step']} epoch {final['round']} val_loss {final['val_loss']:.4f} "
          f"sent {sent} in {final['wall_s']:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
