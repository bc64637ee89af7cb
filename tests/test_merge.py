"""Model merging: each method against arithmetic done here by hand or in numpy, the safetensors reader
and writer, recipes, the driver end to end on real GPT experts (and every way it refuses), memory."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save

from decentral.experts.registry import Expert, model_bytes, read_expert, write_expert
from decentral.merge import METHODS, MergeError, load_merge_recipe, merge, parse_merge_recipe
from decentral.merge.bench import bench_config, run_merge_bench, write_random_experts
from decentral.merge.tensors import CODES, SafetensorsReader, SafetensorsWriter, TensorFileError
from decentral.models import GPT, GPTConfig

REPO = Path(__file__).resolve().parent.parent
TINY = GPTConfig(n_layer=2, n_head=2, d_model=32, context=32)


def t(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def run_method(method: str, base, tensors, weights=None, name="w", **params) -> np.ndarray:
    weights = weights or [1.0] * len(tensors)
    return METHODS[method].merge(base, tensors, weights, name=name, **params).numpy()


# --- methods -------------------------------------------------------------------------------------------


def test_linear_weighted_average_normalised_and_not():
    a, b = t(1.0, 2.0, -3.0), t(3.0, -2.0, 1.0)
    np.testing.assert_allclose(run_method("linear", None, [a, b], [1.0, 3.0]), [2.5, -1.0, 0.0])  # (a + 3b) / 4
    np.testing.assert_allclose(run_method("linear", None, [a, b], [1.0, 3.0], normalize=False), [10.0, -4.0, 0.0])
    np.testing.assert_allclose(run_method("linear", None, [a, b, t(2.0, 3.0, 5.0)]), [2.0, 1.0, 1.0])


def test_task_arithmetic_adds_scaled_task_vectors():
    base = t(1.0, 1.0)
    experts = [t(2.0, 0.0), t(1.0, 3.0)]  # task vectors (1, -1) and (0, 2)
    # base + 0.5 * (2 * (1, -1) + 1 * (0, 2)) = (1, 1) + 0.5 * (2, 0)
    np.testing.assert_allclose(run_method("task_arithmetic", base, experts, [2.0, 1.0], **{"lambda": 0.5}), [2.0, 1.0])
    np.testing.assert_allclose(run_method("task_arithmetic", base, experts), [2.0, 2.0])  # λ = 1 by default


def test_ties_trims_elects_and_averages_the_agreeing_entries():
    base = torch.zeros(5)
    tau1, tau2 = t(3.0, -1.0, 2.0, 0.5, -4.0), t(1.0, -2.0, -3.0, 0.1, 4.0)
    # density 0.4 of 5 entries keeps the 2 largest magnitudes: tau1 -> (3, 0, 0, 0, -4), tau2 -> (0, 0, -3, 0, 4)
    # sum (3, 0, -3, 0, 0): signs +, 0, -, 0, 0 -> entry 0 only tau1 agrees: 3; entry 2 only tau2: -3;
    # entry 4 is an exact tie (-4 + 4): stays at the base
    out = run_method("ties", base, [tau1, tau2], density=0.4)
    np.testing.assert_allclose(out, [3.0, 0.0, -3.0, 0.0, 0.0])


def test_ties_weighted_disjoint_mean_and_lambda():
    base = t(1.0, -1.0)
    taus = [t(2.0, -1.0), t(-1.0, -3.0), t(1.0, 2.0)]
    weights = [1.0, 2.0, 1.0]
    # sum of w * tau = (2 - 2 + 1, -1 - 6 + 2) = (1, -5): signs (+, -)
    # entry 0: tau1 (2) and tau3 (1) agree, weights 1 and 1 -> (2 + 1) / 2 = 1.5
    # entry 1: tau1 (-1, w 1) and tau2 (-3, w 2) agree -> (-1 - 6) / 3 = -7/3
    out = run_method("ties", base, [base + tau for tau in taus], weights, density=1.0, **{"lambda": 0.5})
    np.testing.assert_allclose(out, [1.0 + 0.5 * 1.5, -1.0 + 0.5 * (-7 / 3)], rtol=1e-6)


@pytest.mark.parametrize("method, params", [("linear", {}), ("ties", {"density": 1.0}),
                                            ("dare", {"density": 1.0, "ties": True})])
def test_a_weighted_mean_takes_only_the_weights_ratios_however_far_from_1_they_are(method, params):
    """Weights about 1e39 overflowed float32 (every merged value infinite: a MergeError) and weights about
    1e-40 fell below its normal range (ties' denominator was clamped to float32's smallest normal): methods
    that take only the weights' ratios now give, for them, what 1 and 3 give, bit for bit (the scales are
    powers of two, so the ratios are exactly 1 to 3)."""
    base = t(0.5, -1.0, 2.0)
    experts = [base + t(1.0, 2.0, -3.0), base + t(3.0, -2.0, 1.0)]
    expected = run_method(method, base, experts, [1.0, 3.0], **params)
    for scale in (2.0 ** 130, 2.0 ** -133):
        np.testing.assert_array_equal(run_method(method, base, experts, [scale, 3 * scale], **params), expected)


def test_ties_exact_sign_tie_keeps_the_base_value():
    base = t(5.0, 5.0, 5.0)
    experts = [base + t(1.0, 2.0, 1.0), base + t(-1.0, 1.0, -2.0)]
    # entry 0: +1 and -1 cancel: the base; entry 1: both positive, mean 1.5; entry 2: sum -1, only -2 agrees
    np.testing.assert_allclose(run_method("ties", base, experts, [1.0, 1.0], density=1.0), [5.0, 6.5, 3.0])
    # weights 2, 1: entry 0 is 2 - 1 > 0, only +1 agrees; entry 1 (2·2 + 1·1) / 3;
    # entry 2 is 2·(+1) + 1·(-2) = 0, a tie: the base
    np.testing.assert_allclose(run_method("ties", base, experts, [2.0, 1.0], density=1.0), [6.0, 5.0 + 5 / 3, 5.0],
                               rtol=1e-6)
    # symmetric: negating every task vector negates the merged change
    negated = [base - (e - base) for e in experts]
    np.testing.assert_allclose(run_method("ties", base, negated, density=1.0), [5.0, 3.5, 7.0])


def test_ties_trim_keeps_entries_tied_with_the_smallest_kept_magnitude():
    base = torch.zeros(4)
    # density 0.5 of 4 keeps 2: magnitude 2, then 1 and -1 tie for second place: both kept
    np.testing.assert_allclose(run_method("ties", base, [t(1.0, -1.0, 0.5, 2.0)], density=0.5), [1.0, -1.0, 0.0, 2.0])
    # a tiny density still keeps one entry (the largest)
    np.testing.assert_allclose(run_method("ties", base, [t(1.0, -3.0, 0.5, 2.0)], density=0.01), [0.0, -3.0, 0.0, 0.0])


def test_dare_is_seeded_per_tensor_and_rescales_what_it_keeps():
    base = torch.zeros(1000)
    expert = torch.full((1000,), 0.3)
    out = run_method("dare", base, [expert], density=0.25, seed=7)
    kept = out != 0
    np.testing.assert_allclose(out[kept], 0.3 / 0.25, rtol=1e-6)  # kept entries scaled by 1/density
    assert 0.19 < kept.mean() < 0.31  # about a quarter kept (4 binomial sigmas)
    np.testing.assert_array_equal(out, run_method("dare", base, [expert], density=0.25, seed=7))  # reproducible
    assert (out != run_method("dare", base, [expert], density=0.25, seed=8)).any()  # another seed, another mask
    assert (out != run_method("dare", base, [expert], name="other", density=0.25, seed=7)).any()  # per tensor name
    # two experts with the same task vector get different masks (the expert's index is in the seed)
    pair = METHODS["dare"].merge(base, [expert, expert], [1.0, 1.0], name="w", density=0.25, seed=7).numpy()
    assert not np.isin(pair, [0.0, 2 * 1.2]).all()


def test_dare_with_density_one_is_task_arithmetic_or_ties():
    base = t(1.0, -1.0)
    experts = [base + t(2.0, -1.0), base + t(-1.0, -3.0), base + t(1.0, 2.0)]
    weights = [1.0, 2.0, 1.0]
    # task arithmetic by hand: base + 0.5 * (1·(2, -1) + 2·(-1, -3) + 1·(1, 2)) = base + 0.5 * (1, -5)
    np.testing.assert_allclose(run_method("dare", base, experts, weights, density=1.0, **{"lambda": 0.5}),
                               [1.5, -3.5])
    # with ties: the disjoint mean of test_ties_weighted_disjoint_mean_and_lambda, (1.5, -7/3)
    np.testing.assert_allclose(run_method("dare", base, experts, weights, density=1.0, ties=True),
                               [2.5, -1.0 - 7 / 3], rtol=1e-6)


def test_slerp_on_orthogonal_vectors_follows_the_arc():
    v0, v1 = t(2.0, 0.0, 0.0), t(0.0, 3.0, 0.0)  # Ω = π/2, sin Ω = 1
    np.testing.assert_allclose(run_method("slerp", None, [v0, v1], t=0.0), [2.0, 0.0, 0.0], atol=1e-7)
    np.testing.assert_allclose(run_method("slerp", None, [v0, v1], t=1.0), [0.0, 3.0, 0.0], atol=1e-7)
    half = math.sin(math.pi / 4)
    np.testing.assert_allclose(run_method("slerp", None, [v0, v1], t=0.5), [2 * half, 3 * half, 0.0], rtol=1e-6)
    third = run_method("slerp", None, [v0, v1], t=1 / 3)  # sin(π/3)·v0 + sin(π/6)·v1
    np.testing.assert_allclose(third, [2 * math.sin(math.pi / 3), 3 * 0.5, 0.0], rtol=1e-6)


def test_slerp_falls_back_to_lerp_when_parallel_or_zero():
    v0 = torch.linspace(1.0, 2.0, 64)
    v1 = 1.5 * v0 + 1e-4 * torch.sin(torch.arange(64.0))  # cos Ω ≈ 1 - 1e-9
    out = run_method("slerp", None, [v0, v1], t=0.3)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, (0.7 * v0 + 0.3 * v1).numpy(), rtol=1e-6)
    np.testing.assert_allclose(run_method("slerp", None, [v0, -v0], t=0.25), (0.5 * v0).numpy(), rtol=1e-6)
    np.testing.assert_allclose(run_method("slerp", None, [torch.zeros(3), t(1.0, 2.0, 3.0)], t=0.5), [0.5, 1.0, 1.5])
    np.testing.assert_allclose(run_method("slerp", None, [torch.zeros(3), torch.zeros(3)], t=0.5), [0.0, 0.0, 0.0])
    # a lower threshold makes a 60° pair "parallel" too: lerp
    a, b = t(1.0, 0.0), t(0.5, math.sqrt(3) / 2)
    np.testing.assert_allclose(run_method("slerp", None, [a, b], t=0.5, parallel_threshold=0.4), [0.75, math.sqrt(3) / 4])


def test_model_stock_ratio_from_the_pairwise_cosine():
    base = t(1.0, 1.0, 1.0)
    tau1, tau2 = t(1.0, 0.0, 0.0), t(0.5, math.sqrt(3) / 2, 0.0)  # cos = 0.5 -> t = 2·0.5 / (1 + 0.5) = 2/3
    experts = [base + tau1, base + tau2]
    expected = 2 / 3 * (experts[0] + experts[1]).numpy() / 2 + 1 / 3 * base.numpy()
    np.testing.assert_allclose(run_method("model_stock", base, experts), expected, rtol=1e-6)
    # three pairwise orthogonal task vectors: cos 0 -> t 0 -> the base
    ortho = [base + 2 * t(1.0, 0.0, 0.0), base + t(0.0, 3.0, 0.0), base + t(0.0, 0.0, 1.0)]
    np.testing.assert_allclose(run_method("model_stock", base, ortho), base.numpy(), atol=1e-7)
    # three parallel task vectors: cos 1 -> t = 3 / (1 + 2) = 1 -> their mean
    same = [base + k * t(1.0, 2.0, 2.0) for k in (1.0, 2.0, 3.0)]
    np.testing.assert_allclose(run_method("model_stock", base, same), (base + 2 * t(1.0, 2.0, 2.0)).numpy(), rtol=1e-6)
    # opposed task vectors: cosine clamped to 0, the base
    np.testing.assert_allclose(run_method("model_stock", base, [base + tau1, base - tau1]), base.numpy())


def test_method_refuses_unknown_parameters_a_missing_base_and_wrong_counts():
    with pytest.raises(MergeError, match="no parameter"):
        METHODS["ties"].merge(torch.zeros(2), [torch.ones(2)], [1.0], name="w", densty=0.5)
    with pytest.raises(MergeError, match="needs a base"):
        METHODS["task_arithmetic"].merge(None, [torch.ones(2)], [1.0], name="w")
    with pytest.raises(MergeError, match="slerp merges 2 experts, not 3"):
        METHODS["slerp"].merge(None, [torch.ones(2)] * 3, [1.0] * 3, name="w")
    with pytest.raises(MergeError, match="model_stock merges at least 2 experts, not 1"):
        METHODS["model_stock"].merge(torch.zeros(2), [torch.ones(2)], [1.0], name="w")


# --- safetensors reader and writer ---------------------------------------------------------------------


def sample_tensors(name_length: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(name_length)
    prefix = "x" * name_length
    return {
        f"{prefix}.b": torch.randn(2, 3, generator=g),
        f"{prefix}.a": torch.randn(3, generator=g).half(),
        "c": torch.randn(1, generator=g).bfloat16(),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(5),
        "mask": torch.tensor([True, False]),
        "f8a": torch.tensor([0.5, -1.0]).to(torch.float8_e4m3fn),
        "f8b": torch.tensor([2.0]).to(torch.float8_e5m2),
        "u16": torch.tensor([7, 9], dtype=torch.uint16),
        "ünïcode": torch.ones(2),
    }


@pytest.mark.parametrize("name_length", range(1, 9))  # header lengths with every padding from 0 to 7
def test_writer_bytes_equal_safetensors_save(tmp_path, name_length):
    tensors = sample_tensors(name_length)
    path = tmp_path / "out.safetensors"
    specs = {name: (CODES[tensor.dtype], tuple(tensor.shape)) for name, tensor in tensors.items()}
    with SafetensorsWriter(path, specs) as writer:
        for name in writer.order:
            writer.write(name, tensors[name])
        digest = writer.close()
    expected = save(tensors)
    assert path.read_bytes() == expected
    assert digest == hashlib.sha256(expected).hexdigest()
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor)


def test_writer_refuses_wrong_order_shape_and_missing_tensors(tmp_path):
    specs = {"a": ("F32", (2,)), "b": ("F32", (3,))}
    with SafetensorsWriter(tmp_path / "x", specs) as writer:
        with pytest.raises(ValueError, match="in order"):
            writer.write("b", torch.zeros(3))
        with pytest.raises(ValueError, match="declared F32"):
            writer.write("a", torch.zeros(3))
        writer.write("a", torch.zeros(2))
        with pytest.raises(ValueError, match="not written"):
            writer.close()


def test_reader_reads_one_tensor_at_a_time(tmp_path):
    tensors = sample_tensors(3)
    path = tmp_path / "m.safetensors"
    path.write_bytes(save(tensors, metadata={"note": "hi"}))
    with SafetensorsReader(path) as reader:
        assert reader.metadata == {"note": "hi"}
        assert set(reader.tensors) == set(tensors)
        assert reader.header == path.read_bytes()[:len(reader.header)]
        for name, tensor in tensors.items():
            assert torch.equal(reader.get(name), tensor)
        buffer = torch.empty(64, dtype=torch.uint8)
        assert torch.equal(reader.get("xxx.b", buffer), tensors["xxx.b"])
        assert reader.get("xxx.b", buffer).untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        with pytest.raises(TensorFileError, match="no tensor 'nope'"):
            reader.get("nope")


def header_file(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize("case, message", [
    ("truncated", "truncated"),
    ("tiny", "too short"),
    ("huge_header_length", "header length"),
    ("not_json", "not valid JSON"),
    ("unknown_dtype", "unknown dtype 'F33'"),
    ("size_mismatch", "needs 24 bytes"),
    ("overlap", "overlaps 'a'"),
    ("gap", "gap"),
    ("trailing", "after the last tensor"),
])
def test_reader_rejects_corrupt_files_naming_them(tmp_path, case, message):
    path = tmp_path / f"{case}.safetensors"
    good = save({"a": torch.ones(2, 3), "b": torch.ones(4)})
    f32 = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    if case == "truncated":
        path.write_bytes(good[:-10])
    elif case == "tiny":
        path.write_bytes(b"\x01\x02")
    elif case == "huge_header_length":
        path.write_bytes(struct.pack("<Q", 1 << 40) + good[8:])
    elif case == "not_json":
        path.write_bytes(struct.pack("<Q", 6) + b"{nope]" + bytes(24))
    elif case == "unknown_dtype":
        header_file(path, {"a": {**f32, "dtype": "F33"}}, bytes(24))
    elif case == "size_mismatch":
        header_file(path, {"a": {**f32, "data_offsets": [0, 20]}}, bytes(20))
    elif case == "overlap":
        header_file(path, {"a": f32, "b": {"dtype": "F32", "shape": [2], "data_offsets": [20, 28]}}, bytes(28))
    elif case == "gap":
        header_file(path, {"a": {**f32, "data_offsets": [4, 28]}}, bytes(28))
    elif case == "trailing":
        header_file(path, {"a": f32}, bytes(30))
    with pytest.raises(TensorFileError, match=message) as error:
        SafetensorsReader(path)
    assert str(path) in str(error.value)


# --- recipes -------------------------------------------------------------------------------------------


def test_every_shipped_recipe_parses_and_names_a_known_method():
    recipes = sorted((REPO / "merges").glob("*.yaml"))
    assert {p.stem for p in recipes} == set(METHODS)
    for path in recipes:
        recipe = load_merge_recipe(path)
        assert recipe.method.name == path.stem
        assert {ref.label for ref in recipe.experts} <= {"code", "legal", "manuals"}
        assert all(ref.folder == Path("runs/btm/experts") / ref.label for ref in recipe.experts)
        assert (recipe.base is not None) == recipe.method.needs_base
        assert recipe.base is None or recipe.base.label == "seed"
        assert set(recipe.parameters) == set(recipe.method.params)


def test_a_shipped_recipe_is_found_by_its_name_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Path(load_merge_recipe("ties").source).samefile(REPO / "merges" / "ties.yaml")
    for name in ("tie", "ties.v2"):
        with pytest.raises(MergeError, match=rf"no merge recipe '{name}': give one of dare, linear, .*ties or a recipe"):
            load_merge_recipe(name)
    with pytest.raises(MergeError, match=r"merges/ties.yaml does not exist \(relative to .*\); the shipped one is named "
                                         r"ties \("):
        load_merge_recipe("merges/ties.yaml")


def test_recipe_resolves_names_paths_weights_and_registry_override(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("method: ties\nregistry: runs/x\nbase: seed\nexperts:\n  - {name: code, weight: 1e-3}\n"
                    "  - {name: ./elsewhere/legal, weight: 2}\nparameters: {density: 5e-1}\ndtype: bfloat16\n")
    recipe = load_merge_recipe(path)  # YAML 1.1 reads 1e-3 and 5e-1 as strings: both are numbers here
    assert [(r.folder, r.weight) for r in recipe.experts] == [(Path("runs/x/code"), 1e-3),
                                                              (Path("elsewhere/legal"), 2.0)]
    assert recipe.base.folder == Path("runs/x/seed")
    assert recipe.parameters == {"density": 0.5, "lambda": 1.0}
    assert recipe.dtype == "bfloat16"
    assert load_merge_recipe(path, registry=tmp_path / "reg").experts[0].folder == tmp_path / "reg" / "code"


@pytest.mark.parametrize("recipe, message", [
    ({"method": "linear", "experts": ["a"], "wieghts": 1}, r"unknown key\(s\) \['wieghts'\]; allowed: \['method'"),
    ({"method": "soup", "experts": ["a"]}, r"method: 'soup' is not one of \['dare', 'linear'"),
    ({"experts": ["a"]}, "method: None is not one of"),
    ({"method": "ties", "base": "s", "experts": ["a"], "parameters": {"density": "lots"}},
     r"parameters.density: expected float in \(0, 1\], got 'lots'; ties's parameters: density \(default 0.2"),
    ({"method": "ties", "base": "s", "experts": ["a"], "parameters": {"density": 1.5}}, r"density: expected float in \(0, 1\]"),
    ({"method": "ties", "base": "s", "experts": ["a"], "parameters": {"lambda": float("nan")}}, "lambda: expected float"),
    ({"method": "ties", "base": "s", "experts": ["a"], "parameters": {"k": 3}}, r"no parameter\(s\) \['k'\]"),
    ({"method": "dare", "base": "s", "experts": ["a"], "parameters": {"ties": 1}}, "ties: expected bool, got 1"),
    ({"method": "dare", "base": "s", "experts": ["a"], "parameters": {"seed": 1.5}}, "seed: expected int"),
    ({"method": "model_stock", "base": "s", "experts": ["a", "b"], "parameters": {"t": 1}},
     "model_stock takes no parameters"),
    ({"method": "ties", "experts": ["a"]}, "base: ties needs a base model"),
    ({"method": "linear", "base": "s", "experts": ["a"]}, "linear does not use a base"),
    ({"method": "slerp", "experts": ["a", "b", "c"]}, "slerp merges exactly 2 experts, the recipe lists 3"),
    ({"method": "model_stock", "base": "s", "experts": ["a"]}, "at least 2 experts"),
    ({"method": "linear", "experts": [{"name": "a", "weight": 0}]}, r"experts\[0\].weight: expected a finite number > 0"),
    ({"method": "linear", "experts": [{"name": "a", "weight": -1.0}]}, "weight: expected a finite number > 0"),
    ({"method": "linear", "experts": [{"name": "a", "weight": float("inf")}]}, "weight: expected a finite number"),
    ({"method": "linear", "experts": [{"name": "a", "weight": True}]}, "weight: expected a finite number"),
    ({"method": "linear", "experts": [{"name": "a", "weight": "-1e-3"}]}, "weight: expected a finite number > 0"),
    ({"method": "linear", "experts": [{"name": "a", "weight": "lots"}]}, "weight: expected a finite number > 0"),
    ({"method": "linear", "experts": ["a", "b", {"name": "a", "weight": 2.0}]},
     r"experts\[2\]: 'a' is experts\[0\] \('a'\) again; list each expert once \(a weight counts it more\)"),
    ({"method": "slerp", "experts": ["a", "./reg/a"]}, r"experts\[1\]: './reg/a' is experts\[0\] \('a'\) again"),
    ({"method": "ties", "base": "./reg/b", "experts": ["a", "b"]}, r"experts\[1\]: 'b' is the base; its task vector"),
    ({"method": "slerp", "experts": [{"name": "a", "weight": 2.0}, "b"]}, r"slerp does not weight .*parameters.t"),
    ({"method": "linear", "experts": [{"nam": "a"}]}, r"experts\[0\]: expected \{name, weight\}"),
    ({"method": "linear", "experts": []}, "experts: expected a list"),
    ({"method": "linear", "experts": ["bad name"]}, r"experts\[0\]: expert name 'bad name'"),
    ({"method": "linear", "experts": ["a"], "dtype": "float8"}, r"dtype: 'float8' is not one of \['float32'"),
])
def test_malformed_recipes_name_the_file_and_key(tmp_path, recipe, message):
    recipe.setdefault("registry", "reg")
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(recipe).replace("NaN", ".nan").replace("Infinity", ".inf"))
    with pytest.raises(MergeError, match=message) as error:
        load_merge_recipe(path)
    assert str(error.value).startswith(str(path))


def test_a_name_without_a_registry_is_an_error():
    with pytest.raises(MergeError, match="'code' is an expert name, which needs `registry`"):
        parse_merge_recipe({"method": "linear", "experts": ["code"]}, "r.yaml")


# --- the driver ----------------------------------------------------------------------------------------


def gpt_state(seed: int, config: GPTConfig = TINY) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return GPT(config).state_dict()


def save_expert(folder: Path, state: dict[str, torch.Tensor], name: str, config: GPTConfig = TINY, **meta) -> Expert:
    data = model_bytes(state)
    return write_expert(folder, lambda path: path.write_bytes(data),
                        Expert(name=name, sha256="", size=0, model=asdict(config), **meta))


@pytest.fixture
def registry(tmp_path) -> Path:
    root = tmp_path / "experts"
    for i, name in enumerate(("seed", "code", "legal", "manuals")):
        save_expert(root / name, gpt_state(i), name, domain=name, steps=100 * i, tokens=1000 * i)
    return root


@pytest.fixture
def out_parent(tmp_path) -> Path:
    parent = tmp_path / "out"
    parent.mkdir()
    return parent


@pytest.fixture(scope="module")
def text_domain(tmp_path_factory) -> str:
    """A domain spec (NAME=PATH) of 200 small text files, for the posterior's dev split."""
    folder = tmp_path_factory.mktemp("domain")
    for i in range(200):
        (folder / f"{i}.txt").write_text(f"document {i}: " + "some words of text, " * 60)
    return f"text={folder}"


def recipe_for(registry: Path, method: str, experts=("code", "legal", "manuals"), domain: str | None = None, **extra):
    data = {"method": method, "registry": str(registry), "experts": list(experts), **extra}
    if METHODS[method].needs_base:
        data.setdefault("base", "seed")
    if method == "posterior":
        data["parameters"] = {"domain": domain}
    return parse_merge_recipe(data, f"{method}.yaml")


def assert_fails_leaving_nothing(recipe, out: Path, message: str) -> str:
    with pytest.raises(MergeError, match=message) as error:
        merge(recipe, out, progress=False)
    assert list(out.parent.iterdir()) == [], "a failed merge left files behind"
    return str(error.value)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_merges_gpt_experts_into_a_loadable_expert(registry, out_parent, method, text_domain):
    experts = ("code", "legal") if method == "slerp" else ("code", "legal", "manuals")
    recipe = recipe_for(registry, method, experts, domain=text_domain)
    expert = merge(recipe, out_parent / f"merged-{method}", progress=False)
    loaded = read_expert(out_parent / f"merged-{method}")
    model = loaded.load_model(verify=True)
    logits, _ = model(torch.zeros(1, 8, dtype=torch.long))
    assert torch.isfinite(logits).all()
    assert loaded == expert and loaded.name == f"merged-{method}" and loaded.domain is None
    assert loaded.model == asdict(TINY)
    assert (loaded.steps, loaded.tokens) == ((200, 2000) if method == "slerp" else (300, 3000))  # legal's, manuals
    seed = read_expert(registry / "seed")
    assert loaded.parent == (seed.sha256 if METHODS[method].needs_base else None)
    assert loaded.merge["method"] == method
    assert loaded.merge["parameters"] == recipe.parameters
    assert loaded.merge["base"] == ({"name": "seed", "sha256": seed.sha256} if METHODS[method].needs_base else None)
    weights = [e["weight"] for e in loaded.merge["experts"]]
    assert [e["name"] for e in loaded.merge["experts"]] == list(experts)
    assert [e["sha256"] for e in loaded.merge["experts"]] == [read_expert(registry / n).sha256 for n in experts]
    assert weights == [1.0] * len(experts) or method == "posterior"
    assert [p.name for p in out_parent.iterdir()] == [f"merged-{method}"]  # no temporary folder left


def test_linear_merge_of_gpt_experts_is_their_weighted_average_in_the_chosen_dtype(registry, out_parent):
    recipe = parse_merge_recipe({"method": "linear", "registry": str(registry), "dtype": "float16",
                                 "experts": ["code", {"name": "legal", "weight": 3.0}]}, "linear.yaml")
    merge(recipe, out_parent / "avg", progress=True)
    merged = load_file(out_parent / "avg" / "model.safetensors")
    code, legal = (load_file(registry / n / "model.safetensors") for n in ("code", "legal"))
    assert merged.keys() == code.keys()
    for name in code:
        expected = (code[name].numpy().astype(np.float64) + 3 * legal[name].numpy()) / 4
        assert merged[name].dtype == torch.float16
        np.testing.assert_allclose(merged[name].float().numpy(), expected, rtol=2e-3, atol=1e-6)
    assert read_expert(out_parent / "avg").merge["dtype"] == "float16"


def test_merging_into_an_existing_expert_folder_replaces_it(registry, out_parent):
    first = merge(recipe_for(registry, "linear"), out_parent / "m", progress=False)
    second = merge(recipe_for(registry, "linear", ("code", "legal")), out_parent / "m", progress=False)
    assert first.sha256 != second.sha256 == read_expert(out_parent / "m").sha256
    assert [p.name for p in out_parent.iterdir()] == ["m"]


def test_missing_tensor_names_tensor_and_expert_with_the_tied_weights_hint(registry, out_parent):
    state = gpt_state(5)
    del state["head.out.weight"]
    save_expert(registry / "tied", state, "tied")
    message = assert_fails_leaving_nothing(recipe_for(registry, "linear", ("code", "tied")), out_parent / "m",
                                           "'head.out.weight' is missing from expert 'tied'")
    assert "tie the output head to the input embedding" in message and "saved untied" in message
    state = gpt_state(6)
    del state["blocks.1.ln1.bias"]
    save_expert(registry / "holey", state, "holey")
    message = assert_fails_leaving_nothing(recipe_for(registry, "ties", ("code", "holey")), out_parent / "m",
                                           "'blocks.1.ln1.bias' is missing from expert 'holey'")
    assert "untied" not in message


def test_shape_mismatch_names_the_tensor_and_each_shape(registry, out_parent):
    state = gpt_state(5)
    state["blocks.0.mlp.fc.bias"] = torch.zeros(100)
    save_expert(registry / "odd", state, "odd")
    assert_fails_leaving_nothing(recipe_for(registry, "task_arithmetic", ("code", "odd")), out_parent / "m",
                                 r"'blocks.0.mlp.fc.bias' has different shapes: base 'seed' \[128\], "
                                 r"expert 'code' \[128\], expert 'odd' \[100\]")


def test_vocab_and_context_mismatches_say_which_differs(registry, out_parent):
    config = GPTConfig(vocab_size=300, n_layer=2, n_head=2, d_model=32, context=32)
    save_expert(registry / "bigvocab", gpt_state(5, config), "bigvocab", config)
    message = assert_fails_leaving_nothing(recipe_for(registry, "linear", ("code", "bigvocab")), out_parent / "m",
                                           "'embed.tok.weight' has different shapes")
    assert "256 vs 300: the vocabularies differ" in message and "'head.out.weight'" in message
    short = GPTConfig(n_layer=2, n_head=2, d_model=32, context=16)
    save_expert(registry / "short", gpt_state(5, short), "short", short)
    message = assert_fails_leaving_nothing(recipe_for(registry, "linear", ("code", "short")), out_parent / "m",
                                           r"'embed.pos.weight' has different shapes: expert 'code' \[32, 32\], "
                                           r"expert 'short' \[16, 32\] \(only the first dimension, 16 vs 32: the "
                                           "contexts differ")
    assert "vocabularies" not in message


def test_model_config_mismatch_is_refused(registry, out_parent):
    save_expert(registry / "drop", gpt_state(5), "drop", GPTConfig(n_layer=2, n_head=2, d_model=32, context=32,
                                                                    dropout=0.1))
    assert_fails_leaving_nothing(recipe_for(registry, "linear", ("code", "drop")), out_parent / "m",
                                 r"model configs \(expert.json `model`\) differ: dropout: expert 'code' 0.0, "
                                 "expert 'drop' 0.1")


def flip_a_data_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor: the header stays valid
    path.write_bytes(bytes(data))


def test_corrupt_input_fails_its_checksum_and_nothing_is_written(registry, out_parent):
    flip_a_data_byte(registry / "legal" / "model.safetensors")
    assert_fails_leaving_nothing(recipe_for(registry, "ties", verify=True), out_parent / "m",
                                 "expert 'legal': .* does not match the sha256 recorded")
    merge(recipe_for(registry, "ties"), out_parent / "m", progress=False)  # without verify, files are trusted


def test_a_damaged_header_is_named_as_a_checksum_failure_when_verifying(registry, out_parent):
    """A byte flipped in a tensor's name reads as a model with another tensor: `--verify` said that tensor was
    missing, not which file was damaged."""
    path = registry / "legal" / "model.safetensors"
    data = bytearray(path.read_bytes())
    header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
    name = next(key for key in header if key != "__metadata__" and key[1].isalpha())
    data[data.index(f'"{name}"'.encode()) + 2] ^= 0x20  # its second letter's case: the header is still JSON
    path.write_bytes(bytes(data))
    assert_fails_leaving_nothing(recipe_for(registry, "ties", verify=True), out_parent / "m",
                                 "expert 'legal': .* does not match the sha256 recorded")
    assert_fails_leaving_nothing(recipe_for(registry, "ties"), out_parent / "m", "is missing from")


def test_input_in_another_tensor_order_is_verified_by_rereading(registry, out_parent):
    state = gpt_state(5)
    state["embed.pos.weight"] = state["embed.pos.weight"].half()  # stored after every F32 tensor
    save_expert(registry / "mixed", state, "mixed")
    expert = merge(recipe_for(registry, "linear", ("code", "mixed")), out_parent / "ok", progress=False)
    merged = load_file(expert.model_file)
    assert merged["embed.pos.weight"].dtype == torch.float32  # inputs disagree: float32
    assert merged["embed.tok.weight"].dtype == torch.float32
    flip_a_data_byte(registry / "mixed" / "model.safetensors")
    (out_parent / "ok").rename(out_parent.parent / "ok")
    assert_fails_leaving_nothing(recipe_for(registry, "linear", ("code", "mixed"), verify=True), out_parent / "m",
                                 "expert 'mixed': .* does not match the sha256 recorded")


def test_posterior_weights_are_the_domains_prior_and_are_cached(registry, out_parent, text_domain):
    from decentral.data.domains import load_domain
    from decentral.experts.ensemble import estimate_prior, score_batches

    names = ("code", "legal", "manuals")
    expert = merge(recipe_for(registry, "posterior", names, domain=text_domain), out_parent / "p", progress=False)
    dev = load_domain(text_domain).eval_batches("dev", batch_size=16, context=TINY.context, num_batches=8)
    scores = torch.stack([score_batches(read_expert(registry / n).load_model(), dev) for n in names])
    prior = estimate_prior(scores)
    assert [e["weight"] for e in expert.merge["experts"]] == pytest.approx(prior.tolist(), rel=1e-5)
    merged = load_file(expert.model_file)
    states = [load_file(registry / n / "model.safetensors") for n in names]
    for tensor in merged:
        expected = sum(float(w) * s[tensor] for w, s in zip(prior, states)) / float(prior.sum())
        torch.testing.assert_close(merged[tensor], expected, rtol=1e-5, atol=1e-6)
    assert len(json.loads((registry / "priors.json").read_text())) == 1
    for domain in ("", "nodomain", f"text={out_parent / 'nothing'}"):
        said = " is required: " if not domain else ": "
        with pytest.raises(MergeError, match="^posterior.yaml: parameters.domain" + said):
            merge(recipe_for(registry, "posterior", names, domain=domain), out_parent / "q", progress=False)
    with pytest.raises(MergeError, match="posterior does not weight its experts"):
        parse_merge_recipe({"method": "posterior", "registry": str(registry),
                            "experts": [{"name": "code", "weight": 2.0}]}, "posterior.yaml")


def test_posterior_of_experts_that_do_not_fit_together_is_refused_before_scoring(registry, out_parent, text_domain):
    short = GPTConfig(n_layer=2, n_head=2, d_model=32, context=16)
    save_expert(registry / "short", gpt_state(5, short), "short", short)
    assert_fails_leaving_nothing(recipe_for(registry, "posterior", ("code", "short"), domain=text_domain),
                                 out_parent / "p", "'embed.pos.weight' has different shapes")
    assert not (registry / "priors.json").exists()  # nothing was scored


def test_non_finite_inputs_are_reported(registry, out_parent):
    state = gpt_state(5)
    state["blocks.0.attn.qkv.bias"][3] = float("nan")
    save_expert(registry / "nan", state, "nan")
    assert_fails_leaving_nothing(recipe_for(registry, "linear", ("code", "nan")), out_parent / "m",
                                 "tensor 'blocks.0.attn.qkv.bias': the merge produced NaN .* already in expert 'nan'")


def test_values_beyond_the_output_dtype_are_refused(registry, out_parent):
    save_expert(registry / "far", {k: v + 10 for k, v in gpt_state(0).items()}, "far")  # every task vector 10
    recipe = recipe_for(registry, "task_arithmetic", ("far",), dtype="float16", parameters={"lambda": 1e4})
    assert_fails_leaving_nothing(recipe, out_parent / "m", r"tensor '.*': the merge produced NaN or infinite values "
                                 r"\(beyond the range of the output dtype, float16\)")
    merge(recipe_for(registry, "task_arithmetic", ("far",), parameters={"lambda": 1e4}), out_parent / "m",
          progress=False)  # float32 holds 1e5


def test_missing_input_and_bad_output_folders_are_refused(registry, out_parent):
    assert_fails_leaving_nothing(recipe_for(registry, "linear", ("code", "nobody")), out_parent / "m",
                                 r"linear.yaml: experts\[1\] \('nobody'\): no expert 'nobody' in .* "
                                 r"\(there: .*code, legal")
    assert_fails_leaving_nothing(recipe_for(registry.with_name("typo"), "linear"), out_parent / "m",
                                 r"experts\[0\] \('code'\): no expert 'code': there is no registry folder .*typo")
    assert_fails_leaving_nothing(recipe_for(registry, "linear", ("code", str(registry / "nobody"))), out_parent / "m",
                                 r"experts\[1\] \('.*/nobody'\): .*nobody is not an expert folder")
    assert_fails_leaving_nothing(recipe_for(registry, "linear"), out_parent / "not valid!",
                                 "output folder .*'not valid!' must be")
    with pytest.raises(MergeError, match="is the folder of expert 'code'"):
        merge(recipe_for(registry, "linear"), registry / "code", progress=False)
    before = sorted(p.name for p in (registry / "code").iterdir())
    with pytest.raises(MergeError, match=f"inside the expert folder {registry / 'code'}; write the merge beside it"):
        merge(recipe_for(registry, "linear"), registry / "code" / "sub", progress=False)
    assert sorted(p.name for p in (registry / "code").iterdir()) == before
    precious = out_parent / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(MergeError, match="not an expert folder .* refusing to replace it"):
        merge(recipe_for(registry, "linear"), precious, progress=False)
    assert (precious / "notes.txt").read_text() == "keep me"
    (out_parent / "made").mkdir()  # an empty folder, made for the merge, is taken (it was refused)
    assert merge(recipe_for(registry, "linear"), out_parent / "made", progress=False) == read_expert(out_parent / "made")


def test_merge_accepts_a_recipe_file(registry, out_parent, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(f"method: slerp\nregistry: {registry}\nexperts: [code, legal]\nparameters: {{t: 0.0}}\n")
    expert = merge(path, out_parent / "s", progress=False)
    code = load_file(registry / "code" / "model.safetensors")
    merged = load_file(expert.model_file)
    assert all(torch.equal(merged[name], code[name]) for name in code)  # t = 0 is the first expert


# --- memory and the benchmark --------------------------------------------------------------------------

MEMORY_CHILD = """
import json, sys
from safetensors.torch import load
from decentral.merge import merge, parse_merge_recipe
from decentral.merge.bench import peak_rss, reset_peak_rss
recipe, out, files = json.loads(sys.argv[1])
assert reset_peak_rss()
baseline = peak_rss()
merge(parse_merge_recipe(recipe), out, progress=False)
lazy = peak_rss() - baseline
models = [load(open(f, "rb").read()) for f in files]  # what a merge that loads every model would hold
print(json.dumps({"lazy": lazy, "eager": peak_rss() - baseline}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS is reset through /proc")
def test_merging_four_experts_holds_a_fraction_of_one_model(tmp_path):
    config = bench_config(25_000_000)
    experts = write_random_experts(tmp_path / "in", config, ["e0", "e1", "e2", "e3"])
    size = experts[0].size
    assert size > 95_000_000
    recipe = {"method": "linear", "experts": [str(e.folder) for e in experts]}
    job = json.dumps([recipe, str(tmp_path / "merged"), [str(e.model_file) for e in experts]])
    done = subprocess.run([sys.executable, "-c", MEMORY_CHILD, job], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    assert peaks["lazy"] < 0.5 * size, f"merge peaked {peaks['lazy'] / size:.2f} models above its baseline"
    assert peaks["eager"] > 3.5 * size  # the measurement does see whole models
    assert read_expert(tmp_path / "merged").size == size


def test_merge_bench_runs_at_a_small_size(tmp_path):
    results = run_merge_bench(tmp_path / "bench", params=2_000_000, experts=2, repeats=1)
    assert 7_000_000 < results["model_bytes"] < 10_000_000
    assert results["time_read_s"] > 0 and results["time_merge_s"] > 0 and results["time_verify_inputs_s"] > 0
    assert results["time_ratio"] == results["time_merge_s"] / results["time_read_s"]
    assert results["memory_ratio"] == results["rss_merge_above_baseline_bytes"] / results["model_bytes"]
    assert json.loads((tmp_path / "bench" / "results.json").read_text()) == results
    assert (tmp_path / "bench" / "merge_bench.png").stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "bench").iterdir()) == [".lock", "merge_bench.png", "results.json"]
    # (its random models removed; .lock: the folder's run lock, metrics.results_folder)


def test_merge_bench_refuses_settings_it_cannot_run(tmp_path, capsys):
    from decentral.cli import main
    from decentral.merge.bench import smallest_params

    for args, says in ((["--repeats", "0"], "--repeats: must be at least 1"),
                       (["--params", "0"], "--params: must be at least 1"),
                       (["--experts", "1"], "--experts: must be at least 2")):  # (one model "merged" ran)
        with pytest.raises(SystemExit) as exited:
            main(["bench", "merge", "--out", str(tmp_path / "b"), *args])
        assert exited.value.code == 2 and says in capsys.readouterr().err
    smallest = f"smallest model the bench builds ({smallest_params():,}"
    for args, says in ((["--params", str(smallest_params() - 1)], smallest),
                       (["--method", "slerp", "--experts", "3"], "slerp merges exactly 2 experts, not 3")):
        assert main(["bench", "merge", "--out", str(tmp_path / "b"), *args]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "b").exists()


def test_a_verified_posterior_merge_of_a_corrupt_expert_scores_and_caches_nothing(registry, out_parent, text_domain):
    """The prior was scored from the unverified weights and cached under the recorded sha256, and the merge only
    then found the file corrupt: a good copy fetched again (the same sha256) reused the bad prior."""
    flip_a_data_byte(registry / "legal" / "model.safetensors")
    assert_fails_leaving_nothing(recipe_for(registry, "posterior", ("code", "legal"), domain=text_domain, verify=True),
                                 out_parent / "p", "expert 'legal': .* does not match the sha256 recorded")
    assert not (registry / "priors.json").exists()
