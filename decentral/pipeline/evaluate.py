"""A trained pipeline's model, whole and with stages dropped at inference (SkipPipe §5.3; ALGORITHMS.md §5).

The model is put together from the stage checkpoints a run's nodes wrote (RUN/<node>/stage), one node
per stage (where a stage has replicas, the one that stepped most, then the first by name: one that
died, such as a lead another head took over from, left an older checkpoint). Dropping a share `drop`
of the stages keeps stage 0 (embedding, first blocks, head) and `stages - round(drop * stages) - 1`
of the others, in increasing order: every such subset is scored when there are at most
`MAX_SUBSETS` or at most `draws`, else `draws` random ones. Reported: the validation loss and
perplexity of the whole model, the mean over subsets of the perplexity with stages dropped, and
their ratio.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from decentral.checkpoint import checkpoint_present, load_checkpoint, model_tensors
from decentral.data.batches import Batch
from decentral.pipeline.network import PipelineError
from decentral.pipeline.recipe import PipelineRecipe, parse_pipeline_recipe
from decentral.pipeline.stages import assemble, partial_loss

MAX_SUBSETS = 20


def load_run(run: str | Path) -> tuple[nn.Module, PipelineRecipe]:
    """The whole model of a run folder, and its recipe (PipelineError when a stage has no checkpoint)."""
    run = Path(run)
    if not run.is_dir():
        raise PipelineError(f"{run}: no such folder (give a `decentral pipeline train` run's --out)")
    found: dict[int, tuple[int, dict]] = {}  # stage -> (iterations stepped, model tensors)
    recipe = None
    # (by checkpoint_present: a save cut off between its two renames left the stage aside, where loading finds it)
    for folder in sorted(p / "stage" for p in run.iterdir() if checkpoint_present(p / "stage")):
        tensors, meta = load_checkpoint(folder)
        recipe = recipe or parse_pipeline_recipe(meta["recipe"], str(folder))
        stage, stepped = int(meta["stage"]), int(meta.get("iteration", 0))
        if stage not in found or stepped > found[stage][0]:
            found[stage] = (stepped, model_tensors(tensors))
    if recipe is None:
        raise PipelineError(f"{run} holds no stage checkpoints (<node>/stage); is it a `decentral pipeline train` run?")
    missing = sorted(set(range(recipe.pipeline.stages)) - set(found))
    if missing:
        raise PipelineError(f"{run}: no checkpoint of stage(s) {missing}")
    model = assemble(recipe.recipe.model, (found[s][1] for s in sorted(found)), recipe.recipe.model_source,
                     recipe.recipe.train.context)
    return model, recipe


def check_drop(drop: float) -> None:
    """PipelineError unless `drop`, the share of stages dropped, is in [0, 1)."""
    if not 0 <= drop < 1:
        raise PipelineError(f"--drop must be in [0, 1), got {drop}")


def kept_orders(stages: int, drop: float, draws: int = 10, seed: int = 0) -> list[tuple[int, ...]]:
    """The stage orders scored with a share `drop` of the stages dropped (module docstring)."""
    check_drop(drop)
    keep = max(1, stages - math.floor(drop * stages + 0.5))
    subsets = list(itertools.combinations(range(1, stages), keep - 1))
    if len(subsets) > max(MAX_SUBSETS, draws):
        rng = np.random.default_rng(seed)
        subsets = [subsets[i] for i in rng.choice(len(subsets), size=draws, replace=False)]
    return [(0, *subset) for subset in subsets]


def mean_loss(model: nn.Module, stages: int, order: tuple[int, ...], batches: list[Batch]) -> float:
    model.eval()
    with torch.no_grad():
        return sum(float(partial_loss(model, stages, order, x, y)) for x, y in batches) / len(batches)


def evaluate_dropping(model: nn.Module, stages: int, batches: list[Batch], drop: float = 0.5, draws: int = 10,
                      seed: int = 0) -> dict:
    """Whole model against the model with a share `drop` of its stages dropped (module docstring)."""
    full = mean_loss(model, stages, tuple(range(stages)), batches)
    orders = kept_orders(stages, drop, draws, seed)
    losses = [mean_loss(model, stages, order, batches)  # a bar on a terminal only: seconds per subset
              for order in tqdm(orders, desc="scoring with stages dropped", unit="subset", disable=None, leave=False)]
    dropped_ppl = float(np.mean([math.exp(loss) for loss in losses]))
    return {"full_loss": full, "full_ppl": math.exp(full), "drop": drop, "kept_stages": len(orders[0]),
            "subsets": len(orders), "dropped_loss": float(np.mean(losses)), "dropped_ppl": dropped_ppl,
            "ppl_increase": dropped_ppl / math.exp(full) - 1}


def evaluate_run(run: str | Path, drop: float = 0.5, draws: int = 10, data=None, seed: int = 0) -> dict:
    """`evaluate_dropping` on a run folder's model, over the validation split of `data` (default: the
    Python standard library) in the run's batch shape; also written to RUN/eval.json."""
    import json

    from decentral.data.batches import eval_batches
    from decentral.data.corpus import load_corpus

    model, recipe = load_run(run)
    train = recipe.recipe.train
    batches = eval_batches(load_corpus(data).val, batch_size=train.batch_size, context=train.context,
                           num_batches=train.eval_batches)
    result = {"run": str(run), "stages": recipe.pipeline.stages, "skip": recipe.pipeline.skip,
              **evaluate_dropping(model, recipe.pipeline.stages, batches, drop, draws, seed)}
    (Path(run) / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def format_evaluation(result: dict) -> str:
    from decentral.metrics import format_table

    rows = [("validation", "loss", "perplexity", "vs whole"),
            (f"whole model ({result['stages']} stages)", f"{result['full_loss']:.4f}", f"{result['full_ppl']:.3f}", ""),
            (f"{result['kept_stages']} of {result['stages']} stages (mean of {result['subsets']} subset{'s' if result['subsets'] != 1 else ''})",
             f"{result['dropped_loss']:.4f}", f"{result['dropped_ppl']:.3f}", f"{result['ppl_increase']:+.1%}")]
    return format_table(rows)
