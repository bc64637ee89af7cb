"""Branch-train-merge from the command line: train a seed on all domains, branch an expert per domain,
keep them in a registry, share them through a swarm, and evaluate their ensemble.

example:
  # 3 domains that exist on every machine; the seed takes the first half of a 600-step schedule
  # with batches of 48, each expert the second half with 16 of its own domain
  decentral experts seed --domain code --domain legal --domain manuals --steps 600 --batch-size 48
  decentral experts branch code --from seed --domain code --batch-size 16
  decentral experts branch legal --from seed --domain legal --batch-size 16
  decentral experts branch manuals --from seed --domain manuals --batch-size 16
  decentral experts eval --experts code,legal,manuals --domain code --domain legal --domain manuals
  decentral merge linear --out runs/btm/experts/uniform
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import sys
from pathlib import Path

from decentral.cli import (
    _recipe, add_network_arguments, add_worker_arguments, example, positive_int, schedule_notes, serve_until_stopped,
    train_worker,
)
from decentral.checkpoint import CheckpointError, checkpoint_present, read_checkpoint_meta
from decentral.config import RecipeError, parse_recipe, parse_settings, with_settings
from decentral.metrics import format_table
from decentral.experts.registry import (
    CONFIG_FILE, META_FILE, Registry, RegistryError, trained_domains, verify_expert,
)
from decentral.models import GPT_SOURCE, HF_CONFIG_PREFIX, HF_SOURCE, absolute_source, gpt_description
from decentral.progress import progress_bar

DEFAULT_REGISTRY = "runs/btm/experts"
CLUSTER_FOLDER = re.compile(r"c[0-9]+")  # what `experts cluster` writes into --out, beside ROUTER_FILE
ROUTER_FILE = "router.npz"
MERGE_HELP = """Merge experts as a recipe (merges/*.yaml) says: linear, posterior, task_arithmetic, ties, dare,
slerp, model_stock. Tensors stream one at a time from safetensors, so memory holds a few tensors,
not the models; the output is an expert folder, written to a temporary folder and renamed into
place, so nothing is left half-written.

example:
  decentral merge ties --out runs/btm/experts/ties
  decentral experts eval --experts ties --domain code --domain legal --domain manuals"""


def _replace_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replace", action="store_true", help="replace an expert of the same name in the registry "
                   "(without it, a name that is taken is refused)")


def _registry_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--registry", default=DEFAULT_REGISTRY, help=f"folder of experts (default: {DEFAULT_REGISTRY})")


def _check_new_expert(registry: Registry, name: str, replace: bool, resuming: bool = False) -> None:
    """RegistryError when `name` is not a valid expert name, or is taken in `registry` and not `replace`: checked
    before any work, so that neither a run's training nor an expert others branched from is lost. `resuming`: the
    run goes on from its checkpoint, whose part up to a --stop-at may be the expert of that name."""
    if (registry.folder(name) / META_FILE).is_file() and not replace:
        raise RegistryError(f"expert {name!r} is already in {registry.root}" + (
            " (a run stopped at its --stop-at adds what it trained so far)" if resuming else "") +
            ": give another name, or --replace to replace it")


def _check_run_folder(args) -> None:
    """CheckpointError, before any work, when the run folder (`args.out`) holds an earlier run that this one does
    not --resume: --replace replaces the registry's expert, not the run that trained it."""
    if not args.resume and checkpoint_present(Path(args.out) / "checkpoint"):
        raise CheckpointError(f"{args.out} holds the run of an earlier {args.expert!r}: --resume goes on from it; to "
                              f"train it again, remove {args.out} or give another --out" +
                              (" (--replace replaces the registry's expert, not its run)" if args.replace else ""))


def _distinct(names: list[str], what: str) -> list[str]:
    """`names`; RegistryError naming the first one `what` (the option) gives twice."""
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise RegistryError(f"{what}: {twice!r} is given twice")
    return names


def _run_worker(recipe, args, name: str, domain: str | None, with_optimizer: bool, **overrides) -> int:
    """Train, then add the final checkpoint to the registry as `name`."""
    args.name = args.name or name
    code = train_worker(recipe, args, notes=schedule_notes(recipe), **overrides)
    if code != 0:
        return code
    expert = Registry(args.registry).add_checkpoint(Path(args.out) / "checkpoint", name, domain, with_optimizer)
    print(f"experts: {expert.name} ({expert.sha256[:12]}, step {expert.steps}, {expert.tokens:,} tokens) is in "
          f"{expert.folder}", flush=True)
    return 0


def cmd_seed(args) -> int:
    if not args.domain or len(args.domain) < 2:
        raise RegistryError("a seed trains on all domains: give two or more --domain")
    if not 0 < args.share <= 1:
        raise RegistryError(f"--share must be in (0, 1], got {args.share}")
    _check_new_expert(Registry(args.registry), args.expert, args.replace, args.resume)
    recipe = _recipe(args)
    stop_at = args.stop_at or max(1, round(args.share * recipe.train.steps))
    args.out = args.out or f"runs/btm/{args.expert}"
    _check_run_folder(args)
    print(f"experts: seed on {', '.join(args.domain)} (balanced) until step {stop_at} of a "
          f"{recipe.train.steps}-step schedule", flush=True)
    said = "--stop-at" if args.stop_at else f"--share {args.share:g} of a {recipe.train.steps}-step schedule"
    return _run_worker(recipe, args, args.expert, ",".join(args.domain), True, stop_at=stop_at, stop_at_from=said)


def _take_parents_model(recipe, args, parent) -> None:
    """Make `recipe`'s model `parent`'s, as a branch continues its weights: RecipeError for a `--set model.*`, which
    cannot change it; a note on stderr when the model the recipe file describes is another, which is not used."""
    from decentral.experts.branch import model_differences

    shaped = sorted(k for k in parse_settings(args.set or []) if k.startswith("model."))
    if shaped:
        raise RecipeError(f"--set {', '.join(shaped)}: a branch's model is that of its parent, expert {parent.name!r}, "
                          "and cannot be changed; drop it")
    if parent.is_hf:  # a Hugging Face model is built from the config.json in the parent's folder
        source = absolute_source(f"{HF_CONFIG_PREFIX}{parent.folder / CONFIG_FILE}")
        ignored = recipe.model_source not in (GPT_SOURCE, source)  # a GPT section there is the protocol file's default
        differences = f"model.source {recipe.model_source}"
        recipe.model_source = source
    else:
        ours = ({"source": HF_SOURCE} if recipe.model_source != GPT_SOURCE
                else gpt_description(dataclasses.asdict(recipe.model)))
        differences = model_differences(gpt_description(dataclasses.asdict(parent.config())), ours)
        ignored = bool(differences)
        recipe.model, recipe.model_source = parent.config(), GPT_SOURCE
    if ignored:
        print(f"experts: the model is {parent.name}'s, whose weights the branch continues; the model of --protocol "
              f"{args.protocol} is not used ({parent.name} there, the recipe here: {differences})",
              file=sys.stderr, flush=True)


def cmd_branch(args) -> int:
    registry = Registry(args.registry)
    _check_new_expert(registry, args.expert, args.replace, args.resume)
    parents = [registry.get(name) for name in _distinct(args.parent, "--from")]
    if not args.domain:
        raise RegistryError("an expert trains on its own domain: give --domain")
    if len(parents) > 1:  # before averaging them (one parent is checked where the worker loads it: load_start_point)
        for parent in parents:
            verify_expert(parent, with_optimizer=False)  # AdamW starts fresh
    recipe = _recipe(args)
    first = parents[0]
    if first.recipe:  # the schedule follows the parent's, --set train.* over it; protocol, swarm: --protocol's
        inherited = parse_recipe(first.recipe, f"the recipe of expert {first.name!r}")
        own = {k: v for k, v in parse_settings(args.set or []).items() if k.startswith("train.")}
        train = parse_recipe(with_settings({"train": inherited.to_dict()["train"]}, own), "--set").train
        recipe.train = dataclasses.replace(train, steps=args.steps or train.steps,
                                           batch_size=args.batch_size or train.batch_size,
                                           device=args.device or train.device)
    else:
        print(f"experts: {first.name} has no training recipe (a merge or a download without one): the schedule is "
              f"this run's ({recipe.train.steps} steps in all, from its step {first.steps})", flush=True)
    _take_parents_model(recipe, args, first)
    args.out = args.out or f"runs/btm/{args.expert}"
    _check_run_folder(args)
    if len(parents) == 1:
        start = first.folder
    else:
        from decentral.experts.branch import averaged_start

        if len(args.domain) != 1:
            raise RegistryError("branching from several experts weights them by one new domain's posterior: "
                                "give exactly one --domain")
        average = averaged_start(parents, args.domain[0], Path(args.out) / "init")
        branched = {p.start_step for p in parents}
        print("experts: starts from the average weighted by the domain's posterior: " +
              ", ".join(f"{e['name']} {e['weight']:.3f}" for e in average.merge["experts"]) +
              f", at step {average.steps}, " + ("where the parents branched" if len(branched) == 1 else
                                                "the earliest step its parents branched at (" +
                                                ", ".join(f"{p.name} {p.start_step}" for p in parents) +
                                                "): it trains the schedule from there"), flush=True)
        start = average.folder
    print(f"experts: {args.expert} branches from {', '.join(p.name for p in parents)} and trains on "
          f"{', '.join(args.domain)}", flush=True)
    return _run_worker(recipe, args, args.expert, ",".join(args.domain), args.with_optimizer, init_from=start)


def cmd_add(args) -> int:
    _check_new_expert(Registry(args.registry), args.name, args.replace)
    expert = Registry(args.registry).add_checkpoint(args.checkpoint, args.name, args.domain_name, args.with_optimizer)
    trained = trained_domains(read_checkpoint_meta(args.checkpoint))
    if args.domain_name and trained and args.domain_name != trained:
        print(f"experts: note: {args.checkpoint} trained on --domain {trained}; {expert.name}'s domain is "
              f"{args.domain_name}, as --domain-name says", file=sys.stderr, flush=True)
    domain = ""
    if expert.domain:
        domain = f", domain {expert.domain}" + ("" if args.domain_name else " (the checkpoint's)")
    print(f"experts: {expert.name} ({expert.sha256[:12]}{domain}) is in {expert.folder}")
    return 0


def _describe(expert, publishers: int | None = None) -> list[str]:
    row = [expert.name, expert.domain or "-", expert.sha256[:12], f"{expert.size / 2**20:.1f} MiB",
           str(expert.steps), f"{expert.tokens:,}", (expert.parent or "-")[:12],
           expert.merge["method"] if expert.merge else ("+optimizer" if expert.optimizer else "")]
    return row + ([str(publishers)] if publishers is not None else [])


def _peer(args):
    from decentral.cli import swarm_key, swarm_key_path
    from decentral.swarm import SwarmPeer

    return SwarmPeer(args.run, args.join or (), host=args.host, port=args.port, announce_host=args.announce_host,
                     swarm_key=swarm_key(swarm_key_path(args)))


def cmd_list(args) -> int:
    header = ["name", "domain", "sha256", "size", "steps", "tokens", "parent", "notes"]
    if not args.join:
        registry, experts, unreadable = Registry(args.registry), [], []
        for name in registry.names():
            try:
                experts.append(registry.get(name))
            except RegistryError as e:
                unreadable.append(str(e))
        if experts or not unreadable:
            print(format_table([header] + [_describe(e) for e in experts], numeric=False) if experts
                  else f"no experts in {args.registry}" + ("" if Path(args.registry).is_dir() else
                                                            " (the folder does not exist)"))
        for problem in unreadable:
            print(f"decentral: {' '.join(problem.split())}", file=sys.stderr)
        return 2 if unreadable else 0
    from decentral.experts.sharing import ExpertSharing

    peer = _peer(args)
    try:
        found = ExpertSharing(peer, Registry(args.registry)).available()
    finally:
        peer.shutdown()
    rows = [_describe(v.expert, len(v.peers)) for versions in found.values() for v in versions]
    print(format_table([header + ["publishers"]] + rows, numeric=False) if rows else "nobody in the swarm publishes experts")
    return 0


def cmd_publish(args) -> int:
    from decentral.experts.sharing import ExpertSharing
    from decentral.swarm.reach import warn_if_unreachable

    registry = Registry(args.registry)
    names = args.names or registry.names()
    if not names:
        raise RegistryError(f"no experts in {args.registry} to publish")
    for name in names:  # a name that is not there is refused before the swarm starts
        registry.get(name)
    peer = _peer(args)
    warn_if_unreachable(peer, args.join)  # fetchers must be able to reach us
    sharing = ExpertSharing(peer, registry)
    try:
        for expert in sharing.publish(names):
            print(f"experts: publishing {expert.name} ({expert.sha256[:12]}, {expert.size / 2**20:.1f} MiB)")
        print("experts: others fetch with:")
        for maddr in peer.multiaddrs():
            print(f"  decentral experts fetch {' '.join(names)} --join {maddr} --run {args.run}")
        serve_until_stopped()
    finally:
        sharing.close()
        peer.shutdown()
    return 0


def cmd_fetch(args) -> int:
    from decentral.experts.sharing import ExpertSharing

    if not args.join:
        raise RegistryError("fetch needs --join: the multiaddr of any peer of the swarm that publishes")
    if args.sha256 and len(args.names) > 1:  # (one version's hash: every other name would match none)
        raise RegistryError(f"--sha256 picks the version of one expert: fetch {args.names[0]} with it on its own")
    registry = Registry(args.registry)
    for name in _distinct(args.names, "fetch"):
        _check_new_expert(registry, name, args.replace)
    peer = _peer(args)
    sharing = ExpertSharing(peer, registry)
    try:
        found = [sharing.find(name, sha256=args.sha256) for name in args.names]  # every one, before any is fetched
        for name, published in zip(args.names, found):
            total = sum(size for _, size in published.files(with_optimizer=not args.no_optimizer).values())
            with progress_bar(total, f"fetch {name}", "B", unit_scale=True) as bar:
                expert = sharing.download(published, with_optimizer=not args.no_optimizer, progress=bar.update)
            print(f"experts: fetched {expert.name} ({expert.sha256[:12]}, hash checked) into {expert.folder}", flush=True)
    finally:
        sharing.close()
        peer.shutdown()
    return 0


def _cluster_of(expert) -> int | None:
    """j when the expert's domain is cluster cJ of `experts cluster` (its one --domain cJ or cJ=PATH), else None."""
    name, _, paths = (expert.domain or "").partition("=")
    return int(name[1:]) if CLUSTER_FOLDER.fullmatch(name) and "=" not in paths else None


def _load_router(path: str, experts: list) -> tuple:
    """(the c-BTM router at `path`, `experts` in its cluster order); RegistryError when the file is not a router or
    its cluster count is not the number of experts. Experts whose domains all name its clusters are put in cluster
    order; otherwise each whose domain names a cluster must be at that cluster's place."""
    from decentral.experts.clusters import Router

    try:
        router = Router.load(path)
    except OSError as e:
        raise RegistryError(f"--router {path}: cannot be read ({e.strerror})") from None
    except ValueError as e:
        raise RegistryError(f"--router {e}") from None
    if router.k != len(experts):
        raise RegistryError(f"--router {path} has {router.k} clusters but {len(experts)} experts are given: name one "
                            "expert per cluster, in cluster order")
    clusters = [_cluster_of(e) for e in experts]
    if sorted(c for c in clusters if c is not None) == list(range(router.k)):
        ordered = [e for _, e in sorted(zip(clusters, experts), key=lambda pair: pair[0])]
        if ordered != experts:
            print("experts: in the router's cluster order, as their domains say: "
                  + ", ".join(f"{e.name} (c{j})" for j, e in enumerate(ordered)), file=sys.stderr, flush=True)
        return router, ordered
    for j, (expert, cluster) in enumerate(zip(experts, clusters)):
        if cluster is not None and cluster != j:
            raise RegistryError(f"--router: expert {expert.name!r} is given for cluster c{j} but trained on c{cluster} "
                                "(its domain): give one expert per cluster, in cluster order")
    return router, experts


def cmd_eval(args) -> int:
    from decentral.data.domains import load_domains
    from decentral.experts.ensemble import PriorCache
    from decentral.experts.evaluate import EvalConfig, ensemble_report, format_report, score_experts

    if args.router:
        _check_sklearn()  # (routing needs it: before anything, not once every expert is scored)
    registry = Registry(args.registry)
    if args.experts is not None and "" in args.experts.split(","):
        raise RegistryError(f"--experts {args.experts!r}: an empty name (names are separated by single commas)")
    names = _distinct(args.experts.split(","), "--experts") if args.experts is not None else registry.names()
    experts = [registry.get(name) for name in names]
    if not experts:
        raise RegistryError(f"no experts in {args.registry}")
    if not args.domain:
        raise RegistryError("give the domains to evaluate on with --domain")
    if args.top_k is not None and args.top_k >= len(experts):
        raise RegistryError(f"--top-k {args.top_k} keeps every one of the {len(experts)} experts: give fewer")
    router = None
    if args.router:
        router, experts = _load_router(args.router, experts)
    for expert in experts:  # before any work: the weights scored, and priors cached under their sha256, are the recorded
        verify_expert(expert, with_optimizer=False)
    domains = load_domains(args.domain)
    contexts = {e.name: e.context for e in experts}
    context = min(contexts.values())  # every expert scores the same windows: the shortest context's
    if len(set(contexts.values())) > 1:
        print(f"experts: windows of {context} tokens, the shortest context of "
              + ", ".join(f"{name} {c}" for name, c in contexts.items()), file=sys.stderr, flush=True)
    config = EvalConfig(context=context, test_batches=args.batches, mode=args.mode, top_k=args.top_k)
    scores = score_experts(experts, domains, config,
                           progress=lambda e: print(f"experts: scored {e.name}", file=sys.stderr, flush=True))
    report = ensemble_report(experts, domains, scores, config, PriorCache(registry.root / "priors.json"))
    if router is not None:
        from decentral.experts.evaluate import routed_report

        routed = routed_report(router, domains, scores, config)
        for name, row in routed.items():
            report[name]["perplexity"]["c-BTM routed" + (f" top-{args.top_k}" if args.top_k else "")] = row["perplexity"]
    print(format_report(report, experts))
    return 0


def _old_clusters(out: Path, replace: bool) -> list[Path]:
    """The clusters and router an earlier `experts cluster` left in `out`, for a `replace` to remove; RegistryError
    when `out` is a file, or holds anything and not `replace`."""
    if out.exists() and not out.is_dir():
        raise RegistryError(f"--out {out} is a file, not a folder")
    held = sorted(out.iterdir()) if out.is_dir() else []
    if held and not replace:
        raise RegistryError(f"--out {out} is not empty (it holds {', '.join(p.name for p in held[:3])}"
                            f"{', ...' if len(held) > 3 else ''}): give a new folder, or --replace to replace the "
                            "clusters in it")
    return [p for p in held if (p.is_dir() and CLUSTER_FOLDER.fullmatch(p.name)) or p.name == ROUTER_FILE]


def _check_sklearn() -> None:
    """RegistryError (one line, exit 2) where c-BTM's clustering and routing cannot run: scikit-learn is missing."""
    from decentral.experts.clusters import check_sklearn

    try:
        check_sklearn()
    except ImportError as e:
        raise RegistryError(str(e)) from None


def cmd_cluster(args) -> int:
    from decentral.data.corpus import load_documents
    from decentral.experts.clusters import fit_router

    _check_sklearn()
    out = Path(args.out)
    old = _old_clusters(out, args.replace)
    documents, source = load_documents(args.data, max_bytes=args.max_bytes)
    if len(documents) < 2 * args.k:
        raise RegistryError(f"{len(documents)} documents from {source} are too few for {args.k} clusters")
    print(f"experts: clustering {len(documents)} documents from {source} into {args.k}", file=sys.stderr, flush=True)
    try:
        router, assignment = fit_router([d.text.decode("utf-8", "replace") for d in documents], args.k,
                                        seed=args.seed)
    except ValueError as e:  # (text with too few distinct words to embed)
        raise RegistryError(f"cannot cluster the documents from {source}: {e}") from None
    for path in old:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    for j in range(args.k):
        (out / f"c{j}").mkdir(parents=True, exist_ok=True)
    for document, cluster in zip(documents, assignment):
        (out / f"c{cluster}" / f"{document.key[:16]}{document.path.suffix if document.path.suffix != '.gz' else ''}"
         ).write_bytes(document.text)
    router.save(out / ROUTER_FILE)
    for j in range(args.k):
        members = [d for d, c in zip(documents, assignment) if c == j]
        print(f"c{j}: {len(members)} documents, {sum(len(d.text) for d in members) / 2**20:.1f} MiB, e.g. {members[0].path}")
    print(f"experts: router in {out / ROUTER_FILE}; train one expert per cluster with --domain cJ={out}/cJ")
    return 0


def cmd_merge(args) -> int:
    from decentral.merge import load_merge_recipe, merge

    out = Path(args.out)
    _check_new_expert(Registry(out.parent), out.name, args.replace)
    recipe = load_merge_recipe(args.recipe, registry=args.registry)
    if args.verify:
        recipe.verify = True
    expert = merge(recipe, out)
    if recipe.method.uses_weights or recipe.method.weights_from:
        inputs = ", ".join(f"{e['name']} {e['weight']:.3g}" for e in expert.merge["experts"])
    else:  # the mix is set by parameters (slerp's t) or by the geometry (model stock)
        inputs = ", ".join(e["name"] for e in expert.merge["experts"])
        if recipe.parameters:
            inputs += f" ({', '.join(f'{name} {value:g}' for name, value in recipe.parameters.items())})"
    print(f"merge: {recipe.method.name} of {inputs} -> {expert.folder} ({expert.sha256[:12]})")
    return 0


def add_merge_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="a shipped merge recipe by name (ties: merges/ties.yaml) or a recipe file")
    p.add_argument("--out", required=True, help="the merged expert's folder (its name is the expert's name)")
    p.add_argument("--registry", help="folder of experts that names in the recipe refer to (default: the recipe's)")
    p.add_argument("--verify", action="store_true", help="check every input's sha256 against its expert.json "
                   "(as the recipe's `verify: true` does)")
    _replace_argument(p)
    p.set_defaults(func=cmd_merge)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="experts_command", required=True)

    def command(name: str, help: str, command_line: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, **example(command_line))
        p.set_defaults(func=func)
        return p

    seed = command("seed", "train the seed model on all domains with balanced batches, for a share of the budget",
                   "decentral experts seed --domain code --domain legal --domain manuals --steps 600 --batch-size 48",
                   cmd_seed)
    seed.add_argument("--share", type=float, default=0.5, help="the seed's share of the schedule (default 0.5)")
    seed.add_argument("--as", dest="expert", default="seed", help="its name in the registry (default: seed)")

    branch = command("branch", "train an expert on its domain, starting from one expert or a posterior-weighted "
                     "average of several", "decentral experts branch legal --from seed --domain legal", cmd_branch)
    branch.add_argument("expert", help="the new expert's name in the registry")
    branch.add_argument("--from", dest="parent", action="append", required=True, metavar="EXPERT",
                        help="the parent expert; several: start from their average weighted by the new domain's "
                             "posterior on its dev split")
    branch.add_argument("--with-optimizer", action="store_true",
                        help="keep the inner optimizer state in the registry (for experts others branch from)")
    for p in (seed, branch):
        p.add_argument("--protocol", default="local", help="how the model trains: local (alone, the default) or a "
                       "swarm recipe (protocols/*.yaml) with --join")
        p.add_argument("--out", help="the training run's folder (default: runs/btm/NAME)")
        _registry_argument(p)
        _replace_argument(p)
        add_worker_arguments(p)
        p.set_defaults(name=None)  # the name in logs: the expert's

    add = command("add", "add a `decentral train` checkpoint to the registry",
                  "decentral experts add runs/train/checkpoint --name code --domain-name code", cmd_add)
    add.add_argument("checkpoint", help="a checkpoint folder (a run's OUT/checkpoint)")
    add.add_argument("--name", required=True, help="its name in the registry")
    add.add_argument("--domain-name", help="the domain it was trained on (default: the --domain values its run "
                     "trained on, as its checkpoint records them)")
    add.add_argument("--with-optimizer", action="store_true", help="keep the inner optimizer state too")
    _registry_argument(add)
    _replace_argument(add)

    lister = command("list", "list the experts of the registry, or with --join those a swarm publishes",
                     "decentral experts list --join /ip4/203.0.113.5/tcp/31337/p2p/Qm...", cmd_list)
    publish = command("publish", "publish experts of the registry to a swarm and serve them until Ctrl-C",
                      "decentral experts publish code legal --host 0.0.0.0 --announce-host 203.0.113.5 --port 31337",
                      cmd_publish)
    publish.add_argument("names", nargs="*", help="experts to publish (default: all)")
    fetch = command("fetch", "download experts a swarm publishes into the registry, checked against their sha256",
                    "decentral experts fetch code legal --join /ip4/203.0.113.5/tcp/31337/p2p/Qm...", cmd_fetch)
    fetch.add_argument("names", nargs="+", help="the experts to fetch, by name")
    fetch.add_argument("--sha256", help="which version, when publishers disagree (a prefix is enough)")
    fetch.add_argument("--no-optimizer", action="store_true", help="skip the inner optimizer state")
    _replace_argument(fetch)
    for p in (lister, publish, fetch):
        _registry_argument(p)
        add_network_arguments(p, run_default="decentral")
        p.set_defaults(run="decentral")

    evaluate = command("eval", "test perplexity of experts and their ensembles on each domain (priors from dev data)",
                       "decentral experts eval --experts code,legal,manuals --domain code --domain legal --top-k 2",
                       cmd_eval)
    evaluate.add_argument("--experts", help="comma-separated names (default: every expert in the registry)")
    evaluate.add_argument("--domain", action="append", metavar="NAME[=PATH]", help="a domain to evaluate on (repeatable)")
    evaluate.add_argument("--mode", choices=("previous", "prefix"), default="previous",
                          help="the posterior from the previous token (default) or the whole prefix")
    evaluate.add_argument("--top-k", type=positive_int, help="also report the ensemble of the k experts with the "
                          "largest prior (k below the number of experts)")
    evaluate.add_argument("--batches", type=positive_int, default=16, help="test batches per domain")
    evaluate.add_argument("--router", help="c-BTM: also route by this router (decentral experts cluster); --experts "
                          "must then name one expert per cluster, in cluster order (experts trained on --domain cJ "
                          "are put in that order)")
    _registry_argument(evaluate)

    cluster = command("cluster", "c-BTM: cluster unlabelled documents (tf-idf, SVD, balanced k-means) into one folder "
                      "per cluster, plus a router", "decentral experts cluster --data mytexts/ --k 4 --out runs/cbtm/clusters",
                      cmd_cluster)
    cluster.add_argument("--data", action="append", required=True, metavar="PATH", help="text files or folders")
    cluster.add_argument("--k", type=positive_int, required=True, help="number of clusters (experts)")
    cluster.add_argument("--out", required=True, help="a new or empty folder: writes OUT/c0 ... OUT/c{k-1} and "
                         "OUT/router.npz")
    cluster.add_argument("--replace", action="store_true", help="replace the clusters and router of an earlier run "
                         "in --out (other files there stay)")
    cluster.add_argument("--max-bytes", type=positive_int, default=8_000_000, help="read at most this much text")
    cluster.add_argument("--seed", type=int, default=0, help="random seed of the clustering (default 0)")
