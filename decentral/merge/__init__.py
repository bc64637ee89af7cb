"""Model merging from YAML recipes (merges/*.yaml): one file per method, streamed tensor by tensor.

    recipe = load_merge_recipe("merges/ties.yaml")
    expert = merge(recipe, "runs/btm/experts/merged")   # an expert folder, see decentral.experts.registry

Methods (ALGORITHMS.md §6-7): linear, posterior, task_arithmetic, ties, dare, slerp, model_stock.
"""

from __future__ import annotations

from decentral.merge.base import MergeError, MergeMethod
from decentral.merge.dare import DARE
from decentral.merge.linear import LINEAR
from decentral.merge.model_stock import MODEL_STOCK
from decentral.merge.posterior import POSTERIOR
from decentral.merge.recipe import MergeRecipe, ModelRef, load_merge_recipe, parse_merge_recipe
from decentral.merge.run import merge
from decentral.merge.slerp import SLERP
from decentral.merge.task_arithmetic import TASK_ARITHMETIC
from decentral.merge.ties import TIES

METHODS: dict[str, MergeMethod] = {m.name: m for m in (LINEAR, POSTERIOR, TASK_ARITHMETIC, TIES, DARE, SLERP, MODEL_STOCK)}

__all__ = ["METHODS", "MergeError", "MergeMethod", "MergeRecipe", "ModelRef", "load_merge_recipe",
           "parse_merge_recipe", "merge"]
