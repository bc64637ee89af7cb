"""Typed training recipes, loaded from YAML (protocols/*.yaml).

A recipe has four sections; every one is optional and falls back to the defaults below:

    protocol: {name: noloco, every: 50, alpha: 0.5, ...}   # the protocol's own keyword arguments
    train:    {steps: 400, batch_size: 16, lr: 3.0e-3, ...}
    model:    {n_layer: 4, d_model: 128, ...}               # decentral.models.GPTConfig fields, or
    model:    {source: hf:CONFIG.json}                      # a Hugging Face model (decentral.models.build_model)
    swarm:    {timeout: 60, codec: float16, ...}
    island:   {size: 2, mode: leader, backend: auto}           # ranks per fast island (decentral.hierarchy)

Unknown keys are errors that name the key and list the allowed ones.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml

from decentral.models import GPT_SOURCE, GPTConfig, ModelError, check_source
from decentral.codec import make_codec
from decentral.sync import PROTOCOLS
from decentral.transport import SoloTransport


class RecipeError(ValueError):
    """A recipe file is malformed; the message says where and how."""


@dataclass
class TrainConfig:
    steps: int = 400  # inner steps per worker
    batch_size: int = 16
    context: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_batches: int = 8
    eval_every: int = 50  # inner steps between validation (and checkpoints), the same for every protocol
    seed: int = 0
    device: str = "auto"  # auto (CUDA when there is a GPU), cpu, cuda, cuda:N; see decentral.device


# Between regular heartbeats. What must travel at once does not wait for one (round announcements,
# state digests), a dead peer is noticed by its refused streams, and a record outlives the sync timeout
# whatever the beat, so a beat only refreshes progress (step, the status card). It costs: a signed
# record stored at every node and the `peers` records looked up, 28 KiB on the wire with 4 peers,
# growing with the swarm (idle: 13.8 KiB/s a peer at a 2 s beat, 2.6 at 10 s; `decentral bench dht`).
HEARTBEAT_S = 10.0
# A member of an average silent this long (no probe answered, no probe of its own, no byte of a part) is
# taken for hung and the average goes on without it (decentral.swarm.averaging); the issue's bound for a
# partner that does not answer is 5 s.
HANG_S = 4.0


@dataclass
class SwarmConfig:
    run: str = "decentral"
    timeout: float = 60.0  # the most one average may take, dead peers included
    codec: str = "float32"  # how averages travel: float32, float16, bfloat16, int8, int4, topk[:DENSITY]
    max_norm_ratio: float = 2.0  # parts are clipped to this multiple of their chunk's lower-median norm
    aggregation: str = "mean"  # or "trimmed": each coordinate without its extremes, in groups of 3+
    hang_s: float = HANG_S
    heartbeat_s: float = HEARTBEAT_S
    key_file: str = ""  # swarm key (decentral swarm keygen): only peers holding it take part; "" = an open swarm


ISLAND_MODES = ("leader", "sharded")
ISLAND_BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class IslandConfig:
    size: int = 1  # ranks per island: they all-reduce gradients every step and are one member of the swarm
    mode: str = "leader"  # leader: rank 0 averages for the island; sharded: each rank averages 1/size of it
    backend: str = "auto"  # inside the island: auto (nccl when training on a GPU, else gloo), gloo, nccl


@dataclass
class Recipe:
    protocol: str = "noloco"
    protocol_args: dict[str, Any] = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)
    model: GPTConfig = field(default_factory=GPTConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    island: IslandConfig = field(default_factory=IslandConfig)
    model_source: str = GPT_SOURCE  # model.source: gpt (shaped by `model`), hf:CONFIG.json or a save_pretrained folder

    def round_length(self) -> int | None:
        """Inner steps per outer round (the protocol's `every`); None for a protocol without rounds (local, ddp)."""
        every = self.protocol_args.get("every", protocol_params(self.protocol).get("every"))
        return every if isinstance(every, int) else None

    def check_context(self, where: str | None = None) -> None:
        """RecipeError when the reference GPT would train on sequences longer than its context (train.context over
        model.context); `where` names the recipe in the message."""
        if self.model_source == GPT_SOURCE and self.train.context > self.model.context:
            raise RecipeError(f"{where + ': ' if where else ''}train.context {self.train.context} is longer than the "
                              f"model's context {self.model.context}, the longest sequence it takes: give --set "
                              f"train.context={self.model.context} or less, or a model of a longer context")

    def to_dict(self) -> dict:
        return {
            "protocol": {"name": self.protocol, **self.protocol_args},
            "train": dataclasses.asdict(self.train),
            "model": (dataclasses.asdict(self.model) if self.model_source == GPT_SOURCE
                      else {"source": self.model_source}),
            "swarm": dataclasses.asdict(self.swarm),
            "island": dataclasses.asdict(self.island),
        }


def _coerce(value: Any, default: Any, where: str) -> Any:
    """`value` as the type of `default` (ints accepted for floats, "3e-3" for numbers); else RecipeError."""
    if isinstance(default, bool) or not isinstance(default, (int, float)):
        if isinstance(value, type(default)):
            return value
    elif not isinstance(value, bool):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
        if number is not None and (isinstance(default, float) or number.is_integer()):
            return type(default)(number)
    raise RecipeError(f"{where}: expected {type(default).__name__}, got {value!r}")


def typed_section(cls, values: Any, where: str, also: Sequence[str] = ()):
    """Recipe section `values` (a mapping, or None for the defaults) as dataclass `cls`; a RecipeError
    names an unknown key or a value of the wrong type. `also`: keys the caller took out of `values` itself
    (listed as allowed)."""
    if values is None:
        return cls()
    if not isinstance(values, dict):
        raise RecipeError(f"{where}: expected a mapping, got {type(values).__name__}")
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(defaults))
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {unknown}; allowed: {sorted([*defaults, *also])}")
    return cls(**{k: _coerce(v, defaults[k], f"{where}.{k}") for k, v in values.items()})


def protocol_params(name: str) -> dict[str, Any]:
    """The keyword arguments protocol `name` accepts, with their defaults."""
    signature = inspect.signature(PROTOCOLS[name].__init__)
    return {p.name: p.default for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY}


def parse_recipe(data: Any, where: str = "recipe") -> Recipe:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping at the top level")
    sections = ["island", "model", "protocol", "swarm", "train"]
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise RecipeError(f"{where}: unknown section(s) {unknown}; allowed: {sections}")
    proto = data.get("protocol") or {}
    if not isinstance(proto, dict):
        raise RecipeError(f"{where}: protocol must be a mapping, e.g. {{name: noloco, every: 50}}, got {proto!r}")
    proto = dict(proto)
    name = proto.pop("name", "noloco")
    if not isinstance(name, str) or name not in PROTOCOLS:
        raise RecipeError(f"{where}: protocol.name {name!r} is not one of {sorted(PROTOCOLS)}")
    allowed = protocol_params(name)
    unknown = sorted(set(proto) - set(allowed))
    if unknown:
        raise RecipeError(f"{where}: protocol {name!r} has no parameter(s) {unknown}; allowed: {sorted(allowed)}")
    proto = {k: v if v is None or allowed[k] is None else _coerce(v, allowed[k], f"{where}: protocol.{k}")
             for k, v in proto.items()}  # None: a setting that may be off (clip), or has no typed default
    check_protocol_settings(name, proto, where)
    model, model_source = _model_section(data.get("model"), f"{where}: model")
    return Recipe(
        protocol=name,
        protocol_args=proto,
        train=_train_section(data.get("train"), f"{where}: train"),
        model=model,
        swarm=_swarm_section(data.get("swarm"), f"{where}: swarm", name),
        island=_island_section(data.get("island"), f"{where}: island"),
        model_source=model_source,
    )


def check_protocol_settings(name: str, settings: dict[str, Any], where: str) -> None:
    """RecipeError for a value protocol `name` refuses (`every: 0`, a `mix` outside [0, 1], ...) now, not in
    every worker once its model is built and its swarm joined: the protocol's own constructor checks them,
    on a small model (4096 parameters, zeros: a check against the model's size passes, and torch's random
    generator is not drawn from, so reading a recipe never changes the weights a seed gives) with no network."""
    probe = torch.nn.Module()
    probe.weight = torch.nn.Parameter(torch.zeros(4096))
    try:
        PROTOCOLS[name](probe, torch.optim.SGD(probe.parameters(), lr=1.0), SoloTransport(), **settings)
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{where}: protocol {name!r}: {e}") from None


def _train_section(values: Any, where: str) -> TrainConfig:
    train = typed_section(TrainConfig, values, where)
    for key in ("steps", "batch_size", "context", "eval_batches", "eval_every"):
        if getattr(train, key) < 1:
            raise RecipeError(f"{where}.{key}: must be >= 1, got {getattr(train, key)}")
    for key in ("warmup_steps", "weight_decay"):
        if getattr(train, key) < 0:
            raise RecipeError(f"{where}.{key}: must be >= 0, got {getattr(train, key)}")
    if not 0 < train.lr < math.inf:
        raise RecipeError(f"{where}.lr: must be a number > 0, got {train.lr}")
    if not 0 <= train.min_lr_ratio <= 1:
        raise RecipeError(f"{where}.min_lr_ratio: must be in [0, 1], got {train.min_lr_ratio}")
    if not train.grad_clip > 0:
        raise RecipeError(f"{where}.grad_clip: must be > 0 (.inf: no clipping), got {train.grad_clip}")
    return train


def _model_section(values: Any, where: str) -> tuple[GPTConfig, str]:
    """(the reference GPT's shape, checked as GPTConfig checks it, and model.source). A source other than gpt
    takes its shape from its own config, so no GPT key may go with it."""
    source = GPT_SOURCE
    if isinstance(values, dict) and "source" in values:
        values = dict(values)
        source = _coerce(values.pop("source"), GPT_SOURCE, f"{where}.source")
    try:
        check_source(source)
    except ModelError as e:
        raise RecipeError(f"{where}.source: {e}") from None
    if source != GPT_SOURCE and values:
        raise RecipeError(f"{where}: {sorted(values)} shape the reference GPT; source {source!r} takes its shape "
                          "from its own config")
    try:
        return typed_section(GPTConfig, values, where, also=["source"]), source
    except RecipeError:
        raise
    except ValueError as e:  # GPTConfig's own checks (d_model a multiple of n_head, ...): each names its field first
        raise RecipeError(f"{where}.{e}") from None


def _island_section(values: Any, where: str) -> IslandConfig:
    island = typed_section(IslandConfig, values, where)
    if island.size < 1:
        raise RecipeError(f"{where}.size: must be >= 1, got {island.size}")
    if island.mode not in ISLAND_MODES:
        raise RecipeError(f"{where}.mode: {island.mode!r} is not one of {list(ISLAND_MODES)}")
    if island.backend not in ISLAND_BACKENDS:
        raise RecipeError(f"{where}.backend: {island.backend!r} is not one of {list(ISLAND_BACKENDS)}")
    return island


def _swarm_section(values: Any, where: str, protocol: str) -> SwarmConfig:
    """The swarm section, its codec checked: a known one, and one the protocol can use."""
    if isinstance(values, dict) and "wire_dtype" in values:
        raise RecipeError(f"{where}: wire_dtype is now codec (e.g. codec: float16)")
    swarm = typed_section(SwarmConfig, values, where)
    for key in ("timeout", "hang_s", "heartbeat_s"):
        if not 0 < getattr(swarm, key) < math.inf:
            raise RecipeError(f"{where}.{key}: must be a number of seconds > 0, got {getattr(swarm, key)}")
    if not swarm.max_norm_ratio > 0:
        raise RecipeError(f"{where}.max_norm_ratio: must be > 0 (.inf: no clipping), got {swarm.max_norm_ratio}")
    try:
        codec = make_codec(swarm.codec)
    except ValueError as e:
        raise RecipeError(f"{where}.codec: {e}") from None
    if codec.error_feedback and not PROTOCOLS[protocol].error_feedback:
        users = sorted(n for n, cls in PROTOCOLS.items() if cls.error_feedback)
        raise RecipeError(f"{where}.codec: {swarm.codec} sends a small part of each tensor and needs a protocol "
                          f"that keeps the rest (error feedback): {users}, not {protocol!r}")
    return swarm


def read_yaml(path: str | Path, what: str = "recipe", error: type[ValueError] = RecipeError) -> Any:
    """The YAML document in file `path`; `error` naming the file when it is missing or not YAML."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{what} {path} is a folder, not a file")
    if not path.is_file():
        raise error(f"{what} {path} does not exist")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{path}: not a text file in UTF-8 ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror})") from None
    except yaml.YAMLError as e:  # a MarkedYAMLError's str() spans lines: say where and what, on one
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise error(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None


def load_recipe(path: str | Path, settings: dict[str, Any] | None = None) -> Recipe:
    """Read and validate a recipe file, with `settings` ({KEY: value}, `with_settings`) applied; raises
    RecipeError with the file name (and the settings) on any problem. A file names its protocol: an empty one
    (or one whose protocol section has no name) is refused, not read as the defaults' NoLoCo."""
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: empty: a recipe names its protocol, e.g. protocol: {{name: diloco, every: 50}}"
                          if data is None else f"{path}: expected a mapping at the top level")
    protocol = data.get("protocol") or {}
    if isinstance(protocol, dict) and "name" not in protocol:  # (a protocol that is no mapping: parse_recipe says)
        raise RecipeError(f"{path}: no protocol.name: a recipe names its protocol, e.g. protocol: {{name: diloco, "
                          "every: 50}")
    if not settings:
        return parse_recipe(data, str(path))
    shown = ", ".join(f"{k}={v}" for k, v in settings.items())
    return parse_recipe(with_settings(data, settings), f"{path} with --set {shown}")


def setting_value(text: str) -> Any:
    """A setting's value as given on the command line: a YAML scalar (0.7, true, int8), with the numbers
    YAML 1.1 leaves as strings (1e-3) read as numbers."""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def split_setting(item: str, expected: str = "KEY=VALUE, e.g. swarm.codec=int8 or outer_lr=0.7") -> tuple[str, str]:
    """(KEY, VALUE) of a `--set KEY=VALUE` argument, stripped; RecipeError saying what was `expected`."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise RecipeError(f"--set {item!r}: expected {expected}")
    return key.strip(), value.strip()


def parse_settings(items: Sequence[str]) -> dict[str, Any]:
    """{KEY: value} from `--set KEY=VALUE` arguments; RecipeError on a malformed one."""
    return {key: setting_value(value) for key, value in map(split_setting, items)}


def with_settings(data: dict, settings: dict[str, Any]) -> dict:
    """A copy of recipe mapping `data` with `settings` applied: KEY is SECTION.NAME (swarm.codec, train.lr)
    or a protocol setting's NAME (outer_lr). A `model.source` other than gpt drops the recipe's shape of
    the reference GPT (the model's own config shapes it), keeping only `model.*` keys set beside it."""
    recipe = copy.deepcopy(data)
    for key, value in settings.items():
        section, _, name = key.rpartition(".")
        section = section or "protocol"
        if not isinstance(recipe.get(section) or {}, dict):
            raise RecipeError(f"--set {key}: the recipe's {section} section is not a mapping")
        recipe[section] = {**(recipe.get(section) or {}), name: value}
        if key == "model.source" and value != GPT_SOURCE:
            recipe["model"] = {k: v for k, v in recipe["model"].items() if k == "source" or f"model.{k}" in settings}
    return recipe


def recipe_differences(theirs: dict, ours: dict) -> str:
    """The settings in which recipe mapping `theirs` (a checkpoint's, Recipe.to_dict) differs from `ours`, as
    "KEY THEIRS there, OURS here; ..." (the first 4), besides train.steps, which --steps sets; "" when none."""
    def leaves(tree: dict, prefix: str = "") -> dict:  # {"train.lr": 0.001, ...}
        found = {}
        for key, value in tree.items():
            found.update(leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
        return found

    a, b = leaves(theirs), leaves(ours)
    differ = sorted(k for k in {*a, *b} if a.get(k) != b.get(k) and k != "train.steps")
    return ("; ".join(f"{k} {a.get(k)!r} there, {b.get(k)!r} here" for k in differ[:4])
            + ("; ..." if len(differ) > 4 else ""))


SHIPPED = Path(__file__).resolve().parent  # the package: protocols/ and merges/ hold the shipped recipes


def default_recipe_path(protocol: str) -> Path:
    """protocols/<name>.yaml shipped with the package (the repository's protocols/ links to it)."""
    return SHIPPED / "protocols" / f"{protocol}.yaml"


def recipe_path(name_or_file: str) -> Path:
    """A `--protocol` argument as a file: a .yaml/.yml path as given, else the shipped recipe of that name
    (RecipeError if there is none)."""
    if name_or_file.endswith((".yaml", ".yml")):
        path = Path(name_or_file)
        if not path.is_file() and path.parent.name == "protocols" and default_recipe_path(path.stem).is_file():
            # protocols/noloco.yaml typed outside the repository: the shipped recipe is there by name
            raise RecipeError(f"recipe {path} does not exist (relative to {Path.cwd()}); "
                              f"the shipped one is --protocol {path.stem}")
        return path
    path = default_recipe_path(name_or_file)
    if not path.is_file():
        shipped = sorted(p.stem for p in (SHIPPED / "protocols").glob("*.yaml")  # a variant is named PROTOCOL-WHAT
                         if p.stem.partition("-")[0] in PROTOCOLS)
        said = (f"{name_or_file} is not a recipe file (.yaml or .yml)" if Path(name_or_file).exists() or "/" in
                name_or_file else f"no protocol {name_or_file!r}")
        raise RecipeError(f"{said}: give one of {', '.join(shipped)} or a recipe file (.yaml)")
    return path
