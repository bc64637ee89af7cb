"""The reference GPT cut into SkipPipe stages (Blagoev et al. 2025, ALGORITHMS.md §5).

Stage 0 holds the embedding, the first blocks and the final norm + LM head: every path starts and
ends there. Stage s > 0 holds the next contiguous range of blocks. The blocks are dealt evenly, the
remainder to the last stages (stage 0 also runs the embedding and the head). A microbatch that skips
a stage passes its hidden state on unchanged: no residual rescaling.

    stages = cut(GPT(config), 4)                   # the stages share the model's modules
    h = stages[0].begin(tokens); h = stages[2](h); loss = stages[0].loss(h, targets)
    model = assemble(config, 4, [s.global_state_dict() for s in stages])
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from decentral.models.gpt import GPT, GPTConfig
from decentral.pipeline.network import NetworkError


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
    """One stage: `blocks` (global indices `block_range`); stage 0 also `embed` and `head`.

    `forward(h)` runs the blocks on hidden states (B, T, d_model). Stage 0 adds `begin(tokens)` (the
    embedding, then its blocks) and `loss(h, targets)` (final norm, LM head, mean cross-entropy).
    """

    def __init__(self, index: int, block_range: range, blocks: Iterable[nn.Module], embed: nn.Module | None = None,
                 head: nn.Module | None = None):
        super().__init__()
        self.index = index
        self.block_range = block_range
        self.blocks = nn.ModuleList(blocks)
        self.embed = embed
        self.head = head

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
        """This stage's weights under the names they have in the whole GPT (`blocks.{global index}...`)."""
        out = {}
        for key, value in self.state_dict().items():
            if key.startswith("blocks."):
                local, rest = key[len("blocks."):].split(".", 1)
                key = f"blocks.{self.block_range[int(local)]}.{rest}"
            out[key] = value
        return out

    def load_global_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load the entries of a whole-GPT state dict that belong to this stage (all must be there)."""
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


def cut(model: GPT, stages: int) -> list[Stage]:
    """The stages of `model` (sharing its modules: training a stage trains the model)."""
    ranges = block_ranges(model.config.n_layer, stages)
    return [Stage(s, r, [model.blocks[i] for i in r], model.embed if s == 0 else None, model.head if s == 0 else None)
            for s, r in enumerate(ranges)]


def make_stage(config: GPTConfig, stages: int, index: int, seed: int) -> Stage:
    """Stage `index` of a GPT initialised from `seed`: every replica of a stage starts from the same weights."""
    if not 0 <= index < stages:
        raise NetworkError(f"stage must be in [0, {stages - 1}], got {index}")
    torch.manual_seed(seed)
    return cut(GPT(config), stages)[index]


def assemble(config: GPTConfig, parts: Iterable[dict[str, torch.Tensor]]) -> GPT:
    """A whole GPT from the `global_state_dict`s of its stages (one per stage); every weight must be given."""
    model = GPT(config)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    missing = sorted(set(model.state_dict()) - set(merged))
    if missing:
        raise NetworkError(f"the stages lack {len(missing)} weights of the model, e.g. {missing[0]}")
    model.load_state_dict(merged)
    return model


def partial_loss(model: GPT, stages: int, order: Sequence[int], tokens: torch.Tensor,
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
