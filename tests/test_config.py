"""Recipes: the shipped ones carry the papers' defaults; malformed ones fail with a message that says where."""

import inspect

import pytest
import torch

from decentral.cli import main
from decentral.config import RecipeError, default_recipe_path, load_recipe, parse_recipe, parse_settings, recipe_path
from decentral.sync import DiLoCo, NoLoCo


def test_shipped_recipes_carry_the_papers_outer_defaults_or_say_why_not():
    noloco = load_recipe(default_recipe_path("noloco"))
    assert noloco.protocol == "noloco"
    assert {k: noloco.protocol_args[k] for k in ("every", "group_size", "nesterov")} == {
        "every": 50, "group_size": 2, "nesterov": False,
    }
    # The NoLoCo class keeps the paper's α 0.5, β = γ 0.7; the short recipe departs and says why.
    defaults = inspect.signature(NoLoCo).parameters
    assert (defaults["alpha"].default, defaults["beta"].default, defaults["gamma"].default) == (0.5, 0.7, None)
    args = noloco.protocol_args
    if (args["alpha"], args["beta"], args["gamma"]) != (0.5, 0.7, 0.7):
        assert "measured" in default_recipe_path("noloco").read_text()
        alpha, beta, gamma = args["alpha"], args["beta"], args["gamma"]
        assert beta > alpha and alpha < gamma < (2 + alpha**2) ** 0.5  # the paper's stability region (n = 2)
    diloco = load_recipe(default_recipe_path("diloco"))
    assert diloco.protocol_args["nesterov"] is True
    # The DiLoCo class keeps the paper's 0.7 / 0.9; the short laptop-scale recipe departs and says why.
    defaults = inspect.signature(DiLoCo).parameters
    assert (defaults["outer_lr"].default, defaults["outer_momentum"].default) == (0.7, 0.9)
    if (diloco.protocol_args["outer_lr"], diloco.protocol_args["outer_momentum"]) != (0.7, 0.9):
        assert "measured" in default_recipe_path("diloco").read_text()
    assert load_recipe(default_recipe_path("ddp")).protocol == "ddp"
    long = load_recipe(recipe_path("diloco-long"))  # the long-run variant: diloco.yaml but for H and the codec
    assert long.protocol == "diloco" and (long.protocol_args["every"], long.swarm.codec) == (25, "int4")
    assert {k: v for k, v in long.protocol_args.items() if k != "every"} == {
        k: v for k, v in diloco.protocol_args.items() if k != "every"}
    assert (long.model, long.swarm.timeout) == (diloco.model, diloco.swarm.timeout)


def test_numbers_are_coerced_and_defaults_fill_in():
    recipe = parse_recipe({"train": {"lr": "3e-3", "steps": 10.0}, "model": {"d_model": 64}})
    assert recipe.train.lr == 0.003 and recipe.train.steps == 10 and isinstance(recipe.train.steps, int)
    assert recipe.model.d_model == 64 and recipe.model.n_layer == 4 and recipe.protocol == "noloco"


def test_model_source_round_trips_and_gpt_recipes_stay_as_they_were():
    hf = parse_recipe({"model": {"source": "hf:/models/llama/config.json"}})
    assert hf.model_source == "hf:/models/llama/config.json" and hf.to_dict()["model"] == {"source": hf.model_source}
    assert parse_recipe(hf.to_dict()).model_source == hf.model_source
    gpt = parse_recipe({"model": {"d_model": 64}})
    assert gpt.model_source == "gpt" and "source" not in gpt.to_dict()["model"]
    assert parse_recipe({"model": {"source": "gpt", "d_model": 64}}).model == gpt.model


@pytest.mark.parametrize(
    "data, message",
    [
        ({"train": {"stepz": 3}}, "unknown key(s) ['stepz']"),
        ({"train": {"steps": 2.5}}, "train.steps: expected int"),
        ({"train": {"lr": "fast"}}, "train.lr: expected float"),
        ({"protocol": {"name": "gossip"}}, "'gossip' is not one of"),
        ({"protocol": {"name": "noloco", "outer_lr": 1}}, "has no parameter(s) ['outer_lr']"),
        ({"swarm": {"timeout": True}}, "swarm.timeout: expected float"),
        ({"extras": {}}, "unknown section(s) ['extras']"),
        ({"model": {"sourc": "hf:c.json"}}, "unknown key(s) ['sourc']; allowed: ['context', 'd_model', 'dropout', "
                                            "'n_head', 'n_layer', 'source', 'vocab_size']"),
        ({"model": {"source": "hf:c.json", "n_layer": 2}}, "['n_layer'] shape the reference GPT; source 'hf:c.json'"),
        ({"model": {"source": ""}}, "model.source: model source '': expected gpt, hf:CONFIG.json or a save_pretrained"),
        ({"model": {"source": 3}}, "model.source: expected str"),
        # GPTConfig's own checks, made when the recipe is read rather than when a worker builds the model
        ({"model": {"d_model": 97, "n_head": 4}}, "model.d_model (97) must be divisible by n_head (4)"),
        ({"model": {"n_layer": 0}}, "model.n_layer must be a positive integer, got 0"),
        ({"model": {"dropout": 1.0}}, "model.dropout must be a number in [0, 1), got 1.0"),
        ([1, 2], "expected a mapping"),
        ({"train": {"steps": 0}}, "train.steps: must be >= 1, got 0"),
        ({"train": {"eval_every": 0}}, "train.eval_every: must be >= 1"),
        ({"train": {"lr": -1e-3}}, "train.lr: must be a number > 0"),
        ({"train": {"lr": float("inf")}}, "train.lr: must be a number > 0"),
        ({"swarm": {"timeout": float("nan")}}, "swarm.timeout: must be a number of seconds > 0"),
        ({"protocol": "noloco"}, "protocol must be a mapping, e.g. {name: noloco, every: 50}, got 'noloco'"),
        ({"protocol": {"name": ["noloco"]}}, "protocol.name ['noloco'] is not one of"),
        ({"train": {"min_lr_ratio": 1.5}}, "train.min_lr_ratio: must be in [0, 1]"),
        ({"train": {"grad_clip": 0}}, "train.grad_clip: must be > 0"),
        ({"protocol": {"name": "noloco", "every": "often"}}, "protocol.every: expected int, got 'often'"),
        # values only the protocol's constructor knows to refuse, refused before any worker starts
        ({"protocol": {"name": "diloco", "every": 0}}, "protocol 'diloco': every (H, inner steps per outer step) must"),
        ({"protocol": {"name": "co2", "mix": 2}}, "protocol 'co2': mix (α, the share of our own progress"),
        ({"protocol": {"name": "streaming", "every": 50, "fragments": 3, "delay": 20}}, "protocol 'streaming': delay"),
    ],
)
def test_malformed_recipes_say_what_is_wrong(data, message):
    with pytest.raises(RecipeError) as e:
        parse_recipe(data, "r.yaml")
    assert message in str(e.value) and "r.yaml" in str(e.value)


@pytest.mark.parametrize("name, setting, value", [
    ("diloco", "outer_lr", -1), ("diloco", "outer_lr", 0), ("diloco", "outer_lr", float("inf")),
    ("diloco", "outer_momentum", 1), ("streaming", "outer_lr", float("nan")), ("streaming", "outer_momentum", -0.1),
    ("co2", "outer_lr", 0), ("co2", "outer_momentum", 1.5),
    ("noloco", "group_size", 0), ("noloco", "group_size", 1), ("noloco", "alpha", -5), ("noloco", "alpha", 1),
    ("noloco", "beta", 0.1), ("noloco", "beta", float("inf")), ("noloco", "gamma", 0.1), ("noloco", "gamma", 1.5),
])
def test_out_of_range_protocol_settings_are_refused_when_the_recipe_is_read(name, setting, value):
    """group_size=0 crashed the first round boundary; outer_lr=-1, alpha=-5, group_size=1 were taken silently.
    (noloco.yaml's alpha is 0.25: beta must exceed it and gamma stay below √(2 + 0.25²) ≈ 1.44.)"""
    with pytest.raises(RecipeError) as e:
        load_recipe(default_recipe_path(name), {setting: value})
    message = str(e.value)
    assert f"--set {setting}=" in message and f": {setting} (" in message and "\n" not in message, message


def test_cli_reports_a_bad_recipe_file_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("protocol: {name: noloco\n")
    assert main(["train", "--protocol", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "not valid YAML" in err and str(bad) in err
    assert main(["train", "--protocol", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_set_changes_one_setting_of_a_recipe_and_names_itself_in_errors(tmp_path, capsys):
    path = default_recipe_path("diloco")
    recipe = load_recipe(path, parse_settings(["swarm.codec=int8", "outer_lr=0.7", "train.lr=1e-3", "nesterov=false",
                                               "island.size=2"]))
    assert recipe.swarm.codec == "int8" and recipe.train.lr == 1e-3 and recipe.island.size == 2
    assert recipe.protocol_args["outer_lr"] == 0.7 and recipe.protocol_args["nesterov"] is False
    shipped = load_recipe(path)
    assert recipe.protocol_args["every"] == shipped.protocol_args["every"]  # the rest as the recipe says
    assert recipe.train.steps == shipped.train.steps and recipe.model == shipped.model
    bare = tmp_path / "bare.yaml"
    bare.write_text("protocol: {name: diloco}\nswarm:\n")  # a section left empty, or none at all
    assert load_recipe(bare, {"swarm.codec": "int4", "train.steps": 7}).swarm.codec == "int4"
    for bad in ("swarm.codec", "=1", "outer_lr="):
        with pytest.raises(RecipeError, match="expected KEY=VALUE"):
            parse_settings([bad])
    assert main(["train", "--protocol", "diloco", "--set", "swarm.codecc=int8", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "with --set swarm.codecc=int8: swarm: unknown key(s) ['codecc']" in err and len(err.splitlines()) == 1


def test_setting_another_model_source_drops_the_recipes_gpt_shape():
    """Every shipped recipe shapes the reference GPT; `--set model.source=hf:...` was refused on each."""
    path = default_recipe_path("diloco")
    recipe = load_recipe(path, parse_settings(["model.source=hf:tiny/config.json"]))
    assert recipe.model_source == "hf:tiny/config.json"
    assert load_recipe(path, parse_settings(["model.source=gpt", "model.n_layer=3"])).model.n_layer == 3
    with pytest.raises(RecipeError, match=r"\['n_layer'\] shape the reference GPT"):
        load_recipe(path, parse_settings(["model.n_layer=3", "model.source=hf:tiny/config.json"]))


def test_reading_a_recipe_leaves_torchs_random_generator_as_it_was():
    """Its protocol settings are checked by building the protocol on a probe model (check_protocol_settings):
    a worker that seeds and then reads a recipe must still build the weights that seed gives."""
    for name in ("co2", "diloco", "noloco", "streaming", "ddp"):
        torch.manual_seed(0)
        load_recipe(default_recipe_path(name))
        after = torch.rand(4)
        torch.manual_seed(0)
        assert torch.equal(after, torch.rand(4)), name
