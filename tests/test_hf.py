"""Hugging Face causal LMs: the adapter's loss, a 2-peer NoLoCo swarm of `decentral train --model hf:CONFIG.json`
processes whose checkpoints `from_pretrained` opens, clear errors for unusable configs, and --resume."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.nn.utils import parameters_to_vector

transformers = pytest.importorskip("transformers")

from decentral.checkpoint import CheckpointError, load_checkpoint, save_checkpoint  # noqa: E402
from decentral.cli import main  # noqa: E402
from decentral.data import eval_batches, load_corpus  # noqa: E402
from decentral.models import GPTConfig, build_model  # noqa: E402
from decentral.models.hf import save_pretrained_layout  # noqa: E402

from conftest import TINY_TRAIN  # noqa: E402

TINY_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)


def write_config(folder, **changes) -> str:
    """A tiny Llama's config.json in `folder`; its path."""
    transformers.LlamaConfig(**{**TINY_LLAMA, **changes}).save_pretrained(folder)
    return str(folder / "config.json")


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory) -> str:
    return write_config(tmp_path_factory.mktemp("llama"))


def reopened(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)


def val_loss_of(lm, batches) -> float:
    """The mean next-token cross-entropy of a plain transformers model over (x, y) batches, computed here."""
    with torch.no_grad():
        return sum(F.cross_entropy(lm(input_ids=x).logits.flatten(0, 1), y.flatten()).item()
                   for x, y in batches) / len(batches)


def test_adapter_loss_is_cross_entropy_against_the_shifted_targets(llama_config):
    torch.manual_seed(0)
    model = build_model(f"hf:{llama_config}", GPTConfig(), 32)
    torch.manual_seed(0)
    again = build_model(f"hf:{llama_config}", GPTConfig(), 32)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    x, y = torch.randint(0, 256, (3, 32)), torch.randint(0, 256, (3, 32))
    logits, loss = model(x, y)
    log_probs = torch.log_softmax(model.lm(input_ids=x).logits, dim=-1)
    expected = -log_probs.gather(-1, y.unsqueeze(-1)).mean()
    assert logits.shape == (3, 32, 256)
    torch.testing.assert_close(loss, expected)
    assert not torch.isclose(loss, model.lm(input_ids=x, labels=y).loss)  # HF shifts its labels once more
    assert model(x)[1] is None


def test_a_sharded_layout_goes_into_a_checkpoint_and_comes_back(tmp_path, llama_config):
    torch.manual_seed(0)
    model = build_model(f"hf:{llama_config}", GPTConfig(), 32)
    write = lambda folder: save_pretrained_layout(model.lm, folder, max_shard_size="20KB")  # noqa: E731
    target = save_checkpoint(tmp_path / "ckpt", {}, {}, files=write)
    shards = sorted(p.name for p in target.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (target / "model.safetensors.index.json").is_file()
    tensors, _ = load_checkpoint(target, files=model.read_files)
    assert tensors.keys() == model.state_dict().keys()
    assert all(torch.equal(tensors[k], v) for k, v in model.state_dict().items())
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(reopened(target)(input_ids=x).logits, model(x)[0])
    (target / shards[-1]).write_bytes(b"x" + (target / shards[-1]).read_bytes()[1:])
    with pytest.raises(CheckpointError, match=f"{shards[-1]} \\(checksum mismatch\\)"):
        load_checkpoint(target, files=model.read_files)


def test_importing_decentral_does_not_import_transformers():
    code = ("import sys, decentral.cli, decentral.worker, decentral.models; "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_two_peer_noloco_swarm_trains_and_its_checkpoint_opens_with_from_pretrained(workers, llama_config,
                                                                                    small_corpus):
    w = workers({"name": "noloco", "every": 10}, steps=30, num_workers=2)
    for i in range(2):
        w.start(i, extra=["--model", f"hf:{llama_config}"])
    assert w.wait(timeout=120) == {0: 0, 1: 0}, [w.log(i) for i in range(2)]
    val = eval_batches(load_corpus([str(small_corpus)]).val, batch_size=TINY_TRAIN["batch_size"],
                       context=TINY_TRAIN["context"], num_batches=TINY_TRAIN["eval_batches"])
    for i in range(2):
        records = w.metrics(i)
        vals = [r["val_loss"] for r in records if "val_loss" in r]
        assert vals[-1] < vals[0] - 0.5, vals
        assert [r["group_size"] for r in records if "group_size" in r] == [2, 2, 2]
        checkpoint = w.root / f"w{i}" / "checkpoint"
        assert {"config.json", "model.safetensors", "tensors.safetensors", "meta.json"} <= {
            p.name for p in checkpoint.iterdir()}
        lm = reopened(checkpoint)
        # the weights the worker validated at the end: its logged loss, recomputed on the reopened model
        assert val_loss_of(lm, val) == pytest.approx(records[-1]["val_loss"], rel=1e-5)
        # and the training state's own copy of them (NoLoCo's slow weights, which the model is after a sync)
        tensors, meta = load_checkpoint(checkpoint)
        assert meta["sync"]["step"] == 30 and not any(k.startswith("model.") for k in tensors)  # not stored twice
        assert torch.equal(parameters_to_vector(lm.parameters()), tensors["outer.slow"])


def local_recipe(path, source: str, steps: int = 20):
    path.write_text(yaml.safe_dump({"protocol": {"name": "local"}, "train": {**TINY_TRAIN, "steps": steps},
                                    "model": {"source": source}}))
    return str(path)


@pytest.mark.parametrize("changes, message", [
    ({"vocab_size": 200}, "vocab_size is 200"),
    ({"max_position_embeddings": 16}, "max_position_embeddings is 16, shorter than train.context 32"),
    (None, "does not exist"),
    # values transformers' own checks refuse as it reads the file (written by hand: LlamaConfig refuses them too)
    ({"num_attention_heads": 5}, "hidden size (32) is not a multiple of the number of attention heads (5)"),
    ({"hidden_size": "thirty-two"}, "Field 'hidden_size' expected int, got str"),
])
def test_an_unusable_config_is_one_line_and_exit_code_2(tmp_path, small_corpus, capsys, changes, message):
    config = write_config(tmp_path) if changes else str(tmp_path / "missing.json")
    if changes:
        Path(config).write_text(json.dumps({**json.loads(Path(config).read_text()), **changes}))
    recipe = local_recipe(tmp_path / "r.yaml", f"hf:{config}")
    assert main(["train", "--protocol", recipe, "--out", str(tmp_path / "out"), "--data", str(small_corpus)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_an_encoders_config_is_refused_as_it_would_see_the_byte_it_predicts(tmp_path, small_corpus, capsys):
    """transformers builds BERT's LM head for AutoModelForCausalLM too: it attends both ways. With is_decoder it
    is causal, and trains."""
    bert = dict(vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    transformers.BertConfig(**bert).save_pretrained(tmp_path / "bert")
    recipe = local_recipe(tmp_path / "r.yaml", f"hf:{tmp_path / 'bert' / 'config.json'}")
    assert main(["train", "--protocol", recipe, "--out", str(tmp_path / "out"), "--data", str(small_corpus)]) == 2
    err = capsys.readouterr().err.strip()
    assert "attends to later tokens, so it is not a causal LM" in err and len(err.splitlines()) == 1, err
    transformers.BertConfig(**bert, is_decoder=True).save_pretrained(tmp_path / "decoder")
    assert isinstance(build_model(f"hf:{tmp_path / 'decoder' / 'config.json'}", {}, 32).lm,
                      transformers.BertLMHeadModel)


def test_a_folder_given_as_a_config_or_a_config_as_a_folder_says_which_is_which(llama_config):
    from decentral.models import ModelError

    with pytest.raises(ModelError, match="is a folder; hf: takes a config file"):
        build_model(f"hf:{llama_config.rsplit('/', 1)[0]}", {}, 32)
    with pytest.raises(ModelError, match="a file, not a save_pretrained folder"):
        build_model(llama_config, {}, 32)


def test_a_model_folder_that_is_none_says_what_was_meant(tmp_path, llama_config):
    """A Hub id, a run's folder, a reference GPT's checkpoint: each was "not a save_pretrained folder (no
    .../config.json)", which named no way on."""
    from decentral.models import ModelError

    with pytest.raises(ModelError, match="no such folder .*nothing is downloaded: save a Hub model with save_pretrained"):
        build_model(str(tmp_path / "gpt2"), {}, 32)
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    shutil.copy(llama_config, run / "checkpoint" / "config.json")
    with pytest.raises(ModelError, match=f"a run's folder: its model is in {run / 'checkpoint'} "):
        build_model(str(run), {}, 32)
    gpt = tmp_path / "gpt" / "checkpoint"
    gpt.mkdir(parents=True)
    (gpt / "meta.json").write_text("{}")
    for given in (gpt, gpt.parent):
        with pytest.raises(ModelError, match=f"a checkpoint of the reference GPT, .*--init-from {gpt} starts"):
            build_model(str(given), {}, 32)


def test_without_transformers_one_line_says_what_to_install(tmp_path, small_corpus, capsys, monkeypatch,
                                                            llama_config):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    args = ["train", "--protocol", local_recipe(tmp_path / "r.yaml", "gpt"), "--model", f"hf:{llama_config}",
            "--out", str(tmp_path / "out"), "--data", str(small_corpus)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'decentral[hf]'" in err and len(err.splitlines()) == 1, err


def test_resume_and_a_new_run_from_the_checkpoint_folder(tmp_path, small_corpus, capsys, llama_config):
    """--resume goes on at the saved step with the saved weights; --model CHECKPOINT starts a new run from them;
    resuming with another model, or from a damaged model file, and a new run from it, are one line and exit code 2."""
    out = tmp_path / "out"
    args = ["train", "--protocol", local_recipe(tmp_path / "r.yaml", f"hf:{llama_config}"), "--out", str(out),
            "--data", str(small_corpus)]
    assert main([*args, "--stop-at", "10"]) == 0
    assert load_checkpoint(out / "checkpoint")[1]["sync"]["step"] == 10
    assert main([*args, "--resume"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 21))  # the second run went on at 11
    at_10 = [r["val_loss"] for r in records if r["step"] == 10 and "val_loss" in r]
    assert len(at_10) == 3 and at_10[0] == at_10[1] == at_10[2]  # saved, reloaded, validated again: the same model
    assert load_checkpoint(out / "checkpoint")[1]["sync"]["step"] == 20
    # --model PATH: a new run starts from the checkpoint's weights (a save_pretrained folder)
    branch = tmp_path / "branch"
    assert main([*args[:3], "--out", str(branch), "--data", str(small_corpus), "--model", str(out / "checkpoint"),
                 "--stop-at", "1"]) == 0
    first = json.loads((branch / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and first["val_loss"] == records[-1]["val_loss"]
    capsys.readouterr()
    wider = write_config(tmp_path / "wider", hidden_size=48)
    assert main([*args, "--resume", "--steps", "30", "--model", f"hf:{wider}"]) == 2  # (at 20 nothing would train)
    err = capsys.readouterr().err
    assert "holds another model than this run's" in err and len(err.strip().splitlines()) == 1, err
    assert f"resume with --model hf:{llama_config}" in err  # the source the checkpoint was written with
    weights = out / "checkpoint" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    assert main([*args, "--resume", "--steps", "30"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors (checksum mismatch)" in err and len(err.strip().splitlines()) == 1, err
    # so is --model of the damaged checkpoint (it trained on, or was called no causal LM)
    assert main([*args[:3], "--out", str(tmp_path / "branch2"), "--data", str(small_corpus), "--model",
                 str(out / "checkpoint"), "--stop-at", "1"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors (checksum mismatch)" in err and len(err.strip().splitlines()) == 1, err
