"""`decentral bench btm`: branch-train-merge against a dense model of the same training compute.

Compute is matched the way the BTM paper matches it (Li et al. 2022, §4: the dense model trains on
all the GPUs, each expert on its share of them, for the same number of steps): with k training
domains, b sequences per expert step and a schedule of S + B inner steps (ALGORITHMS.md §6), per seed
- seed: S steps of k·b sequences, balanced over the k domains (`decentral experts seed`), the first
  part of an (S + B)-step schedule;
- experts: one per domain, from the seed's weights, optimizer state and step on to S + B with b
  sequences of its domain a step (`decentral experts branch`);
- dense: S + B steps of k·b sequences, balanced over all domains: k·b·(S + B) sequences, like the
  seed and the k experts together;
- no-seed experts: S + B steps of b sequences each on its domain from their own random start: the
  same compute again, without the shared seed phase.
Every model trains as its own `decentral train` process (`--jobs` at a time); each runs alone, as an
expert would on its own machine. Then every model, ensemble and merge is scored on the test split of
each training domain and of a held-out domain (priors from each domain's dev split): the BTM
ensemble (previous-token posterior, the default, and full-prefix), the mixture by the domain's prior
and the uniform one, the uniform parameter average, the posterior-weighted parameter average
(weights = the domain's prior), and for the no-seed experts their ensemble and uniform average.
Writes OUT/results.json and OUT/btm.png and prints the test perplexities, mean ± std over seeds,
and the ratios the targets are about.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from decentral.cli import interrupting, positive_int, stop_processes
from decentral.config import RecipeError, default_recipe_path, load_recipe
from decentral.data.domains import BUILTIN_DOMAINS, load_domains, parse_domain
from decentral.experts.ensemble import PriorCache, ensemble_nll
from decentral.experts.evaluate import DomainScores, EvalConfig, domain_prior, perplexity, score_experts
from decentral.experts.registry import Registry
from decentral.merge import merge, parse_merge_recipe
from decentral.metrics import format_table, results_folder

PLOTTED = ("dense", "BTM ensemble", "BTM ensemble (prefix)", "BTM posterior average", "BTM uniform average",
           "no-seed ensemble", "no-seed uniform average")
ROWS = ("dense", "expert", "BTM ensemble", "BTM ensemble (prefix)", "BTM prior mixture", "BTM uniform mixture",
        "BTM posterior average", "BTM uniform average", "no-seed ensemble", "no-seed uniform average")  # table order


@dataclasses.dataclass
class Job:
    name: str
    cmd: list[str]
    after: tuple[str, ...] = ()


def run_jobs(jobs: list[Job], out: Path, parallel: int) -> dict[str, int]:
    """Run `jobs` as subprocesses, at most `parallel` (>= 1) at once, each after the jobs it names; returns exit
    codes (a job whose dependency failed is skipped, code None). Logs go to OUT/NAME.log. Call it from the main
    thread: SIGTERM interrupts it as Ctrl-C does, and either terminates the jobs still running (SIGTERM: a training
    job saves its checkpoint) before KeyboardInterrupt goes on."""
    codes: dict[str, int | None] = {}
    running: dict[str, subprocess.Popen] = {}
    waiting = list(jobs)
    try:
        with interrupting(signal.SIGTERM):
            while waiting or running:
                for job in [j for j in waiting if all(codes.get(a) == 0 for a in j.after)][: parallel - len(running)]:
                    waiting.remove(job)
                    with open(out / f"{job.name}.log", "w") as log:  # its own session: Ctrl-C reaches us, not it
                        running[job.name] = subprocess.Popen(job.cmd, stdout=log, stderr=subprocess.STDOUT,
                                                             start_new_session=True)
                    print(f"bench btm: started {job.name}", flush=True)
                for job in [j for j in waiting if any(a in codes and codes[a] != 0 for a in j.after)]:
                    waiting.remove(job)
                    codes[job.name] = None
                    print(f"bench btm: skipped {job.name} (a job it needs failed)", flush=True)
                for name, proc in list(running.items()):
                    if proc.poll() is not None:
                        codes[name] = proc.returncode
                        del running[name]
                        failed = f"FAILED ({proc.returncode}), see {out / name}.log"
                        outcome = "done" if proc.returncode == 0 else failed
                        print(f"bench btm: {name} {outcome}", flush=True)
                if running:
                    time.sleep(0.5)  # polling child processes
            return codes
    finally:
        if running:
            print(f"bench btm: stopping {', '.join(running)}", file=sys.stderr, flush=True)
            stop_processes(running.values())


def plan_seed(out: Path, seed: int, domains: list[str], seed_steps: int, branch_steps: int) -> list[Job]:
    """The training jobs of one seed; the recipe is protocols/local.yaml with `train.seed = seed`, its
    batch size b is each expert's and k·b the seed's and the dense model's."""
    recipe = load_recipe(default_recipe_path("local")).to_dict()
    recipe["train"].update(seed=seed, eval_every=100)
    out.mkdir(parents=True, exist_ok=True)
    recipe_file = out / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe, sort_keys=False))
    cli = [sys.executable, "-m", "decentral"]
    common = ["--protocol", str(recipe_file)]
    each = [a for d in domains for a in ("--domain", d)]
    registry = ["--registry", str(out / "experts")]
    total = str(seed_steps + branch_steps)
    batch, wide = recipe["train"]["batch_size"], str(len(domains) * recipe["train"]["batch_size"])
    jobs = [Job("seed", cli + ["experts", "seed", *each, "--steps", total, "--share", str(seed_steps / int(total)),
                              "--batch-size", wide, "--out", str(out / "seed"), *registry, *common]),
            Job("dense", cli + ["train", *each, "--steps", total, "--batch-size", wide, "--out", str(out / "dense"),
                                *common])]
    jobs += [Job(f"expert-{d}", cli + ["experts", "branch", d, "--from", "seed", "--domain", d, "--batch-size",
                                       str(batch), "--out", str(out / d), *registry, *common], after=("seed",))
             for d in domains]
    jobs += [Job(f"noseed-{d}", cli + ["train", "--domain", d, "--steps", total, "--out", str(out / f"noseed-{d}"),
                                       *common]) for d in domains]
    return jobs


def _merged(registry: Registry, name: str, experts: list, method: str = "linear", **parameters):
    recipe = parse_merge_recipe({"method": method, "experts": [str(e.folder.resolve()) for e in experts],
                                 "parameters": parameters}, f"the bench's {name}")
    return merge(recipe, registry.folder(name), progress=False)


def evaluate_seed(out: Path, train_domains: list[str], heldout: str, config: EvalConfig) -> dict[str, dict[str, float]]:
    """{method: {domain: test perplexity}} for one seed's trained models."""
    registry = Registry(out / "experts")
    registry.add_checkpoint(out / "dense" / "checkpoint", "dense")
    for d in train_domains:
        registry.add_checkpoint(out / f"noseed-{d}" / "checkpoint", f"noseed-{d}", d)
    domains = load_domains([*train_domains, heldout])
    experts = [registry.get(d) for d in train_domains]
    noseed = [registry.get(f"noseed-{d}") for d in train_domains]
    k = len(experts)
    merged = [_merged(registry, "uniform", experts), _merged(registry, "noseed-uniform", noseed)]
    cache = PriorCache(registry.root / "priors.json")
    models = [registry.get("dense"), *experts, *noseed, *merged]
    scores = score_experts(models, domains, config)
    rows: dict[str, dict[str, float]] = {}

    def put(method: str, domain: str, value: float) -> None:
        rows.setdefault(method, {})[domain] = value

    posterior_models = []
    for domain in domains:
        s = scores[domain.name]
        part = lambda lo, hi: DomainScores(s.dev[lo:hi], s.test[lo:hi])  # noqa: E731
        btm, ns = part(1, 1 + k), part(1 + k, 1 + 2 * k)
        prior = domain_prior(experts, domain, config, cache, btm)
        ns_prior = domain_prior(noseed, domain, config, cache, ns)
        put("dense", domain.name, perplexity(float(-s.test[0].mean())))
        for j, expert in enumerate(experts):
            put(f"expert {expert.name}", domain.name, perplexity(float(-btm.test[j].mean())))
        put("BTM ensemble", domain.name, perplexity(ensemble_nll(btm.test, prior, "previous")))
        put("BTM ensemble (prefix)", domain.name, perplexity(ensemble_nll(btm.test, prior, "prefix")))
        put("BTM prior mixture", domain.name, perplexity(ensemble_nll(btm.test, prior, posterior=False)))
        put("BTM uniform mixture", domain.name, perplexity(ensemble_nll(btm.test, torch.full((k,), 1 / k), posterior=False)))
        put("BTM uniform average", domain.name, perplexity(float(-s.test[1 + 2 * k].mean())))
        put("no-seed ensemble", domain.name, perplexity(ensemble_nll(ns.test, ns_prior, "previous")))
        put("no-seed uniform average", domain.name, perplexity(float(-s.test[2 + 2 * k].mean())))
        posterior_models.append((domain, _merged(registry, f"posterior-{domain.name}", experts, "posterior",
                                                 domain=domain.name)))
    for domain, model in posterior_models:
        score = score_experts([model], [domain], config, splits=("test",))[domain.name]
        put("BTM posterior average", domain.name, perplexity(float(-score.test.mean())))
    return dict(sorted(rows.items(), key=lambda row: ROWS.index(row[0].split()[0] if row[0].startswith("expert ")
                                                                 else row[0])))


def aggregate(per_seed: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """{method: {domain: {"mean", "std", "values"}}} over seeds."""
    out: dict[str, dict[str, dict]] = {}
    for method in per_seed[0]:
        for domain in per_seed[0][method]:
            values = [rows[method][domain] for rows in per_seed]
            out.setdefault(method, {})[domain] = {"mean": statistics.fmean(values), "values": values,
                                                  "std": statistics.stdev(values) if len(values) > 1 else 0.0}
    return out


def targets(summary: dict, train_domains: list[str]) -> dict[str, dict[str, float]]:
    """The issue's ratios per domain: ensemble / dense (target ≤ 0.95 on every training domain) and
    posterior average / uniform average (target < 1), on the means over seeds."""
    mean = lambda method, d: summary[method][d]["mean"]  # noqa: E731
    domains = list(summary["dense"])
    return {
        "ensemble / dense": {d: mean("BTM ensemble", d) / mean("dense", d) for d in domains},
        "ensemble (prefix) / dense": {d: mean("BTM ensemble (prefix)", d) / mean("dense", d) for d in domains},
        "posterior avg / uniform avg": {d: mean("BTM posterior average", d) / mean("BTM uniform average", d) for d in domains},
        "no-seed uniform avg / BTM uniform avg": {d: mean("no-seed uniform average", d) / mean("BTM uniform average", d)
                                                  for d in domains},
    }


def format_results(summary: dict, ratios: dict, heldout: str) -> str:
    domains = list(summary["dense"])
    seeds = len(summary["dense"][domains[0]]["values"])
    cell = (lambda s: f"{s['mean']:.3f} ± {s['std']:.3f}") if seeds > 1 else (lambda s: f"{s['mean']:.3f}")
    header = [f"test perplexity ({'mean ± std' if seeds > 1 else 'one seed'})"] + [
        f"{d} (held out)" if d == heldout else d for d in domains]
    rows = [header] + [[m] + [cell(summary[m][d]) for d in domains] for m in summary]
    rows += [[name] + [f"{values[d]:.3f}" for d in domains] for name, values in ratios.items()]
    return format_table(rows)


def plot(summary: dict, heldout: str, out_png: Path) -> Path:
    from matplotlib.figure import Figure

    domains = list(summary["dense"])
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(PLOTTED)
    for i, method in enumerate(PLOTTED):
        xs = [j + (i - (len(PLOTTED) - 1) / 2) * width for j in range(len(domains))]
        ax.bar(xs, [summary[method][d]["mean"] for d in domains], width, yerr=[summary[method][d]["std"] for d in domains],
               label=method, color=f"C{i}", capsize=2)
    ax.set_xticks(range(len(domains)), [f"{d}\n(held out)" if d == heldout else d for d in domains])
    ax.set_yscale("log")
    ax.set_ylabel("test perplexity per byte (log scale)")
    ax.set_title("branch-train-merge vs dense at equal training compute")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    fig.savefig(out_png, dpi=120)
    return out_png


def check_domains(domains: list[str], heldout: str) -> None:
    """RecipeError unless `domains` are two or more distinct built-in domains and `heldout` another one."""
    for name in [*domains, heldout]:
        if parse_domain(name)[1] is not None:  # DataError for a name that is not a domain
            raise RecipeError(f"bench btm: {name!r}: give built-in domain names ({', '.join(BUILTIN_DOMAINS)})")
    if len(domains) < 2:
        raise RecipeError(f"bench btm: --domains {','.join(domains)}: a seed and its experts need two or more domains")
    if len(set(domains)) < len(domains):
        raise RecipeError(f"bench btm: --domains {','.join(domains)} names a domain twice")
    if heldout in domains:
        raise RecipeError(f"bench btm: --heldout {heldout} is one of --domains; the held-out domain is one no model "
                          "trains on")


def run_btm_bench(args: argparse.Namespace) -> int:
    if args.report:
        results = Path(args.report) / "results.json"
        if not results.is_file():
            raise RecipeError(f"bench btm: --report {args.report}: no results.json there (a run that did not finish?)")
        try:
            saved = json.loads(results.read_text())
        except (OSError, ValueError) as e:
            raise RecipeError(f"bench btm: cannot read {results}: {e}") from None
        if not isinstance(saved, dict) or not {"summary", "ratios", "heldout", "wall_s"} <= saved.keys():
            raise RecipeError(f"bench btm: {results} is not a `decentral bench btm` run's results")
        return report(saved, Path(args.report))
    out = Path(args.out)
    domains = args.domains.split(",")
    check_domains(domains, args.heldout)
    with results_folder(out, "bench btm", refuse=lambda folder: _refuse_a_previous_run(folder, args.seeds)):
        return _run(args, out, domains)


def _refuse_a_previous_run(out: Path, seeds: int) -> None:
    previous = [path for path in [out / "results.json", *(out / f"seed{seed}" for seed in range(seeds))]
                if path.exists()]
    if previous:
        redraw = f", or redraw its results with --report {out}" if (out / "results.json").is_file() else ""
        raise RecipeError(f"bench btm: --out {out} holds a previous run ({previous[0]}): give another --out{redraw}")


def _run(args: argparse.Namespace, out: Path, domains: list[str]) -> int:
    start = time.monotonic()
    per_seed = []
    for seed in range(args.seeds):
        seed_out = out / f"seed{seed}"
        jobs = plan_seed(seed_out, seed, domains, args.seed_steps, args.branch_steps)
        codes = run_jobs(jobs, seed_out, args.jobs)
        if any(code != 0 for code in codes.values()):
            print(f"bench btm: seed {seed} failed: {codes}", file=sys.stderr)
            return 1
        per_seed.append(evaluate_seed(seed_out, domains, args.heldout, EvalConfig(test_batches=args.test_batches)))
        print(f"bench btm: seed {seed} evaluated ({time.monotonic() - start:.0f}s so far)", flush=True)
    summary = aggregate(per_seed)
    ratios = targets(summary, domains)
    results = {
        "date": dt.date.today().isoformat(), "machine": f"{platform.machine()}, {platform.processor() or ''}".strip(", "),
        "command": " ".join(sys.argv), "domains": domains, "heldout": args.heldout, "seeds": args.seeds,
        "seed_steps": args.seed_steps, "branch_steps": args.branch_steps, "wall_s": time.monotonic() - start,
        "per_seed": per_seed, "summary": summary, "ratios": ratios,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return report(results, out)


def report(results: dict, out: Path) -> int:
    """Print the table and draw OUT/btm.png from a run's results."""
    plot(results["summary"], results["heldout"], out / "btm.png")
    print(format_results(results["summary"], results["ratios"], results["heldout"]))
    print(f"bench btm: {results['wall_s']:.0f}s; results {out / 'results.json'}, plot {out / 'btm.png'}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--domains", default="code,legal,manuals", help="training domains, comma-separated")
    parser.add_argument("--heldout", default="changelogs", help="a domain no model trains on")
    parser.add_argument("--seed-steps", type=positive_int, default=500, help="S: the seed phase's inner steps")
    parser.add_argument("--branch-steps", type=positive_int, default=500,
                        help="B: each expert's inner steps after the seed")
    parser.add_argument("--seeds", type=positive_int, default=3,
                        help="repeat with this many seeds; tables show mean ± std")
    parser.add_argument("--jobs", type=positive_int, default=2, help="training processes at a time")
    parser.add_argument("--test-batches", type=positive_int, default=32,
                        help="test batches (16 × 128 bytes) per domain")
    parser.add_argument("--out", default="runs/bench-btm", help="a new folder, or one without a previous run")
    parser.add_argument("--report", metavar="DIR", help="run nothing: redo the table and plot of DIR/results.json")
    parser.set_defaults(func=run_btm_bench)
