"""Expert folders and the registry; seed → branch → train → ensemble through the real CLI."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_MODEL, TINY_TRAIN, kill_leftovers
from decentral.btmbench import aggregate, format_results
from decentral.checkpoint import load_checkpoint
from decentral.cli import main
from decentral.data.domains import balanced_eval_batches, load_domains
from decentral.experts.ensemble import ensemble_nll, estimate_prior, score_batches
from decentral.experts.registry import (
    Expert, Registry, RegistryError, model_bytes, model_sha256, read_expert, verify_expert, write_expert,
)
from decentral.models import GPT, GPTConfig

import yaml


def tiny_expert(folder, name="e", seed=0):
    torch.manual_seed(seed)
    config = GPTConfig(n_layer=1, n_head=2, d_model=16, context=16)
    state = GPT(config).state_dict()
    meta = Expert(name=name, sha256="", size=0, model=dataclasses.asdict(config), domain="d")
    return write_expert(folder / name, lambda path: path.write_bytes(model_bytes(state)), meta), state


def test_expert_folder_round_trip_and_hash(tmp_path):
    expert, state = tiny_expert(tmp_path)
    again = read_expert(tmp_path / "e")
    assert again == expert and again.sha256 == model_sha256(state)
    model = again.load_model(verify=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    data = bytearray((tmp_path / "e" / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (tmp_path / "e" / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(RegistryError, match="does not match its recorded sha256"):
        verify_expert(read_expert(tmp_path / "e"))


def test_a_damaged_optimizer_state_fails_a_full_check_but_not_one_of_the_weights_that_eval_and_merge_use(tmp_path):
    """eval, a merge and a branch from several parents read the weights alone: a damaged optimizer.safetensors
    refused them, after hashing a file twice the weights' size for nothing."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, context=16))
    optimizer = ({f"state.{k}": torch.zeros_like(v) for k, v in model.state_dict().items()}, [{"lr": 1e-3}])
    meta = Expert(name="e", sha256="", size=0, model=dataclasses.asdict(model.config), domain="d")
    write_expert(tmp_path / "e", lambda path: path.write_bytes(model_bytes(model.state_dict())), meta, optimizer)
    state_file = tmp_path / "e" / "optimizer.safetensors"
    state_file.write_bytes(b"\0" * state_file.stat().st_size)
    expert = read_expert(tmp_path / "e")
    verify_expert(expert, with_optimizer=False)
    expert.load_model(verify=True)
    with pytest.raises(RegistryError, match="optimizer.safetensors does not match its recorded sha256"):
        verify_expert(expert)


_KILLED_BETWEEN_RENAMES = """
import os, signal, sys
from pathlib import Path
from decentral.experts import registry
renames = []
def replace(source, target):
    renames.append(source)
    if len(renames) == 2:  # the old version is set aside, the new one not yet in its place
        os.kill(os.getpid(), signal.SIGKILL)
    os.rename(source, target)
registry.os.replace = replace
with registry.staging(Path(sys.argv[1])) as tmp:
    (tmp / "expert.json").write_text("{}")
"""


@pytest.mark.parametrize("first_look", ["names", "get"])
def test_an_expert_whose_replacement_was_killed_between_its_two_renames_is_put_back(tmp_path, first_look):
    """`staging` sets the old folder aside (a hidden `.e.old-*`), then renames the new one into its place: a
    process killed between the two left the expert missing from the registry for good ("no expert 'e'")."""
    expert, _ = tiny_expert(tmp_path / "reg")
    killed = subprocess.run([sys.executable, "-c", _KILLED_BETWEEN_RENAMES, str(tmp_path / "reg" / "e")])
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "reg" / "e").exists()
    registry = Registry(tmp_path / "reg")
    if first_look == "names":
        assert registry.names() == ["e"]
    assert registry.get("e") == expert
    verify_expert(registry.get("e"))
    assert registry.names() == ["e"] and sorted(p.name for p in (tmp_path / "reg").iterdir())[-1] == "e"


def test_failed_write_leaves_nothing_and_bad_folders_are_clear(tmp_path):
    tiny_expert(tmp_path)

    def broken(path):
        path.write_bytes(b"half")
        raise OSError("disk full")

    meta = Expert(name="e", sha256="", size=0, model={})
    with pytest.raises(OSError):
        write_expert(tmp_path / "e", broken, meta)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]  # the old expert stands, no temp folder is left
    verify_expert(read_expert(tmp_path / "e"))
    registry = Registry(tmp_path)
    with pytest.raises(RegistryError, match="no expert 'nope'.*there: e"):
        registry.get("nope")
    with pytest.raises(RegistryError, match="name"):
        registry.get("../e")
    (tmp_path / "e" / "expert.json").write_text("{not json")
    with pytest.raises(RegistryError, match="not valid JSON"):
        registry.get("e")
    with pytest.raises(RegistryError, match=f"registry {tmp_path / 'e' / 'expert.json'} is a file, not a folder"):
        Registry(tmp_path / "e" / "expert.json")


def run_cli(prefork, *args, cwd):
    done = prefork.run(args, cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_seed_branch_train_ensemble_end_to_end(tmp_path, prefork):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({"protocol": {"name": "local"}, "model": TINY_MODEL,
                                      "train": {**TINY_TRAIN, "steps": 80, "eval_every": 20}}))
    common = ["--protocol", str(recipe), "--registry", "reg"]
    run_cli(prefork, "experts", "seed", "--domain", "code", "--domain", "legal", "--share", "0.5", *common, cwd=tmp_path)
    for name in ("code", "legal"):
        own = ["--set", "train.eval_every=10"] if name == "code" else []  # (the seed's schedule, but for this)
        out = run_cli(prefork, "experts", "branch", name, "--from", "seed", "--domain", name, *common, *own,
                      cwd=tmp_path)
        assert "AdamW starts fresh" not in out  # the seed keeps its optimizer state

    registry = Registry(tmp_path / "reg")
    seed, code, legal = registry.get("seed"), registry.get("code"), registry.get("legal")
    assert code.recipe["train"]["eval_every"] == 10 and legal.recipe["train"]["eval_every"] == 20  # (--set was lost)
    assert seed.steps == 40 and seed.optimizer is not None and seed.parent is None
    for expert in (code, legal):
        verify_expert(expert)
        assert expert.parent == seed.sha256 and expert.start_step == 40 and expert.steps == 80
        assert expert.tokens == 80 * TINY_TRAIN["batch_size"] * TINY_TRAIN["context"]
    # the branch continued the seed's optimizer and schedule: AdamW has taken 80 steps, metrics start at 41
    tensors, meta = load_checkpoint(tmp_path / "runs/btm/legal/checkpoint")
    assert int(tensors["inner.0.step"]) == 80
    records = [json.loads(line) for line in (tmp_path / "runs/btm/legal/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][0] == 41
    assert meta["lineage"]["parent"] == seed.sha256
    seed_model = load_file(seed.model_file)
    assert not all(torch.equal(seed_model[k], v) for k, v in load_file(code.model_file).items())

    # each expert is best on its own domain, and the ensemble beats the worse expert on a mixed dev set
    domains = load_domains(["code", "legal"])
    kw = dict(batch_size=8, context=TINY_MODEL["context"], num_batches=8)
    models = [code.load_model(), legal.load_model()]
    own = [[float(-score_batches(m, d.eval_batches("test", **kw)).mean()) for d in domains] for m in models]
    assert own[0][0] < own[1][0] and own[1][1] < own[0][1], own
    mixed = torch.stack([score_batches(m, balanced_eval_batches(domains, "dev", **kw)) for m in models])
    alone = [float(-s.mean()) for s in mixed]
    ensemble = ensemble_nll(mixed, estimate_prior(mixed))
    assert ensemble < max(alone), (ensemble, alone)

    out = run_cli(prefork, "experts", "eval", "--experts", "code,legal", "--domain", "code", "--domain", "legal",
                  "--registry", "reg", "--batches", "4", cwd=tmp_path)
    assert "ensemble" in out and "prior of legal" in out
    assert (tmp_path / "reg" / "priors.json").is_file()

    # a merge recipe through the CLI
    (tmp_path / "ties.yaml").write_text(yaml.safe_dump({"method": "ties", "registry": "reg", "base": "seed",
                                                        "experts": ["code", "legal"]}))
    run_cli(prefork, "merge", "ties.yaml", "--out", "reg/ties", "--verify", cwd=tmp_path)
    ties = registry.get("ties")
    ties.load_model(verify=True)
    assert ties.parent == seed.sha256 and [e["name"] for e in ties.merge["experts"]] == ["code", "legal"]

    # a new expert branched from the average of two, weighted by its domain's posterior
    out = run_cli(prefork, "experts", "branch", "legal2", "--from", "code", "--from", "legal", "--domain", "legal",
                  *common, cwd=tmp_path)
    assert "the start, the posterior merge of code, legal at " in out and "holds no inner optimizer state (a merge " \
        "keeps none): AdamW starts fresh at step 40" in out  # said (it named --init-from, --with-optimizer); done:
    assert int(load_checkpoint(tmp_path / "runs/btm/legal2/checkpoint")[0]["inner.0.step"]) == 40  # 40 steps taken
    start = read_expert(tmp_path / "runs/btm/legal2/init")
    weights = {e["name"]: e["weight"] for e in start.merge["experts"]}
    assert start.merge["method"] == "posterior" and weights["legal"] > weights["code"], weights
    averaged = load_file(start.model_file)
    code_state, legal_state = load_file(code.model_file), load_file(legal.model_file)
    total = weights["code"] + weights["legal"]
    for name, value in averaged.items():
        expected = (weights["code"] * code_state[name] + weights["legal"] * legal_state[name]) / total
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
    legal2 = registry.get("legal2")
    assert (legal2.parent, legal2.start_step, legal2.steps) == (start.sha256, 40, 80)


def test_init_from_refuses_a_different_model_and_a_finished_schedule(tmp_path, prefork):
    expert, _ = tiny_expert(tmp_path)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({"protocol": {"name": "local"}, "model": TINY_MODEL,
                                      "train": {**TINY_TRAIN, "steps": 20}}))
    done = prefork.run(["train", "--protocol", str(recipe), "--init-from", str(expert.folder),
                        "--out", str(tmp_path / "run")], tmp_path, timeout=120)
    assert done.returncode == 2 and "differs from the recipe" in done.stderr and "Traceback" not in done.stderr


def test_a_taken_name_or_a_stop_at_that_trains_nothing_is_refused_before_training(tmp_path, prefork):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({"protocol": {"name": "local"}, "model": TINY_MODEL,
                                      "train": {**TINY_TRAIN, "steps": 20}}))
    common = ["--protocol", str(recipe), "--registry", "reg"]
    run_cli(prefork, "experts", "seed", "--domain", "code", "--domain", "legal", *common, cwd=tmp_path)
    seed = Registry(tmp_path / "reg").get("seed")
    short = prefork.run(["experts", "seed", "--as", "short", "--domain", "code", "--domain", "legal", *common,
                         "--steps", "4"], tmp_path)  # said by `train`, not by a seed
    assert short.returncode == 0 and "note: train.warmup_steps is 5 and the run has 4 steps" in short.stderr

    def refused(*args, says):
        done = prefork.run(args, tmp_path, timeout=120)
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr

    refused("experts", "seed", "--domain", "code", "--domain", "legal", *common, says="'seed' is already in")
    refused("experts", "seed", "--domain", "code", "--domain", "legal", *common, "--replace",  # (was the worker's line)
            says="runs/btm/seed holds the run of an earlier 'seed': --resume goes on from it; to train it again, "
                 "remove runs/btm/seed or give another --out (--replace replaces the registry's expert, not its run)")
    refused("experts", "seed", "--domain", "code", "--domain", "legal", *common, "--replace", "--resume",
            says="the run stops at step 10 (--share 0.5 of a 20-step schedule), and runs/btm/seed/checkpoint is at "
                 "step 10: nothing would train; stop past step 10")  # it named a --stop-at not given
    refused("experts", "branch", "seed", "--from", "seed", "--domain", "code", *common, says="--replace")
    refused("experts", "branch", "bad/name", "--from", "seed", "--domain", "code", *common, says="expert name")
    refused("experts", "branch", "c", "--from", "seed", "--domain", "code", "--stop-at", "10", *common,
            says="the run stops at step 10 (--stop-at), and expert 'seed' at reg/seed is at step 10")
    refused("experts", "branch", "c", "--from", "seed", "--domain", "code", "--stop-at", "30", *common,
            says="past the end of the 20-step schedule")
    refused("experts", "branch", "c", "--from", "seed", "--domain", "code", "--steps", "10", *common,  # it said
            says="the start point, expert 'seed' at ")  # --init-from, which a branch is not given
    refused("experts", "branch", "c", "--from", "seed", "--domain", "code", "--steps", "10", *common,
            says="is at step 10, the end of a 10-step schedule: nothing would train; give more --steps")
    refused("experts", "add", "runs/btm/seed/checkpoint", "--name", "seed", "--registry", "reg", says="already in")
    (tmp_path / "avg.yaml").write_text(yaml.safe_dump({"method": "linear", "registry": "reg", "experts": ["seed", "seed"]}))
    refused("merge", "avg.yaml", "--out", "reg/seed", says="already in")
    assert not (tmp_path / "runs/btm/c").exists() and not (tmp_path / "runs/btm/bad").exists()  # nothing trained
    assert Registry(tmp_path / "reg").get("seed") == seed  # nothing replaced

    said = run_cli(prefork, "experts", "add", "runs/btm/seed/checkpoint", "--name", "seed", "--registry", "reg",
                   "--replace", cwd=tmp_path)
    again = Registry(tmp_path / "reg").get("seed")
    assert again.sha256 == seed.sha256 and again.optimizer is None  # replaced, as asked: without its optimizer
    assert again.domain == seed.domain == "code,legal" and "domain code,legal (the checkpoint's)" in said  # was None
    named = prefork.run(["experts", "add", "runs/btm/seed/checkpoint", "--name", "named", "--domain-name", "code",
                         "--registry", "reg"], tmp_path)
    assert named.returncode == 0 and Registry(tmp_path / "reg").get("named").domain == "code"
    assert named.stderr == ("experts: note: runs/btm/seed/checkpoint trained on --domain code,legal; named's domain is "
                            "code, as --domain-name says\n")


def test_a_registry_that_cannot_be_read_is_one_line_and_the_rest_is_listed(tmp_path, prefork):
    tiny_expert(tmp_path / "reg", "good")
    tiny_expert(tmp_path / "reg", "torn")
    meta_path = tmp_path / "reg" / "torn" / "expert.json"
    meta = json.loads(meta_path.read_text())
    for field, bad in (("tokens", "lots"), ("size", None), ("name", 5), ("model", {**meta["model"], "n_layer": "x"})):
        meta_path.write_text(json.dumps({**meta, field: bad}))
        done = prefork.run(["experts", "list", "--registry", "reg"], tmp_path, timeout=60)
        assert done.returncode == 2 and field in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert "good" in done.stdout  # the readable ones are listed
    meta_path.write_text(json.dumps(meta))
    model_file = tmp_path / "reg" / "torn" / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:100])
    done = prefork.run(["experts", "eval", "--registry", "reg", "--experts", "good,torn", "--domain", "legal",
                        "--batches", "1"], tmp_path, timeout=120)
    assert done.returncode == 2 and "torn'" in done.stderr and "does not match its recorded sha256" in done.stderr
    assert "Traceback" not in done.stderr
    done = prefork.run(["experts", "list", "--registry", "nowhere"], tmp_path, timeout=60)  # a typo: said as empty
    assert done.returncode == 0 and done.stdout == "no experts in nowhere (the folder does not exist)\n", done.stdout


def test_an_expert_changed_since_it_was_written_is_refused_before_eval_or_branch_use_it(tmp_path, prefork):
    tiny_expert(tmp_path / "reg", "code")
    tiny_expert(tmp_path / "reg", "legal", seed=1)
    model_file = tmp_path / "reg" / "legal" / "model.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-1] ^= 1  # one weight changed on disk: still a readable file of the recorded size
    model_file.write_bytes(bytes(data))
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({"protocol": {"name": "local"}, "model": TINY_MODEL,
                                      "train": {**TINY_TRAIN, "steps": 20}}))
    for args in (["experts", "eval", "--experts", "code,legal", "--domain", "legal", "--batches", "1"],
                 ["experts", "branch", "x", "--from", "code", "--from", "legal", "--domain", "legal",
                  "--protocol", str(recipe)]):
        done = prefork.run([*args, "--registry", "reg"], tmp_path, timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert "expert 'legal'" in done.stderr and "does not match its recorded sha256" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # refused before scoring or averaging anything
    one_parent = tmp_path / "one.yaml"  # the parent's context: the branch gets as far as loading its start point
    one_parent.write_text(yaml.safe_dump({"protocol": {"name": "local"}, "model": TINY_MODEL,
                                          "train": {**TINY_TRAIN, "context": 16, "steps": 20}}))
    done = prefork.run(["experts", "branch", "y", "--from", "legal", "--domain", "legal", "--protocol", str(one_parent),
                        "--registry", "reg"], tmp_path, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "expert 'legal'" in done.stderr and "does not match its recorded sha256" in done.stderr, done.stderr
    assert not (tmp_path / "reg" / "priors.json").exists() and not (tmp_path / "runs").exists()


def test_experts_of_different_contexts_are_evaluated_on_the_shortest_in_either_order(tmp_path, prefork):
    for name, context in (("long", 16), ("short", 8)):
        config = GPTConfig(n_layer=1, n_head=2, d_model=16, context=context)
        state = GPT(config).state_dict()
        write_expert(tmp_path / "reg" / name, lambda path, s=state: path.write_bytes(model_bytes(s)),
                     Expert(name=name, sha256="", size=0, model=dataclasses.asdict(config), domain="legal"))
    tables = []
    for order in ("long,short", "short,long"):
        out = run_cli(prefork, "experts", "eval", "--registry", "reg", "--experts", order, "--domain", "legal",
                      "--batches", "2", cwd=tmp_path)
        tables.append({line.split()[1]: line for line in out.splitlines() if line.startswith("expert ")})
    assert len(tables[0]) == 2 and tables[0] == tables[1]  # each expert's perplexity, on the same windows whatever the order


def test_bench_btm_refuses_impossible_settings_before_anything_starts(tmp_path, monkeypatch, capsys):
    (tmp_path / "used" / "seed0").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    for name, text in (("other", '{"methods": {}}'), ("list", "[1, 2]"), ("garbled", "{not json")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(text)  # another bench's, ... (it was a traceback)
    for args, says in ((["--heldout", "code"], "--heldout code is one of --domains"),
                       (["--report", "other"], "is not a `decentral bench btm` run's results"),
                       (["--report", "list"], "is not a `decentral bench btm` run's results"),
                       (["--report", "garbled"], "cannot read"),
                       (["--domains", "code"], "two or more domains"),
                       (["--domains", "code,code"], "names a domain twice"),
                       (["--domains", "code,nope"], "unknown domain 'nope'"),
                       (["--heldout", "x=/tmp"], "give built-in domain names"),
                       (["--out", "used"], "--out used holds a previous run"),
                       (["--report", "empty"], "--report empty: no results.json there"),
                       (["--jobs", "0"], "--jobs: must be at least 1"),
                       (["--seeds", "0"], "--seeds: must be at least 1"),
                       (["--seed-steps", "0"], "--seed-steps: must be at least 1")):
        monkeypatch.chdir(tmp_path)
        try:
            code = main(["bench", "btm", "--out", "run", *args])
        except SystemExit as e:  # argparse's own errors
            code = e.code
        out, err = capsys.readouterr()
        assert code == 2 and says in err and "Traceback" not in err, (args, err)
        assert "started" not in out and not (tmp_path / "run").exists(), args
        if not args[0].startswith(("--jobs", "--seed")):  # argparse's own errors come with the usage line
            assert len(err.strip().splitlines()) == 1, err


JOBS_CHILD = """
import sys
from pathlib import Path
from decentral.btmbench import Job, run_jobs
sleeper = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(300)"]
try:
    run_jobs([Job("a", sleeper), Job("b", sleeper), Job("c", sleeper, after=("a",))], Path(sys.argv[1]), 2)
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_bench_btm_jobs_end_with_the_bench(tmp_path, sig):
    repo = Path(__file__).resolve().parent.parent
    bench = subprocess.Popen([sys.executable, "-c", JOBS_CHILD, str(tmp_path)], cwd=repo,
                             env={**os.environ, "PYTHONPATH": str(repo)})
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline and bench.poll() is None:
            logs = [tmp_path / f"{name}.log" for name in ("a", "b")]
            pids = [int(log.read_text()) for log in logs if log.is_file() and log.read_text().endswith("\n")]
            time.sleep(0.05)  # polling the jobs' logs for their pids
        assert len(pids) == 2, "the jobs did not start"
        bench.send_signal(sig)
        assert bench.wait(60) == 130
        for pid in pids:
            with pytest.raises(ProcessLookupError):  # ended and reaped, not left running
                os.kill(pid, 0)
        assert not (tmp_path / "c.log").exists()
    finally:
        bench.kill()
        kill_leftovers(pids)


def test_eval_checks_the_router_and_its_experts_before_scoring(tmp_path, monkeypatch, capsys):
    pytest.importorskip("sklearn")
    import numpy as np

    from decentral.experts.clusters import Router

    config = GPTConfig(n_layer=1, n_head=2, d_model=16, context=16)
    for seed, (name, domain) in enumerate((("cm0", "c0=clusters/c0"), ("cm1", "c1"), ("plain", None), ("huge", None))):
        torch.manual_seed(seed)
        state = {k: v * (1e25 if name == "huge" else 1) for k, v in GPT(config).state_dict().items()}
        write_expert(tmp_path / "reg" / name, lambda path, s=state: path.write_bytes(model_bytes(s)),
                     Expert(name=name, sha256="", size=0, model=dataclasses.asdict(config), domain=domain))
    rng = np.random.default_rng(0)
    for k in (2, 3):
        Router(idf=np.ones(64), feature_index=np.arange(64), components=rng.normal(size=(4, 64)),
               centres=rng.normal(size=(k, 4))).save(tmp_path / f"r{k}.npz")
    (tmp_path / "notes.txt").write_text("not a router")

    monkeypatch.chdir(tmp_path)

    def evaluate(experts, *args):
        code = main(["experts", "eval", "--registry", "reg", "--experts", experts, "--domain", "legal", "--batches",
                     "1", *args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess([], code, out, err)

    for experts, args, says in (("cm0,cm1", ["--router", "missing.npz"], "--router missing.npz: cannot be read"),
                                ("cm0,cm1", ["--router", "notes.txt"], "--router notes.txt: not a router file"),
                                ("cm0,cm1", ["--router", "r3.npz"], "--router r3.npz has 3 clusters but 2 experts"),
                                ("cm1,plain", ["--router", "r2.npz"],
                                 "'cm1' is given for cluster c0 but trained on c1"),
                                ("cm0,cm0", [], "--experts: 'cm0' is given twice"),
                                ("cm0,huge", [], "expert 'huge' gives NaN or infinite log-likelihoods")):
        done = evaluate(experts, *args)
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == (1 if "huge" not in experts else 2), done.stderr  # scored cm0
    assert not (tmp_path / "reg" / "priors.json").exists()  # no NaN prior was kept

    tables = [evaluate(experts, "--router", "r2.npz") for experts in ("cm0,cm1", "cm1,cm0")]
    assert [t.returncode for t in tables] == [0, 0], tables[1].stderr
    assert "c-BTM routed" in tables[0].stdout and tables[0].stdout == tables[1].stdout  # expert j serves cluster j
    assert "in the router's cluster order, as their domains say: cm0 (c0), cm1 (c1)" in tables[1].stderr


def test_duplicates_run_folders_and_unknown_names_are_one_line_before_any_work(tmp_path, prefork):
    tiny_expert(tmp_path / "reg", "code")
    tiny_expert(tmp_path / "reg", "legal", seed=1)
    (tmp_path / "runs" / "hf" / "run1" / "checkpoint").mkdir(parents=True)
    for args, says in ((["experts", "branch", "x", "--from", "code", "--from", "code", "--domain", "code"],
                        "--from: 'code' is given twice"),
                       (["experts", "add", "runs/hf/run1", "--name", "x"],
                        "meta.json is missing (did you mean runs/hf/run1/checkpoint?)"),
                       (["experts", "add", "reg/code", "--name", "x"],
                        "reg/code is an expert folder (expert.json), not a `decentral train` checkpoint"),
                       (["experts", "publish", "code", "nosuch"], "no expert 'nosuch'"),
                       (["experts", "eval", "--experts", "code,", "--domain", "code"],  # ("expert name ''")
                        "--experts 'code,': an empty name (names are separated by single commas)")):
        done = prefork.run([*args, "--registry", "reg"], tmp_path, timeout=60)
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # no open-swarm note before it
    (tmp_path / "slerp.yaml").write_text("method: slerp\nregistry: reg\nexperts: [code, legal]\n"
                                         "parameters: {t: 0.25}\n")
    out = run_cli(prefork, "merge", "slerp.yaml", "--out", "reg/s", cwd=tmp_path)
    assert "merge: slerp of code, legal (t 0.25, parallel_threshold 0.9995) -> " in out, out


def test_a_branch_takes_its_parents_model_and_says_the_recipes_other_model_is_not_used(tmp_path, prefork):
    parent, _ = tiny_expert(tmp_path / "reg", "code")  # n_layer 1, d_model 16, context 16; no recipe of its own
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({"protocol": {"name": "local"}, "model": TINY_MODEL,
                                      "train": {**TINY_TRAIN, "context": 16, "steps": 2, "eval_every": 2}}))
    common = ["--from", "code", "--domain", "code", "--protocol", str(recipe), "--registry", "reg"]
    done = prefork.run(["experts", "branch", "x", *common, "--set", "model.dropout=0.1"], tmp_path, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "--set model.dropout: a branch's model is that of its parent, expert 'code'" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()  # before any training

    done = prefork.run(["experts", "branch", "x", *common], tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (f"the model of --protocol {recipe} is not used (code there, the recipe here: context 16 there, 32 here; "
            "d_model 16 there, 32 here; n_layer 1 there, 2 here)") in done.stderr, done.stderr
    assert Registry(tmp_path / "reg").get("x").model == parent.model


def test_a_train_context_longer_than_the_models_is_one_line_before_any_work(tmp_path, prefork):
    tiny_expert(tmp_path / "reg", "code")  # context 16, no recipe: a branch takes the recipe's train.context
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({"protocol": {"name": "local"}, "model": {"n_layer": 1, "n_head": 2, "d_model": 16,
                                      "context": 16}, "train": {**TINY_TRAIN, "steps": 2}}))  # train.context 32
    for args in (["train", "--out", "runs/t"], ["experts", "branch", "x", "--from", "code", "--domain", "code",
                                                "--registry", "reg"]):
        done = prefork.run([*args, "--protocol", str(recipe)], tmp_path, timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert "train.context 32 is longer than the model's context 16" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "runs").exists()  # nothing trained


def test_the_btm_table_shows_a_spread_only_over_two_seeds_or_more():
    """One seed printed `± 0.000` in every cell: a spread that was never measured."""
    seed = {"dense": {"code": 10.0, "legal": 20.0}, "ensemble": {"code": 9.0, "legal": 19.0}}
    other = {"dense": {"code": 12.0, "legal": 20.0}, "ensemble": {"code": 9.0, "legal": 21.0}}
    one = format_results(aggregate([seed]), {}, "legal")
    assert "±" not in one and "one seed" in one and "10.000" in one
    two = format_results(aggregate([seed, other]), {}, "legal")
    assert "mean ± std" in two and "11.000 ± 1.414" in two
