"""Branch-train-merge with Hugging Face models: experts in save_pretrained's layout (from a `decentral train`
checkpoint, single-file or sharded) that from_pretrained opens, merged, evaluated and shared through a swarm."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
import torch.nn.functional as F
import yaml

transformers = pytest.importorskip("transformers")

from decentral.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from decentral.cli import main  # noqa: E402
from decentral.data.batches import evaluate  # noqa: E402
from decentral.data.domains import balanced_eval_batches, load_domain, load_domains  # noqa: E402
from decentral.experts.ensemble import Ensemble  # noqa: E402
from decentral.experts.registry import (  # noqa: E402
    Expert, Registry, RegistryError, expert_from_json, read_expert, verify_expert, write_expert,
)
from decentral.merge import MergeError, merge, parse_merge_recipe  # noqa: E402
from decentral.models.hf import save_pretrained_layout  # noqa: E402

from conftest import TINY_TRAIN  # noqa: E402
from test_expert_sharing import sharing  # noqa: E402,F401  (the fixture)
from test_experts import tiny_expert  # noqa: E402
from test_hf import local_recipe  # noqa: E402

TINY_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)


def llama(seed: int, **changes):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_LLAMA, **changes})).eval()


def hf_expert(folder, name: str, seed: int, shard: str | None = None, **changes) -> tuple[Expert, dict]:
    """An HF expert of a fresh tiny Llama (in shards of at most `shard`); and the model's state dict."""
    lm = llama(seed, **changes)
    meta = Expert(name=name, sha256="", size=0, model={"source": "hf"}, domain="d")
    expert = write_expert(folder / name, lambda path: save_pretrained_layout(lm, path, max_shard_size=shard), meta)
    return expert, lm.state_dict()


def from_pretrained(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()


def manifest_sha256(folder, files) -> str:
    """sha256 over `sha256sum`'s lines for `files` of `folder`, computed here from the bytes."""
    lines = "".join(f"{hashlib.sha256((folder / f).read_bytes()).hexdigest()}  {f}\n" for f in sorted(files))
    return hashlib.sha256(lines.encode()).hexdigest()


def flip_a_data_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside the last tensor: the header stays valid
    path.write_bytes(bytes(data))


def linear(registry, *names, verify=False):
    return parse_merge_recipe({"method": "linear", "registry": str(registry), "experts": list(names),
                               "verify": verify})


def test_a_train_checkpoint_becomes_an_expert_that_from_pretrained_opens(tmp_path, small_corpus, llama_config):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"protocol": {"name": "local"}, "train": {**TINY_TRAIN, "steps": 4},
                                      "model": {"source": f"hf:{llama_config}"}}))
    assert main(["train", "--protocol", str(recipe), "--out", str(tmp_path / "run"), "--data", str(small_corpus)]) == 0
    registry = Registry(tmp_path / "experts")
    expert = registry.add_checkpoint(tmp_path / "run" / "checkpoint", "code", "code", with_optimizer=True)

    files = {"config.json", "generation_config.json", "model.safetensors"}
    assert {p.name for p in expert.folder.iterdir()} == files | {"expert.json", "optimizer.safetensors"}
    assert expert.model == {"source": "hf"} and set(expert.layout) == files and expert.steps == 4
    assert expert.sha256 == manifest_sha256(expert.folder, files) and registry.get("code") == expert
    assert expert.context == TINY_TRAIN["context"]  # what it trained at, from its recipe
    x = torch.randint(0, 256, (2, 16))
    trained = from_pretrained(tmp_path / "run" / "checkpoint")(input_ids=x).logits
    assert torch.equal(from_pretrained(expert.folder)(input_ids=x).logits, trained)
    assert torch.equal(expert.load_model(verify=True)(x)[0], trained)

    flip_a_data_byte(expert.folder / "model.safetensors")
    with pytest.raises(RegistryError, match="model.safetensors does not match its recorded sha256"):
        expert.load_model(verify=True)


def test_a_sharded_checkpoint_is_added_file_by_file_and_a_damaged_one_refused(tmp_path):
    lm = llama(2)
    meta = {"recipe": {"model": {"source": "hf:config.json"}, "train": {"context": 32}}, "sync": {"step": 3}}
    checkpoint = save_checkpoint(tmp_path / "checkpoint", {}, meta,
                                 files=lambda folder: save_pretrained_layout(lm, folder, max_shard_size="20KB"))
    expert = Registry(tmp_path / "experts").add_checkpoint(checkpoint, "big")
    layout = {p.name for p in checkpoint.iterdir()} - {"tensors.safetensors", "meta.json"}
    assert set(expert.layout) == layout and "model.safetensors.index.json" in layout and expert.steps == 3
    verify_expert(expert)
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(from_pretrained(expert.folder)(input_ids=x).logits, lm(input_ids=x).logits)
    shard = sorted(checkpoint.glob("model-*.safetensors"))[0]
    flip_a_data_byte(shard)
    with pytest.raises(RegistryError, match=f"{shard.name} \\(checksum mismatch\\)"):
        Registry(tmp_path / "experts").add_checkpoint(checkpoint, "broken")
    assert not (tmp_path / "experts" / "broken").exists()


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(**TINY_LLAMA).save_pretrained(folder)
    return str(folder / "config.json")


def test_linear_merge_of_hf_experts_is_their_mean_and_opens_with_from_pretrained(tmp_path):
    a, state_a = hf_expert(tmp_path, "a", seed=0)
    b, state_b = hf_expert(tmp_path, "b", seed=1)
    out = merge(linear(tmp_path, "a", "b"), tmp_path / "out" / "ab", progress=False)

    assert out.is_hf and out.merge["method"] == "linear" and read_expert(out.folder) == out
    verify_expert(out)
    assert set(out.layout) == {"config.json", "generation_config.json", "model.safetensors"}
    assert json.loads((out.folder / "config.json").read_text()) == json.loads((a.folder / "config.json").read_text())
    merged = from_pretrained(out.folder).state_dict()
    assert merged.keys() == state_a.keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, (state_a[name] + state_b[name]) / 2, rtol=0, atol=0)


def test_a_sharded_input_merges_as_its_single_file_twin_and_a_corrupt_shard_is_refused(tmp_path):
    hf_expert(tmp_path, "a", seed=0)
    hf_expert(tmp_path, "b", seed=1)
    sharded, _ = hf_expert(tmp_path, "b-shards", seed=1, shard="20KB")
    shards = sorted(name for name in sharded.layout if name.startswith("model-"))
    assert len(shards) > 2 and "model.safetensors.index.json" in sharded.layout
    verify_expert(sharded)
    assert torch.equal(from_pretrained(sharded.folder).model.norm.weight, from_pretrained(tmp_path / "b").model.norm.weight)

    single = merge(linear(tmp_path, "a", "b"), tmp_path / "out" / "single", progress=False)
    from_shards = merge(linear(tmp_path, "a", "b-shards", verify=True), tmp_path / "out" / "shards", progress=False)
    assert from_shards.sha256 == single.sha256  # the same three files, byte for byte

    flip_a_data_byte(sharded.folder / shards[1])
    with pytest.raises(RegistryError, match=f"{shards[1]} does not match its recorded sha256"):
        verify_expert(sharded)
    with pytest.raises(MergeError, match=f"expert 'b-shards': .*{shards[1]} does not match the sha256 recorded"):
        merge(linear(tmp_path, "a", "b-shards", verify=True), tmp_path / "out" / "bad", progress=False)
    assert not (tmp_path / "out" / "bad").exists()
    (sharded.folder / shards[0]).write_bytes((sharded.folder / shards[0]).read_bytes()[:-4])  # truncated
    with pytest.raises(MergeError, match=f"{shards[0]}: .*truncated"):
        merge(linear(tmp_path, "a", "b-shards"), tmp_path / "out" / "bad", progress=False)


def test_mixed_kinds_and_different_configs_are_refused(tmp_path):
    hf_expert(tmp_path, "a", seed=0)
    hf_expert(tmp_path, "eps", seed=1, rms_norm_eps=1e-5)
    tiny_expert(tmp_path, name="gpt")
    assert "layout" not in json.loads((tmp_path / "gpt" / "expert.json").read_text())  # GPT records as before
    with pytest.raises(MergeError, match=r"mix Hugging Face models \(expert 'a'\) and reference GPTs \(expert 'gpt'\)"):
        merge(linear(tmp_path, "a", "gpt"), tmp_path / "out" / "m", progress=False)
    with pytest.raises(MergeError, match=r"configs \(config.json\) differ: rms_norm_eps: expert 'a' 1e-06, "
                                         r"expert 'eps' 1e-05"):
        merge(linear(tmp_path, "a", "eps"), tmp_path / "out" / "m", progress=False)


def test_a_record_naming_files_outside_its_folder_is_refused(tmp_path):
    expert, _ = hf_expert(tmp_path, "a", seed=0)
    record = expert.to_json()
    record["layout"]["../../evil"] = record["layout"].pop("config.json")
    with pytest.raises(RegistryError, match="layout file '../../evil' must be a plain file name"):
        expert_from_json(record, "record")
    record = expert.to_json()
    record["layout"]["config.json"]["sha256"] = "0" * 64  # the record's sha256 no longer covers its layout
    with pytest.raises(RegistryError, match="sha256 and size must be the layout's"):
        expert_from_json(record, "record")


def test_hf_experts_ensemble_and_evaluate(tmp_path, capsys):
    for seed, name in enumerate(("a", "b")):
        hf_expert(tmp_path, name, seed)
    experts = [read_expert(tmp_path / name).load_model() for name in ("a", "b")]
    x = torch.randint(0, 256, (2, 16))
    mixture = Ensemble(experts, prior=[0.5, 0.5]).log_probs(x)
    assert mixture.shape == (2, 16, 256) and torch.allclose(mixture.exp().sum(-1), torch.ones(2, 16))

    domain = tmp_path / "domain"
    domain.mkdir()
    for i in range(200):
        (domain / f"{i}.txt").write_text(f"document {i}: " + "some words of text, " * 60)
    assert main(["experts", "eval", "--registry", str(tmp_path), "--experts", "a,b", "--domain", f"text={domain}",
                 "--batches", "2"]) == 0
    report = capsys.readouterr().out
    # expert a's perplexity, recomputed here with from_pretrained on the test batches at its context (64: a model
    # without a recipe is evaluated at its max_position_embeddings)
    batches = load_domain(f"text={domain}").eval_batches("test", batch_size=16, context=64, num_batches=2)
    lm = from_pretrained(tmp_path / "a")
    with torch.no_grad():
        nll = sum(F.cross_entropy(lm(input_ids=x).logits.flatten(0, 1), y.flatten()).item() for x, y in batches) / 2
    row = next(line for line in report.splitlines() if line.startswith("expert a "))
    assert float(row.split()[-1]) == pytest.approx(math.exp(nll), abs=1e-3), report
    assert any(line.startswith("ensemble ") for line in report.splitlines())


def test_a_sharded_hf_expert_is_fetched_through_the_swarm_file_by_file(tmp_path, sharing):  # noqa: F811
    publisher, fetcher = sharing
    expert, _ = hf_expert(tmp_path / "a", "big", seed=0, shard="20KB")
    publisher.publish(["big"])
    sizes = []
    got = fetcher.fetch("big", progress=sizes.append)
    assert got.folder == tmp_path / "b" / "big" and got.layout == expert.layout and sum(sizes) == expert.size
    verify_expert(got)
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(from_pretrained(got.folder)(input_ids=x).logits, from_pretrained(expert.folder)(input_ids=x).logits)


def text_domain(folder, corpus, files: int = 200) -> str:
    """`NAME=PATH` of a domain of real text in enough files for its by-file splits: `corpus` cut into pieces."""
    text = b"".join(p.read_bytes() for p in sorted(corpus.iterdir()))
    folder.mkdir()
    size = len(text) // files
    for i in range(files):
        (folder / f"{i}.txt").write_bytes(text[i * size:(i + 1) * size])
    return f"text={folder}"


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_an_hf_seed_branches_with_its_weights_adamw_state_and_schedule(tmp_path, small_corpus, llama_config, capsys):
    """`experts branch` from a Hugging Face seed (a real `decentral train --model hf:CONFIG.json` run) goes on at
    the seed's step with its weights and AdamW state; `train --init-from` its checkpoint starts from the same
    model; several parents start from their posterior-weighted average; a run of another config is one line and
    exit code 2."""
    domain = text_domain(tmp_path / "text", small_corpus)
    train = ["train", "--protocol", local_recipe(tmp_path / "r.yaml", "gpt"), "--domain", domain, "--steps", "40"]
    assert main([*train, "--model", f"hf:{llama_config}", "--stop-at", "20", "--out", str(tmp_path / "seed")]) == 0
    registry = ["--registry", str(tmp_path / "reg")]
    assert main(["experts", "add", str(tmp_path / "seed" / "checkpoint"), "--name", "seed", "--with-optimizer",
                 *registry]) == 0
    seed_val = metrics(tmp_path / "seed")[-1]["val_loss"]

    assert main(["experts", "branch", "text", "--from", "seed", "--domain", domain, *registry,
                 "--out", str(tmp_path / "text-run")]) == 0
    records = metrics(tmp_path / "text-run")
    assert records[0]["step"] == 20 and records[0]["val_loss"] == seed_val  # the seed's model, validated again
    assert [r["step"] for r in records if "loss" in r] == list(range(21, 41))  # the schedule went on
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert vals[-1] < vals[0], vals
    tensors, meta = load_checkpoint(tmp_path / "text-run" / "checkpoint")
    assert int(tensors["inner.0.step"]) == 40  # AdamW's 20 steps of the seed and 20 of the branch
    seed, text = Registry(tmp_path / "reg").get("seed"), Registry(tmp_path / "reg").get("text")
    assert text.is_hf and (text.parent, text.start_step, text.steps) == (seed.sha256, 20, 40)

    # the seed's checkpoint is the same start point as its expert, hash included
    assert main([*train, "--model", f"hf:{llama_config}", "--init-from", str(tmp_path / "seed" / "checkpoint"),
                 "--stop-at", "21", "--out", str(tmp_path / "again")]) == 0
    assert metrics(tmp_path / "again")[0]["val_loss"] == seed_val
    assert load_checkpoint(tmp_path / "again" / "checkpoint")[1]["lineage"]["parent"] == seed.sha256

    # two parents: their average weighted by the domain's posterior, at the step they branched at, AdamW fresh
    capsys.readouterr()
    assert main(["experts", "branch", "avg", "--from", "seed", "--from", "text", "--domain", domain, *registry,
                 "--stop-at", "1", "--out", str(tmp_path / "avg")]) == 0
    assert ("at step 0, the earliest step its parents branched at (seed 0, text 20): it trains the schedule from "
            "there") in capsys.readouterr().out  # (it said "where the parents branched")
    start = read_expert(tmp_path / "avg" / "init")
    assert start.is_hf and start.merge["method"] == "posterior" and start.steps == 0
    val = balanced_eval_batches(load_domains([domain]), "dev", batch_size=TINY_TRAIN["batch_size"],
                                context=TINY_TRAIN["context"], num_batches=TINY_TRAIN["eval_batches"])
    assert metrics(tmp_path / "avg")[0]["val_loss"] == pytest.approx(evaluate(start.load_model(), val), rel=1e-6)
    tensors, meta = load_checkpoint(tmp_path / "avg" / "checkpoint")
    assert int(tensors["inner.0.step"]) == 1 and meta["lineage"]["parent"] == start.sha256

    wider = tmp_path / "wider"
    transformers.LlamaConfig(**{**TINY_LLAMA, "hidden_size": 48}).save_pretrained(wider)
    capsys.readouterr()
    assert main([*train, "--model", f"hf:{wider / 'config.json'}", "--init-from", str(seed.folder),
                 "--out", str(tmp_path / "wide")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"expert 'seed' at {seed.folder}" in err and f"hf:{wider / 'config.json'}" in err, err
    assert "hidden_size 32 there, 48 here" in err and len(err.splitlines()) == 1, err
