"""Models trained by decentral: the reference GPT, or a Hugging Face causal LM (decentral.models.hf).

A recipe's `model.source` says which: `gpt` (the reference GPT, shaped by the other model keys),
`hf:CONFIG.json` (a `transformers` model built from that config, offline) or a folder written by
`save_pretrained` (its weights). Both kinds train through `forward(x, y) -> (logits, loss)`.
Importing this package does not import `transformers`.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from decentral.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "GPT_SOURCE", "HF_CONFIG_PREFIX", "ModelError", "absolute_source", "build_model",
           "check_source"]

GPT_SOURCE = "gpt"
HF_CONFIG_PREFIX = "hf:"


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
