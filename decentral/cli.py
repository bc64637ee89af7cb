"""`decentral` command line: demo, swarm, status, train, experts, merge, pipeline, netlab, bench, syncbench,
report."""

from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import logging
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Iterable, Iterator

os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")  # before hivemind is imported
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # before torch: c10d's failures reach us as exceptions
os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # before grpc: a port it cannot bind reaches us as an exception

from decentral.config import Recipe, RecipeError, load_recipe, parse_settings, recipe_path
from decentral.models import GPT_SOURCE, ModelError, absolute_source, check_source

DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # where a write failed, the disk's fault, not the code's

DOMAIN_HELP = ("a text domain, repeatable: batches are balanced over the domains and validation uses each "
               "one's dev split. Built in: code, legal, manuals, headers, changelogs; your own: NAME=PATH[,PATH]")
DEVICE_HELP = "auto (a GPU when there is one), cpu, cuda or cuda:N (default: the recipe's train.device)"
MODEL_HELP = ("gpt (the reference GPT the recipe's model section shapes), hf:CONFIG.json (a Hugging Face causal LM "
              "built from a transformers config, no download) or a save_pretrained folder to start from "
              "(needs decentral[hf]; default: the recipe's model.source)")


def _recipe(args):
    settings = parse_settings(getattr(args, "set", None) or [])
    recipe = load_recipe(recipe_path(args.protocol), settings)
    if getattr(args, "steps", None):
        recipe.train.steps = args.steps
    if getattr(args, "batch_size", None):
        recipe.train.batch_size = args.batch_size
    if getattr(args, "run", None):
        recipe.swarm.run = args.run
    if getattr(args, "timeout", None):
        recipe.swarm.timeout = args.timeout
    if getattr(args, "device", None):
        recipe.train.device = args.device
    if getattr(args, "island_size", None):
        recipe.island.size = args.island_size
    if getattr(args, "island_mode", None):
        recipe.island.mode = args.island_mode
    if getattr(args, "model", None):
        check_source(args.model)
        shaped = sorted(k for k in settings if k.startswith("model.") and k != "model.source")
        if args.model != GPT_SOURCE and shaped:
            raise RecipeError(f"--set {', '.join(shaped)}: shapes the reference GPT, and --model {args.model} takes "
                              "its shape from its own config")
        recipe.model_source = args.model
    recipe.model_source = absolute_source(recipe.model_source)  # as a swarm key's: island ranks start elsewhere
    key = swarm_key_path(args)
    if key:
        recipe.swarm.key_file = str(Path(key).resolve())
    return recipe


def swarm_key_path(args) -> str | None:
    """--swarm-key, else $DECENTRAL_SWARM_KEY, else None (the recipe's swarm.key_file stays)."""
    from decentral.swarm.admission import KEY_ENV

    return getattr(args, "swarm_key", None) or os.environ.get(KEY_ENV) or None


def swarm_key(path: str | None, notice: bool = True):
    """The SwarmKey at `path` (a note when others can read its file); without one, say once that the swarm is
    open (unless not `notice`: the caller says it once its swarm is up, so that an error before that is the only
    line on stderr)."""
    from decentral.swarm.admission import OPEN_SWARM_NOTICE, SwarmKey, key_file_note

    if path:
        key = SwarmKey.load(path)
        if (note := key_file_note(path)) is not None:
            print(note, file=sys.stderr, flush=True)
        return key
    if notice:
        print(OPEN_SWARM_NOTICE, file=sys.stderr, flush=True)
    return None


@contextlib.contextmanager
def interrupting(*signals: int) -> Iterator[None]:
    """Within the block each of `signals` raises KeyboardInterrupt, as Ctrl-C does, so that the main thread's
    cleanup runs; the earlier handlers afterwards. Call it from the main thread."""
    previous = {sig: signal.signal(sig, signal.default_int_handler) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_processes(procs: Iterable[subprocess.Popen], sig: int = signal.SIGTERM, grace_s: float = 60.0) -> None:
    """Send `sig` to each of `procs` still running, give them `grace_s` seconds in all to end (a worker saves
    its checkpoint on SIGTERM, a pipeline node closes its server on SIGINT), then kill and reap the rest."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_interrupted = threading.Event()


def _interrupt_once(signum, frame) -> None:
    """The first SIGINT, SIGTERM or SIGHUP raises KeyboardInterrupt (the worker saves its checkpoint and leaves the
    swarm); later ones do nothing, so that they cannot cut the save or the goodbye short: a terminal's Ctrl-C
    reaches a launcher (`demo`, an island's ranks) and its workers alike, and the launcher then stops them too.
    (Not SIG_IGN: a signal already pending when its handler became SIG_IGN raises OSError in Python.)"""
    if not _interrupted.is_set():
        _interrupted.set()
        raise KeyboardInterrupt


def _print_while_read(records: Path) -> Callable[[str], None]:
    """`print` for a worker's lines until stdout is closed under it (`| head`, a `tee` or terminal gone): then
    one line on stderr, and the run trains on without them (its records go on in `records`): a closed pipe
    raised BrokenPipeError out of the training loop, which stopped without saving its checkpoint."""
    def print_line(line: str) -> None:
        try:
            print(line, flush=True)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is still buffered goes too
            with contextlib.suppress(OSError):  # stderr may be the same closed pipe
                print(f"decentral: stdout was closed; training goes on without its lines (records: {records})",
                      file=sys.stderr, flush=True)
    return print_line


def train_worker(recipe, args, **overrides) -> int:
    """Run one worker with `recipe`, the options of the train command's `args` and `overrides`
    (WorkerOptions fields); print its outcome and return the exit code."""
    from decentral.checkpoint import checkpoint_present
    from decentral.island import IslandError
    from decentral.sync import DivergedError
    from decentral.worker import WorkerOptions, run_worker

    print_line = _print_while_read(Path(args.out) / "metrics.jsonl")

    def ready(maddrs: list[str]) -> None:
        if not recipe.swarm.key_file and not args.island and overrides.get("rank", 0) == 0:
            from decentral.swarm.admission import OPEN_SWARM_NOTICE

            print(OPEN_SWARM_NOTICE, file=sys.stderr, flush=True)
        print_line(f"[{args.name}] others join with --join {maddrs[0]}")
        if args.maddr_file:
            tmp = Path(args.maddr_file + ".tmp")
            tmp.write_text("\n".join(maddrs) + "\n")
            tmp.replace(args.maddr_file)

    options = dict(
        out=Path(args.out), join=args.join or (), data=args.data, worker_index=args.worker_index,
        num_workers=args.num_workers, host=args.host, port=args.port, announce_host=args.announce_host,
        resume=args.resume, name=args.name, min_peers=args.min_peers, domains=args.domain,
        init_from=Path(args.init_from) if getattr(args, "init_from", None) else None, stop_at=args.stop_at,
        island=args.island, rank=args.rank, world_size=args.world_size, on_ready=ready, print_fn=print_line,
        tensorboard=Path(args.tensorboard) if args.tensorboard else None,
    )
    if args.tensorboard:
        from decentral.metrics import summary_writer_class

        summary_writer_class()  # a missing tensorboard fails here, before joining the swarm
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # for the rest of the process: its exit is the worker's
        if signal.getsignal(sig) is not signal.SIG_IGN:  # a background job's SIGINT stays ignored
            signal.signal(sig, _interrupt_once)
    try:
        summary = run_worker(recipe, WorkerOptions(**{**options, **overrides}))
    except DivergedError:
        return 3
    except IslandError as e:
        rank = overrides.get("rank", args.rank)
        who = args.name + (f".rank{rank}" if rank else "")
        again = (f"with --resume (checkpoint in {args.out})" if checkpoint_present(Path(args.out) / "checkpoint") else
                 "without --resume (no checkpoint was saved yet)")
        if args.island:
            print_line(f"[{who}] stopped: {e}. The run's ranks cannot go on without it; restart every rank {again}")
        else:
            print_line(f"[{who}] stopped: {e}. The island left the swarm, whose other members go on; restart the "
                       f"island {again} to rejoin")
        return 4
    except KeyboardInterrupt:
        return 130
    print_line(f"[{summary['worker']}] done: step {summary['step']} val_loss {summary['val_loss']:.4f} "
               f"sent {summary['bytes_sent'] / 2**20:.1f} MiB in {summary['wall_s']:.0f}s"
               f"{' (the whole run, its earlier legs too)' if args.resume else ''}, peak memory "
               f"{summary['peak_rss_mib']:.0f} MiB")
    return 0


def schedule_notes(recipe: Recipe) -> list[str]:
    """What the run's step count does to its schedule that its user may not mean: a warmup that lasts the
    whole run, no outer step at all, or steps after the last one that no average counts."""
    t, notes = recipe.train, []
    if t.warmup_steps >= t.steps:
        notes.append(f"train.warmup_steps is {t.warmup_steps} and the run has {t.steps} steps: the learning rate warms "
                     f"up for the whole run, reaches {t.steps / t.warmup_steps:.2g} of train.lr at most and never "
                     f"decays; give --set train.warmup_steps=N below {t.steps}")
    every = recipe.round_length()
    if every is not None and t.steps < every:
        notes.append(f"{t.steps} steps are less than one round (every {every} steps): no outer step will run, so "
                     f"this trains as `local` would; give --steps {every} or more, or --set every=N")
    elif every is not None and t.steps % every:
        last = t.steps - t.steps % every
        notes.append(f"{t.steps} steps are not a multiple of every ({every}): the last {t.steps % every} come after "
                     f"the run's last outer step, and no average counts them; give --steps {last} or {last + every}")
    return notes


def cmd_train(args) -> int:
    from decentral.codec import TOPK_NOTICE, make_codec
    from decentral.ranks import rank_from_env, spawn_ranks
    from decentral.swarm.peer import check_multiaddrs, check_reachable_back

    check_multiaddrs(args.join or ())  # a malformed --join fails now, not once the model is built
    check_reachable_back(args.join or (), args.host, args.announce_host)  # so does one we could not be reached from
    if args.worker_index is not None and args.worker_index >= args.num_workers:
        raise RecipeError(f"--worker-index {args.worker_index}: the data has --num-workers {args.num_workers} shards, "
                          f"0 to {args.num_workers - 1}")
    if args.island:
        if not 0 <= args.rank < args.world_size:
            raise RecipeError(f"--rank {args.rank}: must be in [0, {args.world_size}) (--world-size {args.world_size})")
        if args.island_size or args.island_mode:
            raise RecipeError("--island makes the ranks the whole run; --island-size and --island-mode make an island "
                              "that is one member of a swarm: give one or the other")
        if rank_from_env() is not None:
            raise RecipeError("--island under torchrun: the launcher's ranks make an island that is one member of a "
                              "swarm (give no --island), or start each rank yourself with --island, --rank and "
                              "--world-size")
    elif args.rank or args.world_size != 1:
        raise RecipeError("--rank and --world-size go with --island (a run whose ranks average over "
                          "torch.distributed); an island in a swarm takes them from torchrun or --island-size")
    recipe = _recipe(args)
    if args.island and recipe.protocol == "local":
        raise RecipeError("--island averages what the protocol averages over torch.distributed; local averages "
                          "nothing: give another protocol")
    launched = None if args.island else rank_from_env()  # torchrun (or --island-size) started us as a rank
    if args.island_mode and launched is None and recipe.island.size == 1:
        raise RecipeError(f"--island-mode {args.island_mode} says how an island averages with the swarm, and this run "
                          "is no island: give --island-size N too, or start its ranks with torchrun")
    if launched is None and recipe.island.size > 1 and not args.island:
        if recipe.protocol == "local":
            raise RecipeError("an island (island.size > 1) is one member of a swarm: give it an outer protocol, "
                              "not local")
        return spawn_ranks(args.argv, recipe.island.size)
    overrides = {}
    if launched is not None:
        if recipe.island.size not in (1, launched.world_size):
            raise RecipeError(f"island.size is {recipe.island.size} but the launcher started {launched.world_size} "
                              "ranks (WORLD_SIZE)")
        overrides = dict(island="env://", island_mode=recipe.island.mode, rank=launched.rank,
                         world_size=launched.world_size, local_rank=launched.local_rank,
                         local_world_size=launched.local_world_size)
    if recipe.protocol != "local" and not args.island and (launched is None or launched.rank == 0):
        swarm_key(recipe.swarm.key_file, notice=False)  # a bad key file fails here, before any training
        if make_codec(recipe.swarm.codec).error_feedback:
            print(TOPK_NOTICE, file=sys.stderr, flush=True)
    if not args.island and (launched is None or launched.rank == 0):
        overrides["notes"] = schedule_notes(recipe)
    return train_worker(recipe, args, **overrides)


def cmd_swarm_start(args) -> int:
    from decentral.swarm import SwarmPeer
    from decentral.swarm.membership import EntryBeacon
    from decentral.swarm.reach import warn_if_unreachable

    key_path = swarm_key_path(args)
    peer = SwarmPeer(args.run, args.join or (), host=args.host, port=args.port, announce_host=args.announce_host,
                     swarm_key=swarm_key(key_path), identity_path=args.identity)
    warn_if_unreachable(peer, args.join)
    beacon = EntryBeacon(peer)  # a peer joining through us alone learns whether its key opens the swarm
    keyed = f" --swarm-key {key_path}" if key_path else ""
    # listening beyond loopback, we are joined from other machines: they must listen beyond it too
    remote = "" if ipaddress.ip_address(args.host).is_loopback else " --host 0.0.0.0"
    print(f"swarm {args.run!r} is up. Peers join with:")
    for maddr in peer.multiaddrs():
        print(f"  decentral train --join {maddr} --run {args.run}{keyed}{remote} --protocol {shlex.quote(args.protocol)}")
    serve_until_stopped()
    beacon.close()
    peer.shutdown()
    return 0


def cmd_swarm_keygen(args) -> int:
    from decentral.swarm.admission import SwarmKey

    key = SwarmKey.generate(args.path)
    print(f"swarm key {key.fingerprint} written to {args.path} (readable by you only). Give every member a copy "
          f"and start each with --swarm-key {args.path}; peers without it cannot read or write the swarm's "
          f"records nor open a stream to a member.")
    return 0


def cmd_status(args) -> int:
    from decentral.swarm.monitor import SwarmMonitor, watch

    monitor = SwarmMonitor(args.run, args.join, swarm_key=swarm_key(swarm_key_path(args), notice=False))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends the watch as Ctrl-C does: cleaned up
    try:
        watch(monitor, interval_s=args.interval, as_json=args.json, once=args.once)
    except KeyboardInterrupt:
        pass
    finally:
        monitor.close()
    return 0


def serve_until_stopped() -> None:
    """Say how to stop, then block until Ctrl-C or SIGTERM (whose handler is in place once the line is out)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("Ctrl-C to stop.", flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass


def cmd_demo(args) -> int:
    from decentral.demo import run_demo

    if args.tensorboard:
        from decentral.metrics import summary_writer_class

        summary_writer_class()  # once here, rather than in every worker
    return run_demo(_recipe(args), workers=args.workers, out=Path(args.out), protocol_arg=args.protocol,
                    tensorboard=Path(args.tensorboard) if args.tensorboard else None)


def number_type(kind: type, minimum: float, *, strict: bool = False):
    """An argparse type: a finite `kind` (int or float) of at least `minimum` (above it when `strict`)."""
    said = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {said}: {text!r}") from None
        if not math.isfinite(value) or (value <= minimum if strict else value < minimum):
            raise argparse.ArgumentTypeError(f"must be {'above' if strict else 'at least'} {minimum:g}, got {text}")
        return value
    return parse


positive_int = number_type(int, 1)
positive_seconds = number_type(float, 0, strict=True)


def int_list_type(minimum: int, why: str, maximum: int | None = None):
    """An argparse type: comma-separated distinct integers, each at least `minimum` (and at most `maximum`);
    `why` says what a smaller one breaks ("an island has at least 1 rank")."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
        if min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{text}: {why}")
        if maximum is not None and max(values) > maximum:
            raise argparse.ArgumentTypeError(f"{text}: at most {maximum}")
        if len(set(values)) < len(values):  # (each value is a point of the benchmark: one would run twice)
            raise argparse.ArgumentTypeError(f"{text}: a value given twice")
        return values
    return parse


SET_HELP = ("change one setting of the recipe (repeatable): SECTION.NAME=VALUE (swarm.codec=int8, train.lr=1e-3) "
            "or a protocol setting NAME=VALUE (outer_lr=0.7)")


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """What every command that runs a training worker takes, besides --protocol, --out and the start point."""
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help=SET_HELP)
    p.add_argument("--data", action="append", metavar="PATH", help="text file or folder (default: Python's stdlib)")
    p.add_argument("--domain", action="append", metavar="NAME[=PATH]", help=DOMAIN_HELP)
    p.add_argument("--steps", type=positive_int, help="inner steps: the LR schedule's length (default: the recipe's)")
    p.add_argument("--batch-size", type=positive_int, help="sequences per inner step (default: the recipe's)")
    p.add_argument("--stop-at", type=positive_int, metavar="STEP", help="stop at this inner step (the LR schedule still "
                   "spans --steps); a later run continues with --resume or --init-from")
    p.add_argument("--timeout", type=positive_seconds, help="seconds one average may take")
    p.add_argument("--device", help=DEVICE_HELP)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--worker-index", type=number_type(int, 0),
                   help="which data shard, from 0 to --num-workers - 1 (default: derived from the peer id)")
    p.add_argument("--num-workers", type=positive_int, default=1, help="number of data shards")
    p.add_argument("--name", default="worker", help="name in logs and metrics")
    p.add_argument("--tensorboard", metavar="DIR", help="also write the metrics as TensorBoard scalars into DIR "
                   "(needs decentral[tensorboard])")
    p.add_argument("--maddr-file", help="write our multiaddrs to this file once joined")
    p.add_argument("--min-peers", type=positive_int, default=1,
                   help="wait until this many peers (us included) are up and ready to train our first round")
    p.add_argument("--island", metavar="tcp://HOST:PORT",
                   help="sync over torch.distributed (gloo/NCCL) with --rank/--world-size instead of the swarm")
    p.add_argument("--rank", type=int, default=0, help="with --island: this process's rank, 0 .. --world-size - 1")
    p.add_argument("--world-size", type=positive_int, default=1, help="with --island: the number of ranks")
    p.add_argument("--island-size", type=positive_int, metavar="N",
                   help="train as a fast island of N local ranks that all-reduce gradients every step and are one "
                   "member of the swarm (default: the recipe's island.size; torchrun sets it by WORLD_SIZE)")
    p.add_argument("--island-mode", choices=["leader", "sharded"],
                   help="between islands: rank 0 averages for the island (leader), or each rank 1/N of it over "
                   "its own connection (sharded) (default: the recipe's island.mode)")
    add_network_arguments(p)


def add_network_arguments(p: argparse.ArgumentParser, run_default: str = "the recipe's") -> None:
    p.add_argument("--join", action="append", metavar="MADDR", help="multiaddr of any swarm member (repeatable)")
    p.add_argument("--run", help=f"run name: peers of different runs ignore each other (default: {run_default})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for other machines")
    p.add_argument("--port", type=int, default=0, help="TCP port to listen on (0: any free one)")
    p.add_argument("--announce-host", help="address other machines reach us at, when it differs from --host")
    p.add_argument("--swarm-key", metavar="FILE", help="the swarm's key (decentral swarm keygen): only peers holding "
                   "it take part (default: $DECENTRAL_SWARM_KEY, else the recipe's swarm.key_file, else open)")


EXIT_CODES = """exit codes:
  0    done
  1    it ran, and something in it failed: a benchmark's method or point, a demo's worker, a host's
       command (netlab -- CMD), a pipeline node left without commands; or a bug (with a traceback)
  2    it could not run as asked: one line on stderr says why (an argument, recipe, data path,
       --join address or a swarm that would not hand over its state, port, registry, network file,
       island rendezvous, netlab setup)
  3    training diverged (train)
  4    an island stopped: one of its ranks failed or left (train); the rest of the swarm goes on
  130  interrupted (Ctrl-C; SIGTERM or SIGHUP makes train save its checkpoint first)
  141  its output went into a pipe whose reader left (`... | head`), as SIGPIPE would end it"""


def example(*lines: str, before: str = "") -> dict:
    """Keyword arguments for a parser (ArgumentParser, add_parser) whose --help ends with `lines` (commands,
    or `# ...` comments) as its example, after `before` if given; line breaks are kept."""
    block = "example:\n" + "\n".join(f"  {line}" for line in lines)
    return dict(epilog=f"{before}\n\n{block}" if before else block,
                formatter_class=argparse.RawDescriptionHelpFormatter)


def described(text: str) -> dict:
    """`example` for a help text that ends with an "example:" block: the text above it is the description."""
    description, _, block = text.partition("\nexample:\n")
    return dict(description=description, **example(*(line.strip() for line in block.strip().splitlines())))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decentral", description=__doc__, **example(
        "decentral demo",
        "decentral train --protocol noloco --join /ip4/203.0.113.5/tcp/31337/p2p/Qm... --host 0.0.0.0",
        before=EXIT_CODES))
    parser.add_argument("-v", "--verbose", action="store_true", help="log swarm internals")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="a local swarm of workers training a small GPT on Python's own source",
                          **example("decentral demo --protocol diloco --workers 2 --steps 200 --out runs/demo-diloco"))
    demo.add_argument("--workers", type=positive_int, default=4)
    demo.add_argument("--protocol", default="noloco",
                      help="co2, ddp, diloco, noloco, streaming, local (no communication), or a recipe file")
    demo.add_argument("--set", action="append", metavar="KEY=VALUE", help=SET_HELP)
    demo.add_argument("--steps", type=positive_int, help="inner steps per worker (default: the recipe's)")
    demo.add_argument("--out", default="runs/demo")
    demo.add_argument("--timeout", type=positive_seconds, help="seconds one average may take")
    demo.add_argument("--device", help=DEVICE_HELP)
    demo.add_argument("--island-size", type=positive_int, metavar="N",
                      help="each worker a fast island of N ranks (DDP inside, one swarm member); e.g. --workers 2 "
                      "--island-size 2")
    demo.add_argument("--island-mode", choices=["leader", "sharded"], help="how islands average (default: leader)")
    demo.add_argument("--tensorboard", metavar="DIR", help="each worker also writes its metrics as TensorBoard "
                      "scalars into DIR/<worker> (needs decentral[tensorboard])")
    demo.add_argument("--model", metavar="SOURCE", help=MODEL_HELP)
    demo.set_defaults(func=cmd_demo, run=None)

    swarm = sub.add_parser("swarm", help="swarm peers without training", **example(
        "decentral swarm keygen swarm.key", "decentral swarm start --swarm-key swarm.key --host 0.0.0.0 --port 31337"))
    swarm_sub = swarm.add_subparsers(dest="swarm_command", required=True)
    start = swarm_sub.add_parser("start", help="start a swarm's first peer and print its multiaddr", **example(
        "decentral swarm start --swarm-key swarm.key --host 0.0.0.0 --announce-host 203.0.113.5 --port 31337 "
        "--identity entry.key"))
    add_network_arguments(start, run_default="decentral, the recipes'")
    start.add_argument("--identity", metavar="FILE", help="the entry's private key, made when missing: keep it (and "
                       "--port) to keep the --join address it prints across restarts (default: a new one each start)")
    start.add_argument("--protocol", default="noloco", help="the protocol or recipe file the swarm's members train "
                       "with, for the join command it prints (an entry averages nothing itself)")
    start.set_defaults(func=cmd_swarm_start, run="decentral")
    keygen = swarm_sub.add_parser("keygen", help="write a new swarm key: only peers holding it take part",
                                  **example("decentral swarm keygen swarm.key"))
    keygen.add_argument("path", metavar="FILE")
    keygen.set_defaults(func=cmd_swarm_keygen)

    status = sub.add_parser("status", help="watch a running swarm: each peer's step, round, loss, tokens/s, "
                            "bytes/s and last heartbeat, without joining it as a member", **example(
                                "decentral status --join /ip4/203.0.113.5/tcp/31337/p2p/Qm... --swarm-key "
                                "swarm.key --once"))
    status.add_argument("--join", action="append", required=True, metavar="MADDR", help="multiaddr of any member")
    status.add_argument("--run", default="decentral", help="the run's name (default: decentral, the recipes')")
    status.add_argument("--swarm-key", metavar="FILE", help="the swarm's key, if it has one "
                        "(default: $DECENTRAL_SWARM_KEY)")
    status.add_argument("--interval", type=number_type(float, 0, strict=True), default=2.0, metavar="S",
                        help="seconds between refreshes")
    status.add_argument("--once", action="store_true", help="print the table once and exit")
    status.add_argument("--json", action="store_true", help="print one JSON document {run, reachable, peers} and "
                        "exit")
    status.set_defaults(func=cmd_status)

    train = sub.add_parser("train", help="train as one swarm member (starts a swarm when --join is not given)",
                           **example("# the first member prints the --join address of the others",
                                     "decentral train --protocol noloco --swarm-key swarm.key --host 0.0.0.0 --port 31337",
                                     "decentral train --protocol noloco --swarm-key swarm.key --join "
                                     "/ip4/203.0.113.5/tcp/31337/p2p/Qm... --host 0.0.0.0 --data mytexts/"))
    train.add_argument("--protocol", default="noloco", help="a recipe file (protocols/*.yaml) or a protocol name")
    train.add_argument("--out", default="runs/train",
                       help="where the run writes metrics.jsonl and checkpoint/ (default: runs/train)")
    train.add_argument("--init-from", metavar="DIR", help="start from this checkpoint or expert folder: its weights, "
                       "inner optimizer state and step (the LR schedule continues)")
    train.add_argument("--model", metavar="SOURCE", help=MODEL_HELP)
    add_worker_arguments(train)
    train.set_defaults(func=cmd_train)

    from decentral.experts import cli as experts_cli

    experts = sub.add_parser("experts", help="branch-train-merge: seed, branch, registry, swarm sharing, ensemble",
                             **described(experts_cli.__doc__))
    experts_cli.add_arguments(experts)

    merge = sub.add_parser("merge", help="merge experts as a recipe says (merges/*.yaml)",
                           **described(experts_cli.MERGE_HELP))
    experts_cli.add_merge_arguments(merge)

    from decentral.pipeline.cli import add_pipeline_parser

    add_pipeline_parser(sub)

    from decentral import (
        bench, btmbench, dhtbench, fetchbench, islandbench, netlab, overheadbench, soakbench, sweepbench, syncbench,
    )

    bench_parser = sub.add_parser("bench", help="methods side by side on emulated hosts behind capped links; "
                                  "`bench btm`: branch-train-merge vs dense; `bench merge`: merge memory and speed; "
                                  "`bench soak`: a swarm under churn; `bench sweep`: a protocol's settings on loss",
                                  description=bench.__doc__, **example(
                                      "decentral bench --hosts 4 --bandwidth 20mbit --protocols ddp,diloco,noloco "
                                      "--out runs/bench"))
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=bench.main)
    suites = bench_parser.add_subparsers(dest="suite", title="other benchmarks")
    from decentral.merge import bench as merge_bench
    from decentral.pipeline import bench as pipeline_bench

    for name, module, help, command in (
            ("btm", btmbench, "branch-train-merge against a dense model of equal compute",
             "--seeds 1 --seed-steps 200 --branch-steps 200 --out runs/bench-btm"),
            ("merge", merge_bench, "merge time and peak memory against reading the inputs once",
             "--params 10000000 --out runs/bench-merge"),
            ("soak", soakbench, "a swarm whose peers are killed and restarted, against the same without",
             "--hosts 4 --steps 1000 --kill-every 30 --minutes 5 --out runs/soak"),
            ("sweep", sweepbench, "one protocol's settings against each other on loss (in one process, no network)",
             "--protocol diloco --steps 400 --set outer_lr=0.7,1.0 --with-local --out runs/sweep"),
            ("islands", islandbench, "fast islands: hierarchical vs flat, sharded vs leader",
             "--parts b --ks 2 --out runs/islands"),
            ("pipeline", pipeline_bench, "SkipPipe planner vs full pipeline and network-blind skipping (simulated)",
             "--seeds 0 --out runs/bench-pipeline"),
            ("overhead", overheadbench, "the library's per-inner-step cost against a plain torch loop (no network)",
             "--protocols diloco,noloco --steps 300 --out runs/overhead"),
            ("dht", dhtbench, "bytes on the wire of the swarm's own DHT records: per call, and idle per heartbeat period",
             "--peers 4 --heartbeats 2,6,10 --out runs/bench-dht"),
            ("fetch", fetchbench, "an expert fetched from 1, 2, ... publishers at once, each behind a capped uplink",
             "--publishers 4 --bandwidth 8mbit --size-mib 8 --out runs/bench-fetch")):
        module.add_arguments(suites.add_parser(name, help=help, description=module.__doc__,
                                               **example(f"decentral bench {name} {command}")))

    sync_parser = sub.add_parser("syncbench", help="time of one outer sync, DiLoCo vs NoLoCo, as hosts grow",
                                 description=syncbench.__doc__, **example(
                                     "decentral syncbench --hosts 2,4,8 --bandwidth 20mbit --out runs/syncbench"))
    syncbench.add_arguments(sync_parser)
    sync_parser.set_defaults(func=syncbench.run_syncbench)

    lab = sub.add_parser("netlab", help="emulated hosts behind capped links (network namespaces + tc tbf)",
                         **example("decentral netlab --hosts 2 --bandwidth 20mbit --measure",
                                   "decentral netlab --hosts 4 --bandwidth 20mbit -- ping -c 1 {addr0}"))
    netlab.add_arguments(lab)
    lab.set_defaults(func=netlab.main)

    from decentral import report

    report.add_arguments(sub.add_parser("report", help="redraw the loss plot of any run and print its summary table",
                                        description=report.__doc__, **example("decentral report runs/demo")))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(_negative_values_attached(argv))
    args.argv = argv
    if (misplaced := _options_before_a_suite(argv, args)) is not None:
        print(f"decentral: {misplaced}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s" if args.verbose
                        else "%(levelname)s %(name)s: %(message)s")
    logging.getLogger("decentral.progress").setLevel(logging.INFO)  # long work says how far it is
    if not args.verbose:  # p2pd's own lines are libp2p's internals (a listener closing as a failed start ends)
        logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(lambda record: not hasattr(record, "origin_created"))
    from decentral.checkpoint import CheckpointError
    from decentral.data import DataError
    from decentral.device import DeviceError
    from decentral.experts.registry import RegistryError
    from decentral.island import RendezvousError
    from decentral.merge import MergeError
    from decentral.metrics import MetricsError
    from decentral.netlab import NetLabError
    from decentral.pipeline import NetworkError
    from decentral.ranks import LaunchError
    from decentral.swarm import AdmissionError, SwarmError
    from decentral.transport import StateUnavailable

    writes_a_folder = (args.command in ("bench", "syncbench", "train", "demo")
                       or getattr(args, "pipeline_command", None) == "train"
                       or getattr(args, "experts_command", None) in ("seed", "branch"))
    folders = {"--out": getattr(args, "out", None) if writes_a_folder else None,
               "--tensorboard": getattr(args, "tensorboard", None)}  # each writes a folder there
    for option in ("--out", "--tensorboard"):
        given = getattr(args, option[2:], None)
        if isinstance(given, str) and not given.strip():  # (Path("") is the current folder)
            print(f"decentral: {option} is empty: give a folder", file=sys.stderr)
            return 2
    for option, folder in folders.items():
        if folder and Path(folder).exists() and not Path(folder).is_dir():
            print(f"decentral: {option} {folder} is a file, not a folder", file=sys.stderr)
            return 2
    try:
        return args.func(args)
    except (RecipeError, CheckpointError, DataError, DeviceError, MergeError, RegistryError, SwarmError,
            AdmissionError, NetworkError, LaunchError, MetricsError, ModelError, RendezvousError, NetLabError,
            StateUnavailable, OSError) as e:
        if (isinstance(e, OSError) and e.filename is None and e.errno not in DISK_ERRORS
                and not isinstance(e, (FileExistsError, PermissionError))):
            raise  # (an OSError about no path is no user's input: a socket's, a bug's)
        if args.verbose:
            traceback.print_exc()
        print("decentral: " + _one_line(e, folders), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (commands that say more about where they stopped return 130 themselves)
        print("decentral: interrupted", file=sys.stderr, flush=True)
        return 130


def _options_before_a_suite(argv: list[str], args: argparse.Namespace) -> str | None:
    """Why `argv` gave a command that runs on its own too (`bench`, `bench pipeline`) options before the name of
    the suite it then chose (`bench --hosts 8 soak`): argparse lets the suite's own defaults replace them, or drops
    them when the suite has no such option, without a word. None when it did not."""
    for command, dest in (("bench", "suite"), ("pipeline", "pipeline_suite")):
        suite = getattr(args, dest, None)
        if not suite or command not in argv or suite not in argv[argv.index(command) + 1:]:
            continue
        start = argv.index(command) + 1
        before = argv[start:argv.index(suite, start)]
        if any(token.startswith("-") for token in before):
            return (f"{' '.join(before)} given before `{suite}`: `{command}`'s own options, which `{command} {suite}` "
                    f"does not read; give its options after its name (decentral {command} {suite} --help)")
    return None


def _negative_values_attached(argv: list[str]) -> list[str]:
    """`--bandwidth -5mbit` as `--bandwidth=-5mbit`: argparse takes a value that starts with a minus and is not a
    plain number for an option, and says "expected one argument" instead of the option's own check of the value.
    (Arguments after a bare `--` are a command's, left as they are.)"""
    attached: list[str] = []
    for i, token in enumerate(argv):
        if token == "--":
            return attached + argv[i:]
        previous = attached[-1] if attached else ""
        plain_number = re.fullmatch(r"-\d+|-\d*\.\d+", token)  # (argparse reads those as values, also of nargs="+")
        if re.fullmatch(r"-\d\S*", token) and not plain_number and previous.startswith("--") and "=" not in previous:
            attached[-1] = f"{previous}={token}"
        else:
            attached.append(token)
    return attached


def _one_line(error: Exception, folders: dict[str, str | None]) -> str:
    """`error`'s message on one line; a path the command could not make or write (an --out in /proc, a full
    disk) as PATH: WHY, naming the option it came from."""
    if isinstance(error, OSError) and error.filename is None and error.errno in DISK_ERRORS:
        return f"{error.strerror}, as the command wrote its files"  # (a write to a file open already names none)
    if not isinstance(error, OSError) or error.filename is None:
        return " ".join(str(error).split())
    path = str(error.filename)
    option = next((f"{option} " for option, folder in folders.items()
                   if folder and (path == str(folder) or path.startswith(str(folder).rstrip("/") + "/"))), "")
    return f"{option}{path}: {error.strerror}"


if __name__ == "__main__":
    sys.exit(main())
