"""The reference GPT, or a Llama-style Hugging Face model, cut into SkipPipe stages (Blagoev et al. 2025,
ALGORITHMS.md §5).

Stage 0 holds the embedding, the first blocks and the final norm + LM head: every path starts and
ends there. Stage s > 0 holds the next contiguous range of blocks. The blocks are dealt evenly, the
remainder to the last stages (stage 0 also runs the embedding and the head). A microbatch that skips
a stage passes its hidden state on unchanged: no residual rescaling.

A Llama-style model (LlamaForCausalLM, or any causal LM of the same parts: model.embed_tokens,
model.layers, model.norm, model.rotary_emb, lm_head, full attention in every layer; bare or in
decentral.models.hf.HFCausalLM) is cut the same way, its decoder layers being the blocks and
model.norm + lm_head the head. Each stage computes the rotary position embeddings and the causal mask
for its hidden states as LlamaModel.forward does (positions 0..T-1, no padding, no cache), so only
hidden states travel between stages, and stages run in order compute the model's logits exactly.

    stages = cut(GPT(config), 4)                   # the stages share the model's modules
    h = stages[0].begin(tokens); h = stages[2](h); loss = stages[0].loss(h, targets)
    model = assemble(config, [s.global_state_dict() for s in stages])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from decentral.models import GPT_SOURCE, build_model
from decentral.models.gpt import GPT, GPTConfig
from decentral.pipeline.network import NetworkError

LLAMA_PARTS = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")


def block_ranges(n_layer: int, stages: int) -> list[range]:
    """The blocks of each stage: contiguous, in order, at least one each, sizes within one of each other
    (the larger ones last, since stage 0 also runs the embedding and the head)."""
    if stages < 2:
        raise NetworkError(f"a pipeline needs at least 2 stages, got {stages}")
    if n_layer < stages:
        raise NetworkError(f"{stages} stages need at least {stages} transformer blocks, the model has {n_layer}")
    base, extra = divmod(n_layer, stages)
    sizes = [base + (s >= stages - extra) for s in range(stages)]
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


class Stage(nn.Module):
    """One stage of `whole`: `blocks` (global indices `block_range`); stage 0 also `embed` and `head`.

    `forward(h)` runs the blocks on hidden states (B, T, d_model). Stage 0 adds `begin(tokens)` (the
    embedding, then its blocks) and `loss(h, targets)` (final norm, LM head, mean cross-entropy).
    """

    def __init__(self, index: int, block_range: range, blocks: Iterable[nn.Module], embed: nn.Module | None = None,
                 head: nn.Module | None = None, *, whole: nn.Module):
        super().__init__()
        self.index = index
        self.block_range = block_range
        self.blocks = nn.ModuleList(blocks)
        self.embed = embed
        self.head = head
        self._global_names = _global_names(self, whole)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h

    def begin(self, tokens: torch.Tensor) -> torch.Tensor:
        return self(self.embed(tokens))

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def forward_parameters(self) -> list[nn.Parameter]:
        """What `begin` (stage 0) or `forward` trains: the embedding (stage 0) and the blocks."""
        parts = ([self.embed] if self.embed is not None else []) + [self.blocks]
        return [p for part in parts for p in part.parameters()]

    def loss_parameters(self) -> list[nn.Parameter]:
        """What `loss` trains: the final norm and the LM head (stage 0 only; [] elsewhere)."""
        return list(self.head.parameters()) if self.head is not None else []

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights under the names they have in the whole model (`blocks.{global index}...`)."""
        return {self._global_names[key]: value for key, value in self.state_dict().items()}

    def load_global_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load the entries of a whole-model state dict that belong to this stage (all must be there)."""
        wanted = self.global_state_dict()
        missing = sorted(set(wanted) - set(tensors))
        if missing:
            raise NetworkError(f"stage {self.index}: the weights lack {len(missing)} of its tensors, e.g. {missing[0]}")
        with torch.no_grad():
            for key, value in wanted.items():
                if tensors[key].shape != value.shape:
                    raise NetworkError(f"stage {self.index}: {key} has shape {tuple(tensors[key].shape)}, "
                                       f"expected {tuple(value.shape)}")
                value.copy_(tensors[key])


class LlamaStage(Stage):
    """A stage of a Llama-style model: its decoder layers called as LlamaModel.forward calls them, with the rotary
    position embeddings (`rotary`, the model's) and the causal mask of `config` computed from the hidden states."""

    def __init__(self, *args, rotary: nn.Module, config, whole: nn.Module, **kwargs):
        from transformers.masking_utils import create_causal_mask

        super().__init__(*args, whole=whole, **kwargs)
        self.rotary = rotary
        self._global_names = _global_names(self, whole)  # with the buffers `rotary` keeps in a state dict, if any
        self.lm_config = config
        self._causal_mask = create_causal_mask
        self._mask_arguments = _causal_mask_arguments(inspect.signature(create_causal_mask).parameters)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = self._causal_mask(config=self.lm_config, attention_mask=None, position_ids=positions,
                                 **self._mask_arguments(h, positions))
        rotary = self.rotary(h, position_ids=positions)
        for layer in self.blocks:
            h = layer(h, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        return h


def _causal_mask_arguments(names: Iterable[str]) -> Callable[[torch.Tensor, torch.Tensor], dict]:
    """(hidden states, positions) -> the arguments of transformers' `create_causal_mask` that its releases
    name differently, given the names it takes: the hidden states (`input_embeds` in 4.53-5.0,
    `inputs_embeds` in 5.17), the absent cache (`past_key_values` up to 5.17, `cache` in 5.24) and the
    positions in the cache (`cache_position`, required in 4.53-5.0)."""
    names = set(names)
    embeds = "inputs_embeds" if "inputs_embeds" in names else "input_embeds"
    cache = "cache" if "cache" in names else "past_key_values"
    with_position = "cache_position" in names

    def arguments(h: torch.Tensor, positions: torch.Tensor) -> dict:
        return {embeds: h, cache: None, **({"cache_position": positions[0]} if with_position else {})}

    return arguments


def _global_names(stage: nn.Module, whole: nn.Module) -> dict[str, str]:
    """{key of `stage`'s state dict: the key of the same tensor in `whole`'s}, by the module that holds it."""
    names = {id(module): name for name, module in whole.named_modules()}
    modules = dict(stage.named_modules(remove_duplicate=False))
    out = {}
    for key in stage.state_dict():
        path, _, leaf = key.rpartition(".")
        owner = names[id(modules[path])]
        out[key] = f"{owner}.{leaf}" if owner else leaf
    return out


def _llama_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module, dict]:
    """(embedding, decoder layers, final norm + LM head, LlamaStage's own arguments) of a Llama-style model, bare or
    in HFCausalLM; NetworkError when it is not one."""
    lm = getattr(model, "lm", model)
    parts = {}
    for path in LLAMA_PARTS:
        part = lm
        for attribute in path.split("."):
            part = getattr(part, attribute, None)
        parts[path] = part
    if any(part is None for part in parts.values()) or not isinstance(parts["model.layers"], nn.ModuleList):
        raise NetworkError(f"pipeline stages cut the reference GPT or a Llama-style model ({', '.join(LLAMA_PARTS)}); "
                           f"{type(lm).__name__} is neither")
    config = lm.config
    other = sorted({kind for kind in getattr(config, "layer_types", None) or () if kind != "full_attention"})
    if other:
        raise NetworkError(f"{type(lm).__name__} has {', '.join(other)} layers; pipeline stages compute full causal "
                           "attention only")
    head = nn.Sequential(parts["model.norm"], parts["lm_head"])
    return parts["model.embed_tokens"], parts["model.layers"], head, {"rotary": parts["model.rotary_emb"],
                                                                      "config": config}


def cut(model: nn.Module, stages: int) -> list[Stage]:
    """The stages of `model`, the reference GPT or a Llama-style model (module docstring), sharing its modules:
    training a stage trains the model."""
    if isinstance(model, GPT):
        embed, blocks, head, kind, extra = model.embed, model.blocks, model.head, Stage, {}
    else:
        embed, blocks, head, extra = _llama_parts(model)
        kind = LlamaStage
    return [kind(s, r, [blocks[i] for i in r], embed if s == 0 else None, head if s == 0 else None, whole=model,
                 **extra) for s, r in enumerate(block_ranges(len(blocks), stages))]


def make_stage(config: GPTConfig, stages: int, index: int, seed: int, source: str = GPT_SOURCE,
               context: int | None = None) -> Stage:
    """Stage `index` of the model `source` names (decentral.models.build_model: the GPT of `config`, or a Hugging
    Face model for sequences of `context` tokens, default config.context) initialised from `seed`: every replica of
    a stage starts from the same weights."""
    if not 0 <= index < stages:
        raise NetworkError(f"stage must be in [0, {stages - 1}], got {index}")
    torch.manual_seed(seed)
    return cut(build_model(source, config, context or config.context), stages)[index]


def assemble(config: GPTConfig, parts: Iterable[dict[str, torch.Tensor]], source: str = GPT_SOURCE,
             context: int | None = None) -> nn.Module:
    """The whole model (as `make_stage` builds it) from the `global_state_dict`s of its stages (one per stage);
    every weight must be given."""
    model = build_model(source, config, context or config.context)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    missing = sorted(set(model.state_dict()) - set(merged))
    if missing:
        raise NetworkError(f"the stages lack {len(missing)} weights of the model, e.g. {missing[0]}")
    model.load_state_dict(merged)
    return model


def partial_loss(model: nn.Module, stages: int, order: Sequence[int], tokens: torch.Tensor,
                 targets: torch.Tensor) -> torch.Tensor:
    """The loss of `model` run through the stages in `order` only (stage 0 first, as a path visits
    them): what training along that path computes, and inference with the other stages dropped."""
    if not order or order[0] != 0 or len(set(order)) != len(order) or not set(order) <= set(range(stages)):
        raise NetworkError(f"a stage order must start at stage 0 and visit distinct stages of 0..{stages - 1}, "
                           f"got {list(order)}")
    parts = cut(model, stages)
    h = parts[0].begin(tokens)
    for s in order[1:]:
        h = parts[s](h)
    return parts[0].loss(h, targets)
