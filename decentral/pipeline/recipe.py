"""SkipPipe recipes (protocols/skippipe.yaml): a `pipeline` section on top of an ordinary recipe.

    pipeline: {stages: 6, skip: 0.33, microbatches: 6, memory: 3, routing: planned, ...}
    protocol: {name: diloco, every: 50, ...}   # how the replicas of each stage stay in sync (local: not at all)
    train:    {steps: 300, batch_size: 8, ...}  # steps are iterations; batch_size is sequences per microbatch
    model:    {n_layer: 6, ...}                 # or {source: hf:CONFIG.json}: a Llama-style Hugging Face model
    swarm:    {run: skippipe, timeout: 60, ...} # the DHT the nodes find each other through, and the stage groups

Unknown keys are errors naming the key (RecipeError), as for every recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from decentral.config import Recipe, RecipeError, default_recipe_path, parse_recipe, read_yaml, typed_section
from decentral.models import GPT_SOURCE, HF_CONFIG_PREFIX
from decentral.pipeline.frames import DTYPES
from decentral.pipeline.network import DEFAULT_MEMORY, Network, Node, parse_network

ROUTINGS = ("planned", "random")


@dataclass
class PipelineConfig:
    stages: int = 6
    skip: float = 0.33  # share of stages a microbatch skips (constraints.path_length)
    microbatches: int = 6  # per iteration
    nodes: int = 0  # nodes of the loopback network used when no network file is given (0: one per stage)
    memory: int = DEFAULT_MEMORY  # microbatches resident per node, in that loopback network
    routing: str = "planned"  # or "random": each microbatch takes a random replica of each stage it visits
    wire_dtype: str = "float32"  # activations and gradients on the wire
    network: str = ""  # a network file (decentral.pipeline.network); "" = the loopback network above
    link_timeout: float = 60.0  # the longest one message may take before its receiver counts as gone
    effort: float = 0.3  # the planner's search effort (decentral.pipeline.planner.plan)
    calibrate_at: int = 0  # after this iteration (1: the first; 0: never) re-plan with the compute the nodes measured in it


@dataclass
class PipelineRecipe:
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    recipe: Recipe = field(default_factory=Recipe)  # protocol (replica sync), train, model, swarm

    def to_dict(self) -> dict:
        return {"pipeline": vars(self.pipeline).copy(), **self.recipe.to_dict()}

    def activation_bytes(self) -> int:
        """Bytes of one microbatch's activations (and gradients) on the wire."""
        itemsize = 2 if self.pipeline.wire_dtype != "float32" else 4
        train = self.recipe.train
        return train.batch_size * train.context * self.hidden_width() * itemsize

    def hidden_width(self) -> int:
        """The width of the hidden states between stages: model.d_model, or a Hugging Face config's hidden_size."""
        source = self.recipe.model_source
        if source == GPT_SOURCE:
            return self.recipe.model.d_model
        try:
            import transformers
        except ImportError:
            raise RecipeError("Hugging Face models need transformers: pip install 'decentral[hf]'") from None
        path = source[len(HF_CONFIG_PREFIX):] if source.startswith(HF_CONFIG_PREFIX) else source
        try:
            return int(transformers.AutoConfig.from_pretrained(path).get_text_config().hidden_size)
        except (OSError, ValueError, AttributeError) as e:
            raise RecipeError(f"model.source {source}: no transformers config with a hidden_size there "
                              f"({type(e).__name__})") from None


def parse_pipeline_recipe(data, where: str = "recipe") -> PipelineRecipe:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping at the top level")
    rest = {key: value for key, value in data.items() if key != "pipeline"}
    rest.setdefault("protocol", {"name": "local"})
    config = typed_section(PipelineConfig, data.get("pipeline"), f"{where}: pipeline")
    if config.routing not in ROUTINGS:
        raise RecipeError(f"{where}: pipeline.routing must be one of {list(ROUTINGS)}, got {config.routing!r}")
    if config.wire_dtype not in DTYPES:
        raise RecipeError(f"{where}: pipeline.wire_dtype must be one of {sorted(DTYPES)}, got {config.wire_dtype!r}")
    if config.stages < 2 or config.microbatches < 1 or config.memory < 1 or min(config.nodes, config.calibrate_at) < 0:
        raise RecipeError(f"{where}: pipeline needs stages >= 2, microbatches >= 1, memory >= 1, nodes >= 0 and "
                          "calibrate_at >= 0")
    if not 0 <= config.skip < 1:
        raise RecipeError(f"{where}: pipeline.skip is the share of stages a microbatch skips, in [0, 1); got "
                          f"{config.skip}")
    if not config.network and 0 < config.nodes < config.stages:
        raise RecipeError(f"{where}: pipeline.nodes {config.nodes} cannot hold {config.stages} stages (0: one node "
                          "per stage)")
    recipe = parse_recipe(rest, where)
    recipe.check_context(where)
    if recipe.model_source == GPT_SOURCE and recipe.model.n_layer < config.stages:
        raise RecipeError(f"{where}: {config.stages} stages need at least {config.stages} transformer blocks "
                          f"(model.n_layer), the model has {recipe.model.n_layer}: is this a SkipPipe recipe?")
    return PipelineRecipe(config, recipe)


SHIPPED_RECIPE = default_recipe_path("skippipe")  # what a command that takes --recipe uses without one


def load_pipeline_recipe(path: str | Path) -> PipelineRecipe:
    return parse_pipeline_recipe(read_yaml(path), str(path))


def loopback_network(recipe: PipelineRecipe) -> Network:
    """`pipeline.nodes` equal nodes (one per stage when 0) on fast links: what planning assumes when
    no network file describes the real one."""
    config = recipe.pipeline
    count = config.nodes or config.stages
    nodes = [Node(f"n{i:02d}", 1.0, config.memory) for i in range(count)]
    return parse_network({"nodes": [{"name": n.name, "compute_ms": n.compute_ms, "memory": n.memory} for n in nodes],
                          "default_link": {"latency_ms": 0.1, "bandwidth_mbps": 10000}}, source="loopback network",
                         shape=network_shape(recipe))


def network_shape(recipe: PipelineRecipe) -> dict[str, Any]:
    """The recipe's training shape as a network's: stages, skip, microbatches and activation size."""
    config = recipe.pipeline
    return {"stages": config.stages, "skip": config.skip, "microbatches": config.microbatches,
            "activation_bytes": recipe.activation_bytes()}


def shaped_network(network: Network, recipe: PipelineRecipe) -> Network:
    """`network` with the recipe's training shape (the recipe wins)."""
    return network.replace(**network_shape(recipe))
