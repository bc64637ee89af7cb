"""`merge(recipe, out_dir)`: run a merge recipe tensor by tensor into a new expert folder.

1. Check before reading any tensor, from the expert.json files and the safetensors headers only:
   every input has the same tensor names (a missing output head or embedding gets a hint about tied
   weights), the same shape per tensor (a different first dimension of an embedding or head: the
   vocabularies differ), floating-point dtypes only, and one model config.
2. Merge: for each tensor, in the output file's order, read the base's and the experts' versions,
   convert them to float32, merge, check the result is finite, cast it to the output dtype and
   append it to the output file, hashing it on the way. Memory holds about k+2 tensors (TIES a few
   more), never k models. With `verify` (the recipe's, or `decentral merge --verify`) a helper
   thread hashes each input's model.safetensors from the very bytes merged and compares it with the
   sha256 in its expert.json; a mismatch fails the merge. It is off by default, as it is when a
   model is loaded: on this project's machines hashing reads at about 1.2 GB/s, several times
   slower than the rest of a merge, and experts are hash-checked when they are fetched.
3. The folder is written through decentral.experts.registry.write_expert: in a temporary folder
   beside `out_dir`, renamed into place only when complete and every input verified, so a failure
   anywhere leaves nothing behind.

The output dtype of a tensor is the recipe's `dtype`, else the dtype the inputs store it in (float32
where they disagree). The expert's name is `out_dir`'s folder name, which must be a valid expert
name: a MergeError says what is allowed rather than renaming it. `out_dir` may replace an older
expert folder, never a folder that is not an expert's, nor one of the merge's inputs.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from decentral.experts.registry import META_FILE, Expert, RegistryError, check_name, file_sha256, read_expert, write_expert
from decentral.merge.base import MergeError
from decentral.merge.recipe import OUTPUT_DTYPES, MergeRecipe, ModelRef, load_merge_recipe
from decentral.merge.tensors import DTYPES, FLOAT_CODES, SafetensorsReader, SafetensorsWriter, write_order

EMBEDDING_HINTS = ("head", "embed", "wte", "tok")  # names of output heads and token embeddings
MAX_LISTED = 10  # problems listed in one error message


@dataclass
class _Input:
    role: str  # "base" or "expert"
    ref: ModelRef
    expert: Expert
    reader: SafetensorsReader

    def __str__(self) -> str:
        return f"{self.role} {self.ref.label!r}"


def merge(recipe: MergeRecipe | str | Path, out_dir: str | Path, progress: bool = True) -> Expert:
    """Merge as `recipe` (a MergeRecipe or a recipe file) says into expert folder `out_dir`; its Expert.
    `progress`: a bar of the bytes written, on stderr when that is a terminal."""
    if not isinstance(recipe, MergeRecipe):
        recipe = load_merge_recipe(recipe)
    if recipe.method.weights_from is not None:
        recipe = replace(recipe, experts=[replace(ref, weight=w) for ref, w in
                                          zip(recipe.experts, recipe.method.weights_from(recipe))])
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
        specs = _output_specs(inputs, recipe.dtype)
        model = _common_model(inputs)
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
        return write_expert(out_dir, lambda path: _write_merged(path, recipe, inputs, specs, progress), meta)


def _open_input(role: str, ref: ModelRef, source: str, stack: ExitStack) -> _Input:
    try:
        expert = read_expert(ref.folder)
    except RegistryError as e:
        raise MergeError(f"{source}: {ref.key} ({ref.label!r}): {e}") from None
    reader = stack.enter_context(SafetensorsReader(expert.model_file))
    return _Input(role, ref, expert, reader)


def _check_output_folder(out_dir: Path, inputs: list[_Input]) -> None:
    if not out_dir.exists():
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
                problem += (f" (only the first dimension, {rows}: the vocabularies differ; "
                            "experts must share one tokenizer to be merged)")
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


def _common_model(inputs: list[_Input]) -> dict:
    first = inputs[0].expert.model
    if all(i.expert.model == first for i in inputs):
        return dict(first)
    keys = sorted({k for i in inputs for k in i.expert.model})
    differ = [k for k in keys if len({repr(i.expert.model.get(k)) for i in inputs}) > 1]
    listed = "; ".join(f"{k}: " + ", ".join(f"{i} {i.expert.model.get(k)!r}" for i in inputs) for k in differ)
    raise MergeError(f"the inputs' model configs (expert.json `model`) differ: {listed}")


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
    input's file is hashed again on that thread. Only model.safetensors is checked, not an
    optimizer.safetensors beside it, which a merge does not use. The arithmetic runs on one torch
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
        rereads = {stages["verify"].submit(file_sha256, i.expert.model_file): i for i in checked if id(i) not in streamed}
        hashing: list[Future] = []
        writing: Future | None = None
        reading = stages["read"].submit(read, order[0], buffer_sets[0]) if order else None
        total = sum(DTYPES[code].itemsize * torch.Size(shape).numel() for code, shape in specs.values())
        with SafetensorsWriter(path, specs) as writer, \
                tqdm(total=total, unit="B", unit_scale=True, desc=f"merge {recipe.method.name}",
                     disable=None if progress else True) as bar:  # None: on a terminal only
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
                _check_finite(name, merged, versions, inputs)
                del versions, base_tensor, tensors
                out = merged.to(DTYPES[specs[name][0]])
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
            if id(i) in streamed and streamed[id(i)].hexdigest() != i.expert.sha256:
                _corrupt(i)
        _raise_if_corrupt(rereads, wait=True)
        return digest
    finally:
        for stage in stages.values():  # a read may still be running on an input about to be closed
            stage.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(threads)


def _write(writer: SafetensorsWriter, bar: tqdm, name: str, tensor: torch.Tensor) -> None:
    writer.write(name, tensor)
    bar.update(tensor.nbytes)


def _in_file_order(reader: SafetensorsReader, order: list[str]) -> bool:
    """Whether visiting `order` reads the whole data section of `reader`'s file front to back."""
    begins = [reader.tensors[name].begin for name in order]
    return all(a <= b for a, b in zip(begins, begins[1:]))


def _raise_if_corrupt(rereads: dict[Future, _Input], wait: bool) -> None:
    """MergeError for an input whose file, hashed again by `rereads`, does not match its record."""
    for future, i in rereads.items():
        if (wait or future.done()) and future.result() != i.expert.sha256:
            _corrupt(i)


def _corrupt(i: _Input) -> None:
    raise MergeError(f"{i}: {i.expert.model_file} does not match the sha256 recorded in its {META_FILE} "
                     "(corrupt or changed); not merging it")


def _check_finite(name: str, merged: torch.Tensor, tensors: list[torch.Tensor], inputs: list[_Input]) -> None:
    """MergeError unless every merged value is finite (a sum is a one-pass test; an overflowing sum is re-checked)."""
    if torch.isfinite(merged.sum()) or torch.isfinite(merged).all():
        return
    culprits = [str(i) for i, tensor in zip(inputs, tensors) if not torch.isfinite(tensor).all()]
    where = f"; non-finite values already in {', '.join(culprits)}" if culprits else ""
    raise MergeError(f"tensor {name!r}: the merge produced NaN or infinite values{where}")
