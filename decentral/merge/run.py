"""`merge(recipe, out_dir)`: run a merge recipe tensor by tensor into a new expert folder.

1. Check before reading any tensor, from the expert.json files and the safetensors headers only:
   every input has the same tensor names (a missing output head or embedding gets a hint about tied
   weights), the same shape per tensor (a different first dimension of an embedding or head: the
   vocabularies differ; of a position embedding: the contexts), floating-point dtypes only, and one
   model config. Only then are weights a method computes found (posterior's prior, which runs the
   inputs on a domain's dev split).
2. Merge: for each tensor, in the output file's order, read the base's and the experts' versions,
   convert them to float32, merge, cast the result to the output dtype, check it is finite and
   append it to the output file, hashing it on the way. Memory holds about k+2 tensors (TIES a few
   more), never k models. With `verify` (the recipe's, or `decentral merge --verify`) a helper
   thread hashes each input's model.safetensors from the very bytes merged and compares it with the
   sha256 in its expert.json; a mismatch fails the merge. It is off by default, as it is when a
   model is loaded: on this project's machines hashing reads at about 1.2 GB/s, several times
   slower than the rest of a merge, and experts are hash-checked when they are fetched.
3. The folder is written through decentral.experts.registry.write_expert: in a temporary folder
   beside `out_dir`, renamed into place only when complete and every input verified, so a failure
   anywhere leaves nothing behind.

Hugging Face experts (decentral.experts.registry: save_pretrained's layout) merge the same way, their
weights read from model.safetensors or through the shards' index. Their config.json files must agree
but for decentral.models.hf.SAVED_AS (`transformers_version`, `dtype`: how a model was saved); the
output holds the first input's config.json, its `dtype` the output's, and its other files
(generation_config.json), and one model.safetensors, so `from_pretrained` opens it. Hugging Face and
reference-GPT inputs together are an error.

The output dtype of a tensor is the recipe's `dtype`, else the dtype the inputs store it in (float32
where they disagree). The expert's name is `out_dir`'s folder name, which must be a valid expert
name: a MergeError says what is allowed rather than renaming it. `out_dir` may replace an older
expert folder, never a folder that is not an expert's, nor one of the merge's inputs, nor a folder inside an expert's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from decentral.checkpoint import file_sha256
from decentral.experts.registry import (
    CONFIG_FILE, INDEX_FILE, META_FILE, MODEL_FILE, Expert, Registry, RegistryError, check_name,
    read_expert, write_expert,
)
from decentral.merge.base import MergeError
from decentral.merge.recipe import OUTPUT_DTYPES, MergeRecipe, ModelRef, load_merge_recipe
from decentral.merge.tensors import (
    DTYPES, FLOAT_CODES, SafetensorsReader, SafetensorsWriter, ShardedReader, write_order,
)
from decentral.models.hf import SAVED_AS
from decentral.progress import progress_bar

EMBEDDING_HINTS = ("head", "embed", "wte", "tok")  # names of output heads and token embeddings
POSITION_HINTS = ("pos", "wpe")  # names of position embeddings (embed.pos, wpe, embed_positions), one row per token
MAX_LISTED = 10  # problems listed in one error message


@dataclass
class _Input:
    role: str  # "base" or "expert"
    ref: ModelRef
    expert: Expert
    reader: SafetensorsReader | ShardedReader

    def __str__(self) -> str:
        return f"{self.role} {self.ref.label!r}"

    def weight_files(self) -> set[str]:
        """The files of the input's folder that hold its weights."""
        if isinstance(self.reader, ShardedReader):
            return {self.reader.path.name, *self.reader.shards}
        return {self.reader.path.name}

    def checked_files(self) -> dict[Path, str]:
        """The files a verifying merge hashes, with their recorded sha256 (all but optimizer.safetensors)."""
        files = self.expert.files(with_optimizer=False)
        return {self.expert.folder / name: digest for name, (digest, _) in files.items()}


def merge(recipe: MergeRecipe | str | Path, out_dir: str | Path, progress: bool = True) -> Expert:
    """Merge as `recipe` (a MergeRecipe or a recipe file) says into expert folder `out_dir`; its Expert.
    `progress`: how many bytes are written, on stderr (decentral.progress: a bar on a terminal, else lines)."""
    if not isinstance(recipe, MergeRecipe):
        recipe = load_merge_recipe(recipe)
    out_dir = Path(os.path.abspath(out_dir))
    try:
        name = check_name(out_dir.name)
    except RegistryError as e:
        raise MergeError(f"output folder {out_dir}: {e}") from None
    refs = [("base", recipe.base)] if recipe.base else []
    refs += [("expert", ref) for ref in recipe.experts]
    with ExitStack() as stack:
        inputs = [_open_input(role, ref, recipe.source, stack) for role, ref in refs]
        _check_output_folder(out_dir, inputs)
        try:
            _check_one_kind(inputs)
            specs = _output_specs(inputs, recipe.dtype)
            model = _common_model(inputs)
        except MergeError:
            if recipe.verify:  # a damaged header reads as another model: name the damaged file instead
                _verify(inputs)
            raise
        if recipe.method.weights_from is not None:  # once the inputs fit together: posterior scores them
            if recipe.verify:  # (first: the prior it scores, and caches under their sha256, must be the recorded's)
                _verify(inputs)
            for i, weight in zip([i for i in inputs if i.role == "expert"], recipe.method.weights_from(recipe)):
                i.ref = replace(i.ref, weight=weight)
        base = inputs[0].expert if recipe.base else None
        meta = Expert(
            name=name, sha256="", size=0, model=model, domain=None, parent=base.sha256 if base else None,
            steps=max(i.expert.steps for i in inputs), tokens=max(i.expert.tokens for i in inputs),
            merge={
                "method": recipe.method.name,
                "parameters": dict(recipe.parameters),
                "dtype": recipe.dtype,
                "base": {"name": base.name, "sha256": base.sha256} if base else None,
                "experts": [{"name": i.expert.name, "sha256": i.expert.sha256, "weight": i.ref.weight}
                            for i in inputs if i.role == "expert"],
            },
        )
        if meta.is_hf:
            return write_expert(out_dir, lambda folder: _write_hf(folder, recipe, inputs, specs, progress), meta)
        return write_expert(out_dir, lambda path: _write_merged(path, recipe, inputs, specs, progress), meta)


def _open_input(role: str, ref: ModelRef, source: str, stack: ExitStack) -> _Input:
    named = ref.folder.name == ref.label  # a name in the registry, not a path
    try:
        expert = Registry(ref.folder.parent).get(ref.label) if named else read_expert(ref.folder)
    except RegistryError as e:
        raise MergeError(f"{source}: {ref.key} ({ref.label!r}): {e}") from None
    sharded = expert.is_hf and INDEX_FILE in expert.layout
    reader = stack.enter_context(ShardedReader(expert.folder / INDEX_FILE) if sharded else
                                 SafetensorsReader(expert.model_file))
    return _Input(role, ref, expert, reader)


def _check_output_folder(out_dir: Path, inputs: list[_Input]) -> None:
    """MergeError when `out_dir` is inside an expert folder, is a folder that holds something but not an expert, or
    is an input's. An empty folder is taken (the merge replaces it)."""
    inside = next((folder for folder in out_dir.parents if (folder / META_FILE).is_file()), None)
    if inside is not None:
        raise MergeError(f"{out_dir} is inside the expert folder {inside}; write the merge beside it "
                         f"(e.g. {inside.parent / out_dir.name})")
    if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return
    if not (out_dir / META_FILE).is_file():
        raise MergeError(f"{out_dir} exists and is not an expert folder (no {META_FILE}); refusing to replace it")
    for i in inputs:
        if out_dir.resolve() == i.ref.folder.resolve():
            raise MergeError(f"{out_dir} is the folder of {i}, an input of this merge; write the merge elsewhere")


def _output_specs(inputs: list[_Input], dtype: str | None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every output tensor; MergeError when the inputs do not fit together."""
    names = [set(i.reader.tensors) for i in inputs]
    every = sorted(set().union(*names))
    missing = [(tensor, [str(i) for i, have in zip(inputs, names) if tensor not in have]) for tensor in every]
    missing = [(tensor, lacking) for tensor, lacking in missing if lacking]
    if missing:
        problems = [f"{tensor!r} is missing from {', '.join(lacking)}" for tensor, lacking in missing]
        hint = ""
        if any(_looks_like_embedding(tensor) for tensor, _ in missing):
            hint = (". A missing output head or embedding: the model may tie the output head to the input "
                    "embedding and store the shared tensor once; experts must be saved untied, with both "
                    "tensors present, to be merged")
        raise MergeError(f"the inputs do not have the same tensors: {_listing(problems)}{hint}")

    problems = []
    specs = {}
    for tensor in every:
        infos = [i.reader.tensors[tensor] for i in inputs]
        shapes = [info.shape for info in infos]
        if len(set(shapes)) > 1:
            listed = ", ".join(f"{i} {list(shape)}" for i, shape in zip(inputs, shapes))
            problem = f"{tensor!r} has different shapes: {listed}"
            if _looks_like_embedding(tensor) and len({s[1:] for s in shapes}) == 1:
                rows = " vs ".join(str(n) for n in sorted({s[0] for s in shapes}))
                what = ("the contexts differ; experts must be trained at one context to be merged"
                        if any(hint in tensor.lower() for hint in POSITION_HINTS) else
                        "the vocabularies differ; experts must share one tokenizer to be merged")
                problem += f" (only the first dimension, {rows}: {what})"
            problems.append(problem)
        for i, info in zip(inputs, infos):
            if info.dtype not in FLOAT_CODES:
                problems.append(f"{tensor!r} is {info.dtype} in {i}; only floating-point tensors can be merged")
        codes = {info.dtype for info in infos}
        own = codes.pop() if len(codes) == 1 else "F32"
        specs[tensor] = (OUTPUT_DTYPES[dtype] if dtype else own, shapes[0])
    if problems:
        raise MergeError(f"the inputs' tensors do not fit together: {_listing(problems)}")
    return specs


def _looks_like_embedding(tensor: str) -> bool:
    return any(hint in tensor.lower() for hint in EMBEDDING_HINTS)


def _listing(problems: list[str]) -> str:
    more = f"; and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    return "; ".join(problems[:MAX_LISTED]) + more


def _check_one_kind(inputs: list[_Input]) -> None:
    """MergeError when Hugging Face and reference-GPT experts are merged together."""
    if len({i.expert.is_hf for i in inputs}) > 1:
        hf, gpt = ([str(i) for i in inputs if i.expert.is_hf == kind] for kind in (True, False))
        raise MergeError(f"the inputs mix Hugging Face models ({', '.join(hf)}) and reference GPTs "
                         f"({', '.join(gpt)}); a merge takes one kind")


def _common_model(inputs: list[_Input]) -> dict:
    """The inputs' shared expert.json `model` (and, for Hugging Face models, config.json but for `SAVED_AS`)."""
    if inputs[0].expert.is_hf:
        configs = [{k: v for k, v in _hf_config(i).items() if k not in SAVED_AS} for i in inputs]
        if any(config != configs[0] for config in configs):
            raise MergeError(f"the inputs' Hugging Face configs ({CONFIG_FILE}) differ: "
                             f"{_differences(inputs, configs)}")
    models = [i.expert.model for i in inputs]
    if all(model == models[0] for model in models):
        return dict(models[0])
    raise MergeError(f"the inputs' model configs (expert.json `model`) differ: {_differences(inputs, models)}")


def _differences(inputs: list[_Input], configs: list[dict]) -> str:
    """`key: input value, ...` for every key whose value is not the same in all `configs` (one per input)."""
    keys = sorted({k for config in configs for k in config})
    differ = [k for k in keys if len({repr(config.get(k)) for config in configs}) > 1]
    return "; ".join(f"{k}: " + ", ".join(f"{i} {config.get(k)!r}" for i, config in zip(inputs, configs))
                     for k in differ)


def _hf_config(i: _Input) -> dict:
    try:
        config = i.expert.hf_config()
    except RegistryError as e:
        raise MergeError(f"{i}: {e}") from None
    if not isinstance(config, dict):
        raise MergeError(f"{i}: {i.expert.folder / CONFIG_FILE} is not a JSON object")
    return config


def _write_hf(folder: Path, recipe: MergeRecipe, inputs: list[_Input], specs: dict[str, tuple[str, tuple[int, ...]]],
              progress: bool) -> dict[str, str]:
    """A merge of Hugging Face models in save_pretrained's layout: the first input's config.json (its dtype the
    output's) and other files beside the merged model.safetensors. {file: sha256} of the files hashed on the way."""
    first = inputs[0]
    config = _hf_config(first)
    codes = {code for code, _ in specs.values()}
    names = {code: name for name, code in OUTPUT_DTYPES.items()}
    if len(codes) == 1 and codes <= set(names):
        config["dtype"] = names[codes.pop()]
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in set(first.expert.layout) - first.weight_files() - {CONFIG_FILE}:
        shutil.copyfile(first.expert.folder / name, folder / name)
    return {MODEL_FILE: _write_merged(folder / MODEL_FILE, recipe, inputs, specs, progress)}


def _write_merged(path: Path, recipe: MergeRecipe, inputs: list[_Input],
                  specs: dict[str, tuple[str, tuple[int, ...]]], progress: bool) -> str:
    """Stream the merged tensors into `path`; the output's sha256. With `recipe.verify`, check every
    input's sha256 on the way.

    Three stages run on threads of their own and overlap (file reads, hashing and torch's arithmetic
    all release the GIL): reading tensor i+1 of every input, merging tensor i, and hashing and
    writing merged tensor i−1. Reads alternate between two sets of buffers, one buffer per input each,
    reused for every tensor (faulting in fresh pages took 4x as long as reading cached file data into
    touched ones, measured). When verifying, an input whose tensors the merge visits in file order,
    the usual case, is hashed from those same buffers by a fourth thread while the tensor is merged:
    the check covers exactly the bytes that were merged, and every file is read once. Any other
    input's files (a Hugging Face model's shards and config) are hashed again on that thread. An
    optimizer.safetensors beside the model is not checked: a merge does not use it. The arithmetic runs on one torch
    thread: it is memory-bound, and the other stages keep the second core busy.
    """
    base = inputs[0] if recipe.base else None
    experts = [i for i in inputs if i.role == "expert"]
    weights = [i.ref.weight for i in experts]
    order = write_order(specs)
    checked = inputs if recipe.verify else []
    streamed = {id(i): hashlib.sha256(i.reader.header) for i in checked if _in_file_order(i.reader, order)}
    buffer_sets = [{id(i): torch.empty(max((t.nbytes for t in i.reader.tensors.values()), default=0),
                                       dtype=torch.uint8) for i in inputs} for _ in range(2)]
    owned = {b.untyped_storage().data_ptr() for buffers in buffer_sets for b in buffers.values()}
    stages = {name: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"merge-{name}")
              for name in ("read", "write", "verify")}

    def read(name: str, buffers: dict) -> list[torch.Tensor]:
        return [i.reader.get(name, buffers[id(i)]) for i in inputs]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        rereads = {stages["verify"].submit(file_sha256, path): (i, path, digest) for i in checked
                   for path, digest in i.checked_files().items() if not (id(i) in streamed and path == i.reader.path)}
        hashing: list[Future] = []
        writing: Future | None = None
        reading = stages["read"].submit(read, order[0], buffer_sets[0]) if order else None
        total = sum(DTYPES[code].itemsize * torch.Size(shape).numel() for code, shape in specs.values())
        with SafetensorsWriter(path, specs) as writer, \
                progress_bar(total, f"merge {recipe.method.name}", "B", unit_scale=True, disable=not progress) as bar:
            for index, name in enumerate(order):
                _raise_if_corrupt(rereads, wait=False)
                versions = reading.result()
                buffers = buffer_sets[index % 2]
                for future in hashing:  # the other buffer set is about to be refilled
                    future.result()
                hashing = [stages["verify"].submit(streamed[id(i)].update,
                                                   buffers[id(i)][:i.reader.tensors[name].nbytes].numpy())
                           for i in inputs if id(i) in streamed]
                if index + 1 < len(order):
                    reading = stages["read"].submit(read, order[index + 1], buffer_sets[(index + 1) % 2])
                versions = [v.to(torch.float32) for v in versions]
                base_tensor, tensors = (versions[0], versions[1:]) if base else (None, versions)
                merged = recipe.method.merge(base_tensor, tensors, weights, name=name, **recipe.parameters)
                out = merged.to(DTYPES[specs[name][0]])
                _check_finite(name, out, versions, inputs)
                del versions, base_tensor, tensors
                if out.untyped_storage().data_ptr() in owned:  # a read buffer: refilled before it is written
                    out = out.clone()
                if writing is not None:
                    writing.result()
                writing = stages["write"].submit(_write, writer, bar, name, out)
            if writing is not None:
                writing.result()
            digest = writer.close()
        for future in hashing:
            future.result()
        for i in inputs:
            if id(i) in streamed and streamed[id(i)].hexdigest() != i.checked_files()[i.reader.path]:
                _corrupt(i, i.reader.path)
        _raise_if_corrupt(rereads, wait=True)
        return digest
    finally:
        for stage in stages.values():  # a read may still be running on an input about to be closed
            stage.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(threads)


def _write(writer: SafetensorsWriter, bar: tqdm, name: str, tensor: torch.Tensor) -> None:
    writer.write(name, tensor)
    bar.update(tensor.nbytes)


def _in_file_order(reader: SafetensorsReader | ShardedReader, order: list[str]) -> bool:
    """Whether visiting `order` reads the whole data section of `reader`'s file front to back (one file only)."""
    if not isinstance(reader, SafetensorsReader):
        return False
    begins = [reader.tensors[name].begin for name in order]
    return all(a <= b for a, b in zip(begins, begins[1:]))


def _raise_if_corrupt(rereads: dict[Future, tuple[_Input, Path, str]], wait: bool) -> None:
    """MergeError for an input whose file, hashed again by `rereads`, does not match its record."""
    for future, (i, path, digest) in rereads.items():
        if (wait or future.done()) and future.result() != digest:
            _corrupt(i, path)


def _verify(inputs: list[_Input]) -> None:
    """MergeError naming the first input file that does not match its recorded sha256."""
    for i in inputs:
        for path, digest in i.checked_files().items():
            if file_sha256(path) != digest:
                _corrupt(i, path)


def _corrupt(i: _Input, path: Path) -> None:
    raise MergeError(f"{i}: {path} does not match the sha256 recorded in its {META_FILE} "
                     "(corrupt or changed); not merging it")


def _check_finite(name: str, merged: torch.Tensor, tensors: list[torch.Tensor], inputs: list[_Input]) -> None:
    """MergeError unless every merged value, in the output's dtype, is finite (a float32 sum is a one-pass test; an
    overflowing sum is re-checked)."""
    if torch.isfinite(merged.sum(dtype=torch.float32)) or torch.isfinite(merged).all():
        return
    culprits = [str(i) for i, tensor in zip(inputs, tensors) if not torch.isfinite(tensor).all()]
    where = f"; non-finite values already in {', '.join(culprits)}" if culprits else ""
    if not culprits and merged.dtype != torch.float32:
        where = f" (beyond the range of the output dtype, {str(merged.dtype).removeprefix('torch.')})"
    raise MergeError(f"tensor {name!r}: the merge produced NaN or infinite values{where}")
