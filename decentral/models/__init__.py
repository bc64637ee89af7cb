"""Models trained by decentral: the reference GPT, or a Hugging Face causal LM (decentral.models.hf).

A recipe's `model.source` says which: `gpt` (the reference GPT, shaped by the other model keys),
`hf:CONFIG.json` (a `transformers` model built from that config, offline) or a folder written by
`save_pretrained` (its weights). Both kinds train through `forward(x, y) -> (logits, loss)` and say
whether they keep their weights in files of their own: `write_files(folder)` and `read_files(folder)`
(a state dict) for a Hugging Face model's save_pretrained layout, both None for the reference GPT,
whose state dict a checkpoint keeps.
Importing this package does not import `transformers`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from torch import nn

from decentral.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "GPT_SOURCE", "HF_CONFIG_PREFIX", "HF_SOURCE", "ModelError", "absolute_source",
           "build_model", "check_source", "describe_model", "gpt_description"]

GPT_SOURCE = "gpt"
HF_CONFIG_PREFIX = "hf:"
HF_SOURCE = "hf"  # a Hugging Face model in descriptions and expert.json's `model`


class ModelError(ValueError):
    """A model cannot be built as asked (a missing or unusable file, transformers not installed); the
    message says why in one line."""


def check_source(source: str) -> None:
    """Raise ModelError unless `source` is `gpt`, `hf:PATH` or a PATH (files are checked when the model is built)."""
    if not source or source == HF_CONFIG_PREFIX:
        raise ModelError(f"model source {source!r}: expected gpt, hf:CONFIG.json or a save_pretrained folder")


def absolute_source(source: str) -> str:
    """`source` with its path made absolute, so processes started elsewhere (an island's ranks) open the
    same file."""
    if source == GPT_SOURCE:
        return source
    prefix = HF_CONFIG_PREFIX if source.startswith(HF_CONFIG_PREFIX) else ""
    return prefix + str(Path(source[len(prefix):]).expanduser().resolve())


def build_model(source: str, gpt: GPTConfig, context: int) -> nn.Module:
    """The model `source` names, its fresh weights drawn from torch's RNG: the reference GPT shaped by `gpt`,
    or a Hugging Face causal LM checked to take byte tokens and `context`-token sequences. Raises ModelError."""
    check_source(source)
    if source == GPT_SOURCE:
        return GPT(gpt)
    from decentral.models.hf import load_causal_lm

    return load_causal_lm(source, context)


def gpt_description(config: dict[str, Any]) -> dict[str, Any]:
    """The description (`describe_model`) of a reference GPT of `config` (GPTConfig's fields)."""
    return {"source": GPT_SOURCE, **config}


def describe_model(model: nn.Module) -> dict[str, Any]:
    """What a model is, to compare with the model weights were trained in: `{"source": "gpt", GPTConfig's
    fields}`, or for a Hugging Face model `{"source": "hf", its transformers config's fields}` (HFCausalLM.describe)."""
    describe = getattr(model, "describe", None)
    return describe() if describe else gpt_description(dataclasses.asdict(model.config))
