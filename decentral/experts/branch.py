"""Where a model starts training: a checkpoint or an expert, with its step and lineage.

Branch-train-merge (Li et al. 2022, arXiv 2208.03306, §3.1): an expert branches from the seed model
with the seed's inner optimizer state and learning-rate schedule continued, so `decentral train
--init-from` takes the weights, the inner optimizer state (when the start point has one) and the
inner step from either
- a `decentral train` checkpoint folder (`tensors.safetensors` + `meta.json`), or
- an expert folder (`model.safetensors` + `expert.json`, optionally `optimizer.safetensors`),
of the reference GPT or of a Hugging Face model (whose weights are a save_pretrained layout in either
folder, read through `from_pretrained` under the names decentral.models.hf.HFCausalLM gives them). The
run's model must be the start point's: the same GPT config, or the same transformers config.
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

from decentral.checkpoint import (
    CheckpointError, file_sha256, inner_tensors, load_checkpoint, model_tensors, optimizer_state_dict,
)
from decentral.experts.registry import (
    META_FILE, Expert, RegistryError, checkpoint_layout, layout_digest, model_sha256, read_expert,
    verify_expert, write_meta,
)
from decentral.models import GPT_SOURCE, HF_SOURCE, ModelError, gpt_description


@dataclass
class StartPoint:
    model: dict[str, torch.Tensor]  # a state dict with the names of the run's model (a Hugging Face model's `lm.*`)
    optimizer: dict[str, Any] | None  # a torch optimizer state_dict; None: the inner optimizer starts fresh
    step: int  # the inner step training continues from (the LR schedule's position)
    parent: str  # the start model's hash: the sha256 an expert folder of it records (decentral.experts.registry)
    tokens: int  # tokens the start model has seen
    model_config: dict[str, Any]  # what the model is (decentral.models.describe_model): the run's must be the same
    source: str
    no_optimizer: str  # why `optimizer` would be None (said when it is: AdamW starts fresh)


def load_start_point(path: str | Path) -> StartPoint:
    """Read a checkpoint folder or an expert folder (its hashes checked), of the reference GPT or a Hugging Face
    model; RegistryError when it is neither or is corrupt."""
    path = Path(path)
    if (path / META_FILE).is_file():
        expert = read_expert(path)
        verify_expert(expert)
        optimizer = None
        if expert.optimizer_file is not None:
            optimizer = optimizer_state_dict(load_file(expert.optimizer_file), expert.optimizer["param_groups"])
        model, config = (_hf_model(path) if expert.is_hf else
                         (load_file(expert.model_file), gpt_description(expert.model)))
        if expert.merge:  # a branch from several parents starts from their average, a merge
            source = (f"the {expert.merge['method']} merge of {', '.join(e['name'] for e in expert.merge['experts'])} "
                      f"at {path}")
            return StartPoint(model, optimizer, expert.steps, expert.sha256, expert.tokens, config, source,
                              "a merge keeps none")
        return StartPoint(model, optimizer, expert.steps, expert.sha256, expert.tokens, config,
                          f"expert {expert.name!r} at {path}",
                          "an expert keeps it only when written with --with-optimizer")
    try:
        tensors, meta = load_checkpoint(path)  # checks every file's sha256, a Hugging Face layout's included
    except CheckpointError as e:
        raise RegistryError(f"--init-from {path}: neither an expert folder nor a usable checkpoint ({e})") from None
    recipe_model = meta.get("recipe", {}).get("model", {})
    if recipe_model.get("source", GPT_SOURCE) != GPT_SOURCE:  # the model is a save_pretrained layout beside the state
        model, config = _hf_model(path)
        parent = layout_digest({p.name: {"sha256": file_sha256(p)} for p in checkpoint_layout(path)})
    else:
        model = model_tensors(tensors)
        config, parent = gpt_description(recipe_model), model_sha256(model)
    if not model or "recipe" not in meta:
        raise RegistryError(f"--init-from {path}: not a `decentral train` checkpoint (no model tensors or recipe)")
    optimizer = None
    if "inner_optimizer" in meta:
        optimizer = optimizer_state_dict(inner_tensors(tensors), meta["inner_optimizer"]["param_groups"])
    return StartPoint(model, optimizer, int(meta["sync"]["step"]), parent,
                      int(meta.get("lineage", {}).get("tokens", 0)), config, f"checkpoint {path}", "its run saved none")


def _hf_model(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, description) of the Hugging Face model saved in `folder` (save_pretrained's layout), as the
    run's HFCausalLM names and describes it."""
    from decentral.models.hf import HFCausalLM, read_pretrained_layout

    try:
        model = HFCausalLM(read_pretrained_layout(folder))
    except ModelError as e:
        raise RegistryError(f"--init-from {folder}: {e}") from None
    return model.state_dict(), model.describe()


def model_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> str:
    """What differs between a start point's model description and the run's, in one line."""
    kinds = {GPT_SOURCE: "the reference GPT", HF_SOURCE: "a Hugging Face model"}
    if theirs["source"] != ours["source"]:
        return f"{kinds[theirs['source']]} there, {kinds[ours['source']]} here"
    keys = sorted(k for k in {*theirs, *ours} if theirs.get(k) != ours.get(k))
    return "; ".join(f"{k} {theirs.get(k)!r} there, {ours.get(k)!r} here" for k in keys)


def averaged_start(parents: list[Expert], domain: str, folder: Path) -> Expert:
    """Write Σ_j π_j θ_j of `parents` to expert folder `folder` (the `posterior` merge: π is the new
    `domain`'s prior over them, from its dev split), at the step the parents branched at."""
    from decentral.merge import merge, parse_merge_recipe

    recipe = parse_merge_recipe({"method": "posterior", "experts": [str(p.folder.resolve()) for p in parents],
                                 "parameters": {"domain": domain}}, "the branch's average")
    expert = merge(recipe, folder, progress=False)
    expert.steps = min(p.start_step for p in parents)
    write_meta(folder, expert)
    return expert
