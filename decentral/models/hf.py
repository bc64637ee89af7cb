"""Hugging Face causal LMs trained by decentral (`pip install 'decentral[hf]'`).

`HFCausalLM` puts any `transformers` causal LM behind the reference GPT's interface, so the worker's loop,
evaluation and protocols drive it unchanged: `forward(x, y) -> (logits, loss)`, the loss being the mean
cross-entropy of the logits against y. y is x already shifted by one token (decentral.data), so the
model's own label shift is not used.

On disk a model is in `save_pretrained`'s layout: config.json, generation_config.json and model.safetensors,
or shards model-0000k-of-0000n.safetensors with model.safetensors.index.json once it outgrows
`max_shard_size`; `AutoModelForCausalLM.from_pretrained` opens it. `save_pretrained_layout` and
`read_pretrained_layout` write and read it for any caller (the worker's checkpoints put it beside their
training state). Models are built and trained in float32; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from decentral.checkpoint import META_FILE, check_saved_files
from decentral.data.tokenizer import ByteTokenizer
from decentral.models import HF_CONFIG_PREFIX, HF_SOURCE, ModelError
from decentral.models.gpt import next_token_loss

CONFIG_FILE = "config.json"
SAVED_AS = ("transformers_version", "dtype", "torch_dtype")  # config.json keys saying how a model was saved
# config keys left out of a model's description: SAVED_AS, and where it was read from (`_name_or_path`) or what
# class saved it (`architectures`, absent from a config written by hand), so a model built from a config and
# the same model read back from its save_pretrained folder describe themselves alike
NOT_DESCRIBED = (*SAVED_AS, "architectures", "_name_or_path")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ModelError("Hugging Face models need transformers: pip install 'decentral[hf]'") from None
    return transformers


@contextlib.contextmanager
def _errors_only():
    """transformers logging its errors alone, restored afterwards: building a model of a config logs warnings
    about fields that mean nothing to byte tokens (GPT-2's bos_token_id 50256), which a one-line error or a
    run's first lines should not drown in."""
    from transformers.utils import logging

    was = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(was)


@contextlib.contextmanager
def _no_progress_bars():
    """transformers without its progress bars (one per checkpoint written or read), restored afterwards."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


class HFCausalLM(nn.Module):
    """A `transformers` causal LM (`lm`) with the reference GPT's forward. State dict keys are `lm.` + the
    model's own."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) token ids. Returns logits (B, T, vocab) and the mean cross-entropy against
        targets (None without targets)."""
        logits = self.lm(input_ids=idx, use_cache=False).logits
        return logits, None if targets is None else next_token_loss(logits, targets)

    def num_parameters(self) -> int:
        """Total number of parameters (tied ones once)."""
        return sum(p.numel() for p in self.parameters())

    def describe(self) -> dict[str, Any]:
        """`{"source": "hf", the config's fields but NOT_DESCRIBED}`: the same for the same model, whether it was
        built from a config file or read from a save_pretrained folder."""
        return {"source": HF_SOURCE, **{k: v for k, v in self.lm.config.to_dict().items() if k not in NOT_DESCRIBED}}

    def write_files(self, folder: Path) -> None:
        """Write the model into `folder` in save_pretrained's layout (what a checkpoint holds of it)."""
        save_pretrained_layout(self.lm, folder)

    def read_files(self, folder: Path) -> dict[str, torch.Tensor]:
        """A state dict for this module (keys `lm.*`) from the save_pretrained layout in `folder`, the inverse
        of `write_files`; whether it fits this model (names, shapes) is the caller's to check."""
        return {f"lm.{k}": v for k, v in read_pretrained_layout(folder).state_dict().items()}


def save_pretrained_layout(lm: nn.Module, folder: str | Path, max_shard_size: int | str | None = None) -> None:
    """`lm.save_pretrained(folder)` without progress bars; `max_shard_size` (e.g. "2GB") as save_pretrained
    takes it (default: its own)."""
    with _no_progress_bars():
        lm.save_pretrained(folder, **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))


def read_pretrained_layout(folder: str | Path) -> nn.Module:
    """The causal LM saved in `folder` (save_pretrained's layout), in float32 on the CPU, from local files only.
    ModelError when transformers is missing or `folder` is not such a folder."""
    t = _transformers()
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        raise ModelError(f"{folder} is not a save_pretrained folder: it has no {CONFIG_FILE}")
    try:
        with _no_progress_bars():
            return t.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelError(f"{folder}: transformers cannot open it as a causal LM: {_first_line(e)}") from None


def check_config(config, context: int, where: str) -> None:
    """ModelError naming the field unless `config` covers the byte vocabulary and sequences of `context` tokens."""
    text = config.get_text_config()
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < ByteTokenizer.vocab_size:
        raise ModelError(f"{where}: vocab_size is {vocab}, fewer than the {ByteTokenizer.vocab_size} byte tokens "
                         "decentral trains on")
    positions = getattr(text, "max_position_embeddings", None)
    if isinstance(positions, int) and positions < context:
        raise ModelError(f"{where}: max_position_embeddings is {positions}, shorter than train.context {context}")


def load_causal_lm(source: str, context: int) -> HFCausalLM:
    """`hf:CONFIG.json`: a new model of that config, its weights drawn from torch's RNG; otherwise the model
    in save_pretrained folder `source`. Checked by `check_config` before any weights are made. ModelError
    naming the source on any problem."""
    t = _transformers()
    from_config = source.startswith(HF_CONFIG_PREFIX)
    path = Path(source[len(HF_CONFIG_PREFIX):] if from_config else source)
    config_file = path if from_config else path / CONFIG_FILE
    if from_config and path.is_dir():
        raise ModelError(f"model {source}: {path} is a folder; hf: takes a config file (hf:{path / CONFIG_FILE}), "
                         f"and --model {path} starts from the weights of a save_pretrained folder")
    if not from_config and path.is_file():
        raise ModelError(f"model {source}: a file, not a save_pretrained folder (hf:{path} builds a new model of a "
                         "config file)")
    if not config_file.is_file():
        raise ModelError(f"model {source}: {config_file} does not exist" if from_config else
                         f"model {source}: {_not_a_model_folder(path)}")
    with _errors_only():
        try:
            config = t.AutoConfig.from_pretrained(config_file)
        except (OSError, ValueError) as e:
            raise ModelError(f"model {source}: {config_file} is not a transformers config: {_first_line(e)}") from None
        except _validation_errors() as e:  # a field of the wrong type, heads that do not divide the width
            raise ModelError(f"model {source}: {config_file} is no valid config: {' '.join(str(e).split())}") from None
        check_config(config, context, f"model {source}")
        if not from_config:
            if (path / META_FILE).is_file():  # a decentral checkpoint: its files' checksums first
                check_saved_files(path)
            model = HFCausalLM(read_pretrained_layout(path))
        else:
            try:
                model = HFCausalLM(t.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
            except ValueError as e:
                raise ModelError(f"model {source}: not a causal LM config: {_first_line(e)}") from None
    check_causal(model, context, f"model {source}")
    return model


def _not_a_model_folder(path: Path) -> str:
    """Why `path`, given as --model, is no save_pretrained folder, and what the user may have meant."""
    if not path.exists():
        return ("no such folder (--model takes a save_pretrained folder or hf:CONFIG.json; nothing is downloaded: "
                "save a Hub model with save_pretrained first)")
    checkpoint = path / "checkpoint"
    if (checkpoint / CONFIG_FILE).is_file():
        return f"a run's folder: its model is in {checkpoint} (--model {checkpoint})"
    if (path / META_FILE).is_file() or (checkpoint / META_FILE).is_file():
        return (f"a checkpoint of the reference GPT, no Hugging Face model (--init-from "
                f"{path if (path / META_FILE).is_file() else checkpoint} starts from its weights)")
    return f"not a save_pretrained folder (no {path / CONFIG_FILE})"


def check_causal(model: HFCausalLM, context: int, where: str) -> None:
    """ModelError unless the model's predictions at a position depend on earlier tokens alone: transformers
    builds an encoder's LM head (BERT's, without `is_decoder`) for AutoModelForCausalLM too, and such a model
    would see the very byte it is to predict. Two sequences that differ only in their last token must give
    the same logits before it."""
    length = min(8, context)
    x = torch.randint(ByteTokenizer.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[0, -1] = (x[0, -1] + 1) % ByteTokenizer.vocab_size
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits, _ = model(torch.cat([x, y]))
    finally:
        model.train(was_training)
    if not torch.allclose(logits[0, :-1], logits[1, :-1], rtol=1e-4, atol=1e-5):
        raise ModelError(f"{where}: the model attends to later tokens, so it is not a causal LM (a decoder-only "
                         "config, or an encoder's with is_decoder: true, is)")


def _validation_errors() -> tuple[type[Exception], ...]:
    """huggingface_hub's errors for a config's values that its checks refuse (none before it had them)."""
    from huggingface_hub import errors

    return tuple(getattr(errors, name) for name in ("StrictDataclassError",) if hasattr(errors, name))


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
