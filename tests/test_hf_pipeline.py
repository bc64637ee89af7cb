"""SkipPipe stages of a Llama-style Hugging Face model: run in order they are the model, a skipped stage is the model
without its layers, and stage weights travel under the model's own names."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from decentral.models import GPTConfig, build_model  # noqa: E402
from decentral.models.hf import HFCausalLM, save_pretrained_layout  # noqa: E402
from decentral.pipeline.network import NetworkError  # noqa: E402
from decentral.pipeline.stages import (  # noqa: E402
    LlamaStage, _causal_mask_arguments, assemble, cut, make_stage, partial_loss)

TINY_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=256, max_position_embeddings=64)


def write_config(folder, **changes) -> str:
    transformers.LlamaConfig(**{**TINY_LLAMA, **changes}).save_pretrained(folder)
    return f"hf:{folder / 'config.json'}"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    return write_config(tmp_path_factory.mktemp("llama"))


def llama(source: str, seed: int = 0) -> HFCausalLM:
    torch.manual_seed(seed)
    return build_model(source, GPTConfig(), 32)


def tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.randint(0, 256, (3, 33), generator=torch.Generator().manual_seed(seed))
    return rows[:, :-1], rows[:, 1:]


@pytest.mark.parametrize("tied", [False, True])
def test_llama_stages_in_order_are_the_model_exactly(tmp_path, tied):
    model = llama(write_config(tmp_path, tie_word_embeddings=tied))
    x, y = tokens()
    logits, loss = model(x, y)
    for count in (2, 3, 4):
        stages = cut(model, count)
        assert all(isinstance(s, LlamaStage) for s in stages) and stages[0].embed is model.lm.model.embed_tokens
        assert all(a is b for a, b in zip([b for s in stages for b in s.blocks], model.lm.model.layers, strict=True))
        h = stages[0].begin(x)
        for stage in stages[1:]:
            h = stage(h)
        assert torch.equal(stages[0].head(h), logits)
        assert torch.equal(stages[0].loss(h, y), loss)
        assert torch.equal(partial_loss(model, count, tuple(range(count)), x, y), loss)
    # the gradients of the stages are the model's
    params = list(model.parameters())
    staged = torch.autograd.grad(partial_loss(model, 2, (0, 1), x, y), params)
    whole = torch.autograd.grad(model(x, y)[1], params)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(staged, whole))


def test_a_bare_model_with_eager_attention_is_cut_by_its_own_mask():
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA, attn_implementation="eager"))
    assert lm.config._attn_implementation == "eager"  # the mask is a tensor the stages build, not SDPA's is_causal
    stages = cut(lm, 3)
    assert "model.layers.3.self_attn.q_proj.weight" in stages[2].global_state_dict()
    x, _ = tokens(3)
    h = stages[0].begin(x)
    for stage in stages[1:]:
        h = stage(h)
    assert torch.equal(stages[0].head(h), lm(input_ids=x).logits)


def test_a_skipped_stage_is_the_model_without_its_layers(source):
    model = llama(source)
    x, y = tokens(1)
    short = copy.deepcopy(model.lm)  # transformers' own forward through layers 0, 2 and 3
    short.model.layers = nn.ModuleList(short.model.layers[i] for i in (0, 2, 3))
    short.config.num_hidden_layers = 3
    skipped = partial_loss(model, 4, (0, 2, 3), x, y)
    assert torch.equal(skipped, HFCausalLM(short)(x, y)[1])
    assert not torch.equal(skipped, model(x, y)[1])
    with pytest.raises(NetworkError, match="must start at stage 0"):
        partial_loss(model, 4, (1, 2), x, y)


def test_llama_stage_weights_travel_under_the_models_own_names(tmp_path, source):
    stages = [make_stage(GPTConfig(), 2, s, seed=5, source=source, context=32) for s in range(2)]
    again = make_stage(GPTConfig(), 2, 1, seed=5, source=source, context=32)
    assert all(torch.equal(a, b) for a, b in zip(stages[1].parameters(), again.parameters()))
    parts = [s.global_state_dict() for s in stages]
    assert "lm.model.layers.3.mlp.up_proj.weight" in parts[1] and "lm.lm_head.weight" in parts[0]
    assert set(parts[0]) | set(parts[1]) == set(llama(source).state_dict())

    whole = assemble(GPTConfig(), parts, source=source, context=32)
    x, y = tokens(2)
    h = stages[1](stages[0].begin(x))
    assert torch.equal(whole(x)[0], stages[0].head(h))
    save_pretrained_layout(whole.lm, tmp_path / "whole")  # what a pipeline's model is once trained
    reopened = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "whole", local_files_only=True)
    assert torch.equal(reopened(input_ids=x).logits, stages[0].head(h))

    other = make_stage(GPTConfig(), 2, 1, seed=6, source=source, context=32)
    other.load_global_state_dict(parts[1])
    assert torch.equal(other(h), stages[1](h))
    with pytest.raises(NetworkError, match="stage 1: the weights lack"):
        other.load_global_state_dict(parts[0])


def test_a_model_that_is_not_llama_style_is_refused():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=256))
    with pytest.raises(NetworkError, match="a Llama-style model .* GPT2LMHeadModel is neither"):
        cut(HFCausalLM(gpt2), 2)


def test_one_microbatch_through_the_grpc_pipeline_is_the_hf_models_math(tmp_path, small_corpus, source):
    """The runtime (stage servers over gRPC, in this process) trains a Llama as the whole model along the same path
    does: loss, one AdamW step per stage; `pipeline eval`'s model is put together from the stage checkpoints."""
    from decentral.data.corpus import load_corpus
    from decentral.pipeline.evaluate import load_run
    from decentral.pipeline.node import StageNode
    from decentral.pipeline.recipe import parse_pipeline_recipe
    from test_pipeline_runtime import TRAIN, InProcessPipeline, first_iteration_by_hand, tiny_recipe

    class HFPipeline(InProcessPipeline):
        def make(self, name: str, stage: int) -> StageNode:
            r = self.recipe.recipe
            return StageNode(name, make_stage(r.model, 4, stage, r.train.seed, r.model_source, r.train.context),
                             self.recipe, memory=3, tokens=self.tokens if stage == 0 else None, out=tmp_path / name)

    recipe = parse_pipeline_recipe({**tiny_recipe(4, 0.25, 1), "model": {"source": source}})
    assert recipe.activation_bytes() == TRAIN["batch_size"] * TRAIN["context"] * TINY_LLAMA["hidden_size"] * 4
    tokens = load_corpus([small_corpus]).train
    pipeline = HFPipeline(recipe, {"h": 0, "a": 1, "b": 2, "c": 3}, tokens)
    try:
        record = pipeline.coordinator.run_iteration(0)
        order = [pipeline.nodes[name].stage.index for name in pipeline.events[0]["routes"][0]]
        for node in pipeline.nodes.values():
            node.save()
    finally:
        pipeline.close()
    model = llama(source, recipe.recipe.train.seed)
    loss = first_iteration_by_hand(model, order, tokens, recipe)
    assert len(order) == 3 and record["loss"] == pytest.approx(loss, rel=1e-6)
    expected = model.state_dict()
    for node in pipeline.nodes.values():
        assert all(torch.allclose(v, expected[k], atol=1e-6) for k, v in node.stage.global_state_dict().items())
    assembled, _ = load_run(tmp_path)
    assert all(torch.allclose(v, expected[k], atol=1e-6) for k, v in assembled.state_dict().items())


@pytest.mark.parametrize("names, expected", [  # create_causal_mask's parameters in transformers 4.56-5.0, 5.17, 5.24
    (["config", "input_embeds", "attention_mask", "cache_position", "past_key_values", "position_ids"],
     ["input_embeds", "past_key_values", "cache_position"]),
    (["config", "inputs_embeds", "attention_mask", "past_key_values", "position_ids"], ["inputs_embeds", "past_key_values"]),
    (["config", "inputs_embeds", "attention_mask", "cache", "position_ids"], ["inputs_embeds", "cache"]),
])
def test_the_causal_masks_arguments_follow_the_names_the_installed_transformers_takes(names, expected):
    h, positions = torch.zeros(2, 5, 8), torch.arange(5).unsqueeze(0)
    arguments = _causal_mask_arguments(names)(h, positions)
    assert list(arguments) == expected and arguments[expected[0]] is h and arguments[expected[1]] is None
    if "cache_position" in expected:
        assert torch.equal(arguments["cache_position"], torch.arange(5))
