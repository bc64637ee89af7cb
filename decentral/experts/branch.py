"""Where a model starts training: a checkpoint or an expert, with its step and lineage.

Branch-train-merge (Li et al. 2022, arXiv 2208.03306, §3.1): an expert branches from the seed model
with the seed's inner optimizer state and learning-rate schedule continued, so `decentral train
--init-from` takes the weights, the inner optimizer state (when the start point has one) and the
inner step from either
- a `decentral train` checkpoint folder (`tensors.safetensors` + `meta.json`), or
- an expert folder (`model.safetensors` + `expert.json`, optionally `optimizer.safetensors`).
A new expert may also branch from a weighted average of existing experts (§3.1; `decentral experts
branch` with several parents, `averaged_start`): θ = Σ_j π_j θ_j with π the new domain's prior over the
parents on its dev split. The average is an expert folder without optimizer state (AdamW restarts), at
the step the parents branched at, so the new expert gets the same share of the schedule as they did.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from decentral.checkpoint import CheckpointError, load_checkpoint, optimizer_state_dict
from decentral.experts.registry import (
    META_FILE, Expert, RegistryError, model_sha256, read_expert, verify_expert, write_meta,
)


@dataclass
class StartPoint:
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None  # a torch optimizer state_dict; None: the inner optimizer starts fresh
    step: int  # the inner step training continues from (the LR schedule's position)
    parent: str  # sha256 of the model's canonical safetensors bytes (decentral.experts.registry)
    tokens: int  # tokens the start model has seen
    model_config: dict[str, Any]
    source: str


def load_start_point(path: str | Path) -> StartPoint:
    """Read a checkpoint folder or an expert folder (its hashes checked); RegistryError when it is neither
    or is corrupt."""
    path = Path(path)
    if (path / META_FILE).is_file():
        expert = read_expert(path)
        check_branchable(expert)
        verify_expert(expert)
        optimizer = None
        if expert.optimizer_file is not None:
            optimizer = optimizer_state_dict(load_file(expert.optimizer_file), expert.optimizer["param_groups"])
        return StartPoint(load_file(expert.model_file), optimizer, expert.steps, expert.sha256, expert.tokens,
                          expert.model, f"expert {expert.name!r} at {path}")
    try:
        tensors, meta = load_checkpoint(path)
    except CheckpointError as e:
        raise RegistryError(f"--init-from {path}: neither an expert folder nor a usable checkpoint ({e})") from None
    model = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    if not model or "recipe" not in meta:
        raise RegistryError(f"--init-from {path}: not a `decentral train` checkpoint (no model tensors or recipe)")
    optimizer = None
    if "inner_optimizer" in meta:
        optimizer = optimizer_state_dict({k: v for k, v in tensors.items() if k.startswith("inner.")},
                                     meta["inner_optimizer"]["param_groups"])
    return StartPoint(model, optimizer, int(meta["sync"]["step"]), model_sha256(model),
                      int(meta.get("lineage", {}).get("tokens", 0)), meta["recipe"]["model"], f"checkpoint {path}")


def check_branchable(expert: Expert) -> None:
    """RegistryError for a Hugging Face expert: training starts from one with its weights alone (--model FOLDER);
    branching with its AdamW state and schedule works for the reference GPT only."""
    if expert.is_hf:
        raise RegistryError(f"expert {expert.name!r} is a Hugging Face model: branching one (its AdamW state and "
                            f"schedule) is not supported yet; train from its weights with --model {expert.folder}")


def averaged_start(parents: list[Expert], domain: str, folder: Path) -> Expert:
    """Write Σ_j π_j θ_j of `parents` to expert folder `folder` (the `posterior` merge: π is the new
    `domain`'s prior over them, from its dev split), at the step the parents branched at."""
    from decentral.merge import merge, parse_merge_recipe

    recipe = parse_merge_recipe({"method": "posterior", "experts": [str(p.folder) for p in parents],
                                 "parameters": {"domain": domain}}, "the branch's average")
    expert = merge(recipe, folder, progress=False)
    expert.steps = min(p.start_step for p in parents)
    write_meta(folder, expert)
    return expert
