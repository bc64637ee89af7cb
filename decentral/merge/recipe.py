"""Merge recipes: YAML files naming a method, its inputs and its knobs (merges/*.yaml).

    method: ties
    registry: runs/btm/experts     # folder of expert folders; a bare name resolves to registry/NAME
    base: seed                      # the base expert, for methods that need one
    experts:                        # names or paths, each with an optional weight (default 1.0)
      - code
      - {name: legal, weight: 2.0}
    parameters: {density: 0.2, lambda: 1.0}   # the method's knobs; those left out keep their defaults
    dtype: float32                  # of the output: float32, float16, bfloat16; default: the inputs'
    verify: false                   # true: check every input's sha256 against its expert.json first

An entry containing "/" is a path to an expert folder, any other the name of one in `registry`.
Relative paths, the registry's included, are relative to the current directory, like every path on
decentral's command line. Every mistake is a MergeError naming the file and the key and saying
what is allowed.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from decentral.config import SHIPPED, read_yaml
from decentral.experts.registry import RegistryError, check_name
from decentral.merge.base import MergeError, MergeMethod

KEYS = ("method", "registry", "base", "experts", "parameters", "dtype", "verify")
OUTPUT_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # recipe name -> safetensors code


@dataclass(frozen=True)
class ModelRef:
    """One input: the recipe's `key` for it (e.g. "experts[1]"), its `label` there, its folder, its weight."""

    key: str
    label: str
    folder: Path
    weight: float = 1.0


@dataclass
class MergeRecipe:
    method: MergeMethod
    experts: list[ModelRef]
    base: ModelRef | None = None
    parameters: dict[str, Any] = field(default_factory=dict)  # every knob of the method, defaults filled in
    dtype: str | None = None  # a key of OUTPUT_DTYPES; None keeps the inputs' dtypes
    verify: bool = False  # hash every input and compare with its expert.json before publishing the merge
    source: str = "recipe"  # where the recipe came from, for messages


def load_merge_recipe(path: str | Path, registry: str | Path | None = None) -> MergeRecipe:
    """Read and check a recipe file, or the shipped recipe of that name (`ties`: merges/ties.yaml);
    `registry` (the CLI's --registry) overrides the recipe's."""
    path = Path(path)
    shipped = SHIPPED / "merges" / path.name
    if path.suffix not in (".yaml", ".yml") and not path.exists():
        named = SHIPPED / "merges" / f"{path.name}.yaml"
        if len(path.parts) > 1 or not named.is_file():
            names = ", ".join(sorted(p.stem for p in (SHIPPED / "merges").glob("*.yaml")))
            raise MergeError(f"no merge recipe {str(path)!r}: give one of {names} or a recipe file (.yaml)")
        path = named
    if not path.is_file() and path.parent.name == "merges" and shipped.is_file():
        # merges/ties.yaml typed outside the repository: say where the shipped one is
        raise MergeError(f"merge recipe {path} does not exist (relative to {Path.cwd()}); the shipped one is named "
                         f"{shipped.stem} ({shipped})")
    return parse_merge_recipe(read_yaml(path, "merge recipe", MergeError), str(path), registry=registry)


def parse_merge_recipe(data: Any, where: str = "recipe", registry: str | Path | None = None) -> MergeRecipe:
    from decentral.merge import METHODS

    if not isinstance(data, dict):
        raise MergeError(f"{where}: expected a mapping with keys {list(KEYS)}")
    unknown = sorted(set(data) - set(KEYS), key=str)
    if unknown:
        raise MergeError(f"{where}: unknown key(s) {unknown}; allowed: {list(KEYS)}")
    name = data.get("method")
    if name not in METHODS:
        raise MergeError(f"{where}: method: {name!r} is not one of {sorted(METHODS)}")
    method = METHODS[name]
    if registry is None:
        registry = data.get("registry")
    if registry is not None and not isinstance(registry, (str, Path)):
        raise MergeError(f"{where}: registry: expected a folder path, got {registry!r}")

    entries = data.get("experts")
    if not isinstance(entries, list) or not entries:
        raise MergeError(f"{where}: experts: expected a list of expert names or paths, or {{name, weight}} mappings")
    experts = [_model_ref(entry, f"experts[{i}]", where, registry, method) for i, entry in enumerate(entries)]
    folders = [ref.folder.resolve() for ref in experts]
    for i, folder in enumerate(folders):
        if folder in folders[:i]:
            first = experts[folders.index(folder)]
            raise MergeError(f"{where}: {experts[i].key}: {experts[i].label!r} is {first.key} ({first.label!r}) again; "
                             "list each expert once" + (" (a weight counts it more)" if method.uses_weights else ""))
    if method.num_models is not None and len(experts) != method.num_models:
        raise MergeError(f"{where}: experts: {method.name} merges exactly {method.num_models} experts, "
                         f"the recipe lists {len(experts)}")
    if len(experts) < method.min_models:
        raise MergeError(f"{where}: experts: {method.name} needs at least {method.min_models} experts, "
                         f"the recipe lists {len(experts)}")

    base = data.get("base")
    if method.needs_base and base is None:
        raise MergeError(f"{where}: base: {method.name} needs a base model (the seed the experts branched from); "
                         "add `base: NAME` or a path")
    if not method.needs_base and base is not None:
        raise MergeError(f"{where}: base: {method.name} does not use a base model; remove `base` "
                         f"(methods with a base: {sorted(m for m in METHODS if METHODS[m].needs_base)})")
    if base is not None and not isinstance(base, str):
        raise MergeError(f"{where}: base: expected an expert name or path, got {base!r}")
    base = None if base is None else _model_ref(base, "base", where, registry, method)
    if base is not None and base.folder.resolve() in folders:
        again = experts[folders.index(base.folder.resolve())]
        raise MergeError(f"{where}: {again.key}: {again.label!r} is the base; its task vector would be zero: list the "
                         "experts that branched from it")

    dtype = data.get("dtype")
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise MergeError(f"{where}: dtype: {dtype!r} is not one of {list(OUTPUT_DTYPES)} (or leave it out to keep "
                         "the inputs' dtype)")
    verify = data.get("verify", False)
    if not isinstance(verify, bool):
        raise MergeError(f"{where}: verify: expected true or false, got {verify!r}")
    return MergeRecipe(
        method=method,
        experts=experts,
        base=base,
        parameters=_parameters(method, data.get("parameters"), where),
        dtype=dtype,
        verify=verify,
        source=where,
    )


def _model_ref(entry: Any, key: str, where: str, registry: str | Path | None, method: MergeMethod) -> ModelRef:
    weight = 1.0
    if isinstance(entry, dict):
        unknown = sorted(set(entry) - {"name", "weight"}, key=str)
        if unknown or "name" not in entry:
            raise MergeError(f"{where}: {key}: expected {{name, weight}}, got keys {sorted(entry, key=str)}")
        if "weight" in entry:
            if not method.uses_weights:
                raise MergeError(f"{where}: {key}.weight: {method.name} does not weight its experts; remove the weight"
                                 + (" (parameters.t sets the mix)" if "t" in method.params else ""))
            weight = _typed(entry["weight"], 1.0)
            if weight is None or weight <= 0:
                raise MergeError(f"{where}: {key}.weight: expected a finite number > 0, got {entry['weight']!r}")
        entry = entry["name"]
    if not isinstance(entry, str) or not entry:
        raise MergeError(f"{where}: {key}: expected an expert name or a path, got {entry!r}")
    if "/" in entry or os.sep in entry:
        return ModelRef(key, entry, Path(entry).expanduser(), float(weight))
    try:
        check_name(entry)
    except RegistryError as e:
        raise MergeError(f"{where}: {key}: {e} (or give a path containing '/')") from None
    if registry is None:
        raise MergeError(f"{where}: {key}: {entry!r} is an expert name, which needs `registry` (or --registry); "
                         "a path to an expert folder must contain '/'")
    return ModelRef(key, entry, Path(registry).expanduser() / entry, float(weight))


def _parameters(method: MergeMethod, values: Any, where: str) -> dict[str, Any]:
    """The method's knobs: the recipe's values, checked and typed like the defaults, the rest defaults."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise MergeError(f"{where}: parameters: expected a mapping; {_allowed(method)}")
    unknown = sorted(set(values) - set(method.params), key=str)
    if unknown:
        raise MergeError(f"{where}: parameters: {method.name} has no parameter(s) {unknown}; {_allowed(method)}")
    resolved = dict(method.params)
    for name, value in values.items():
        default = method.params[name]
        typed = _typed(value, default)
        check, allowed = method.checks.get(name, (None, ""))
        if typed is None or (check is not None and not check(typed)):
            expected = f"{type(default).__name__}{' ' + allowed if allowed else ''}"
            raise MergeError(f"{where}: parameters.{name}: expected {expected}, got {value!r}; {_allowed(method)}")
        resolved[name] = typed
    return resolved


def _typed(value: Any, default: Any) -> Any:
    """`value` as the type of `default`: a string, a bool, or a finite number (ints pass as floats, and
    "2e-1" too, which YAML reads as a string), integral for an int. None when it is not one."""
    if isinstance(default, str):
        return value if isinstance(value, str) else None
    if isinstance(default, bool) or isinstance(value, bool):
        return value if isinstance(value, bool) and isinstance(default, bool) else None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if isinstance(default, int):
        return int(value) if float(value).is_integer() else None
    return float(value)


def _allowed(method: MergeMethod) -> str:
    if not method.params:
        return f"{method.name} takes no parameters"
    knobs = ", ".join(f"{name} (default {default!r}{', ' + method.checks[name][1] if name in method.checks else ''})"
                      for name, default in method.params.items())
    return f"{method.name}'s parameters: {knobs}"
