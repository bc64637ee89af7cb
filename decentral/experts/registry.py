"""A registry of experts: a folder with one sub-folder per expert.

An expert folder holds `model.safetensors` (the model's state dict, tensor names as in
`decentral.models.GPT`), optionally `optimizer.safetensors` (the inner AdamW state, so an expert
branched from it continues the optimizer as well as the weights), and `expert.json`:

    {"format": 1, "name": "code", "domain": "code",
     "model": {GPTConfig fields},          how to build the model that loads these tensors
     "sha256": "...", "size": 1589136,    of model.safetensors: downloads and merges check it
     "parent": "..." | null,              sha256 of the model it was branched from (the seed)
     "start_step": 300, "steps": 600,     the step it branched at, and the step it reached
     "tokens": 1228800,                   tokens this replica has seen, its ancestors' included (a merge:
                                          the most of its inputs', as the shared seed's are not known apart)
     "recipe": {...} | null,              the training recipe, as `decentral train` ran it
     "optimizer": {"sha256", "size", "param_groups"} | null,   of optimizer.safetensors
     "merge": {...} | null}               for merged models: method, parameters, inputs

A model's hash is the sha256 of its safetensors bytes as `safetensors.torch.save` writes them
(sorted names, no metadata), so the same weights always have the same hash, whichever path
(a training checkpoint, a merge, a download) produced them.

A Hugging Face expert (decentral.models.hf) is a folder that `AutoModelForCausalLM.from_pretrained`
opens: save_pretrained's layout (config.json, model.safetensors or shards with
model.safetensors.index.json, HF's own tensor names) beside expert.json, whose `model` is
`{"source": "hf"}` and `layout` lists every file of the layout with its sha256 and size. Its `sha256`
is that of the layout's manifest, the lines `{sha256}  {file}` in file-name order (`sha256sum`'s), and
`size` the layout's bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import save as save_tensors
from torch import nn

from decentral.checkpoint import (
    TENSORS_FILE, CheckpointError, file_sha256, inner_tensors, load_checkpoint, model_tensors,
)
from decentral.checkpoint import META_FILE as CHECKPOINT_META_FILE
from decentral.models import GPT, GPT_SOURCE, HF_SOURCE, GPTConfig, ModelError

FORMAT = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
META_FILE = "expert.json"
CONFIG_FILE = "config.json"  # of a Hugging Face model
INDEX_FILE = "model.safetensors.index.json"  # of a Hugging Face model saved in shards
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
FILE_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a file of a layout: no folders

log = logging.getLogger(__name__)


class RegistryError(ValueError):
    """An expert or registry folder is missing, malformed or fails its checksum."""


@dataclass
class Expert:
    """The metadata of one expert folder (`expert.json`), and where it lives."""

    name: str
    sha256: str
    size: int
    model: dict[str, Any]
    domain: str | None = None
    parent: str | None = None
    start_step: int = 0
    steps: int = 0
    tokens: int = 0
    recipe: dict[str, Any] | None = None
    optimizer: dict[str, Any] | None = None
    merge: dict[str, Any] | None = None
    layout: dict[str, dict[str, Any]] | None = None  # Hugging Face experts: {file: {"sha256", "size"}}
    path: Path | None = field(default=None, compare=False)

    @property
    def is_hf(self) -> bool:
        """Whether this is a Hugging Face model in save_pretrained's layout (else the reference GPT)."""
        return self.model.get("source") == HF_SOURCE

    @property
    def model_file(self) -> Path:
        return self.folder / MODEL_FILE

    @property
    def optimizer_file(self) -> Path | None:
        return self.folder / OPTIMIZER_FILE if self.optimizer else None

    def files(self, with_optimizer: bool = True) -> dict[str, tuple[str, int]]:
        """{file name: (sha256, size)} of the files that make up this expert, expert.json aside (and the optimizer
        state unless `with_optimizer`)."""
        if self.is_hf:
            out = {name: (entry["sha256"], entry["size"]) for name, entry in self.layout.items()}
        else:
            out = {MODEL_FILE: (self.sha256, self.size)}
        if self.optimizer and with_optimizer:
            out[OPTIMIZER_FILE] = (self.optimizer["sha256"], self.optimizer["size"])
        return out

    @property
    def folder(self) -> Path:
        if self.path is None:
            raise RegistryError(f"expert {self.name!r} has no folder (it is a remote record)")
        return self.path

    def to_json(self) -> dict[str, Any]:
        """expert.json's record (a reference GPT's without `layout`, as before Hugging Face experts)."""
        meta = {k: v for k, v in asdict(self).items() if k != "path" and not (k == "layout" and v is None)}
        return {"format": FORMAT, **meta}

    def config(self) -> GPTConfig:
        if self.is_hf:
            raise RegistryError(f"expert {self.name!r} is a Hugging Face model, not the reference GPT")
        try:
            return GPTConfig(**self.model)
        except (TypeError, ValueError) as e:
            raise RegistryError(f"expert {self.name!r}: bad model config {self.model}: {e}") from None

    def hf_config(self) -> dict[str, Any]:
        """A Hugging Face expert's config.json."""
        return _read_json(self.folder / CONFIG_FILE)

    @property
    def context(self) -> int:
        """The sequence length to evaluate it at: the reference GPT's `context`; a Hugging Face model's training
        context (its recipe's), else its config's max_position_embeddings."""
        if not self.is_hf:
            return self.config().context
        if self.recipe:
            return int(self.recipe["train"]["context"])
        config = self.hf_config()
        positions = config.get("text_config", config).get("max_position_embeddings")
        if not isinstance(positions, int):
            raise RegistryError(f"expert {self.name!r}: its {CONFIG_FILE} has no max_position_embeddings and it has "
                                "no recipe: no context to evaluate it at")
        return positions

    def load_model(self, device: torch.device | str = "cpu", verify: bool = False) -> nn.Module:
        """Build the model from `model` and load the weights (checking the hash first when `verify`): the reference
        GPT, or a Hugging Face expert through `from_pretrained` behind decentral.models.hf.HFCausalLM."""
        from safetensors.torch import load_file

        if verify:
            verify_expert(self, with_optimizer=False)
        if self.is_hf:
            from decentral.models.hf import HFCausalLM, read_pretrained_layout

            try:
                return HFCausalLM(read_pretrained_layout(self.folder)).to(device).eval()
            except ModelError as e:
                raise RegistryError(f"expert {self.name!r}: {e}") from None
        model = GPT(self.config())
        try:
            state = load_file(self.model_file)
        except (SafetensorError, OSError) as e:
            raise RegistryError(f"expert {self.name!r}: {self.model_file} is not a readable safetensors file ({e}); "
                                "fetch or train it again") from None
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise RegistryError(f"expert {self.name!r}: {self.model_file} does not fit its model config: {e}") from None
        return model.to(device).eval()


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise RegistryError(f"expert name {name!r} must be 1-64 letters, digits, '.', '_' or '-', not starting with a symbol")
    return name


def model_bytes(state: dict[str, torch.Tensor]) -> bytes:
    """The canonical safetensors bytes of a model state dict (contiguous CPU copies, sorted names)."""
    return save_tensors({k: v.detach().to("cpu").contiguous() for k, v in state.items()})


def model_sha256(state: dict[str, torch.Tensor]) -> str:
    """The hash an expert folder holding `state` records: sha256 of `model_bytes(state)`."""
    return hashlib.sha256(model_bytes(state)).hexdigest()


def layout_digest(layout: dict[str, dict[str, Any]]) -> str:
    """The sha256 of a Hugging Face expert: of its layout's manifest, `{sha256}  {file}` lines by file name."""
    manifest = "".join(f"{layout[name]['sha256']}  {name}\n" for name in sorted(layout))
    return hashlib.sha256(manifest.encode()).hexdigest()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RegistryError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise RegistryError(f"{path}: cannot be read ({e.strerror})") from None


def read_expert(folder: str | Path) -> Expert:
    """The expert stored in `folder`; RegistryError naming the file when anything is missing or malformed."""
    folder = Path(folder)
    meta_path = folder / META_FILE
    if not meta_path.is_file():
        raise RegistryError(f"{folder} is not an expert folder: {META_FILE} is missing")
    expert = expert_from_json(_read_json(meta_path), str(meta_path), path=folder)
    for name in expert.layout or [MODEL_FILE]:
        if not (folder / name).is_file():
            raise RegistryError(f"{folder} is not an expert folder: {name} is missing")
    return expert


_COUNT = (int, "a count >= 0")
_TEXT = ((str, type(None)), "a string or null")
_MAPPING = ((dict, type(None)), "a mapping or null")
_FIELDS = {"name": (str, "a string"), "domain": _TEXT, "parent": _TEXT, "size": _COUNT, "start_step": _COUNT,
           "steps": _COUNT, "tokens": _COUNT, "recipe": _MAPPING, "merge": _MAPPING}  # expert.json's: (types, said as)


def expert_from_json(meta: Any, where: str, path: Path | None = None) -> Expert:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise RegistryError(f"{where}: not a format-{FORMAT} expert record")
    known = {f.name for f in fields(Expert)} - {"path"}
    try:
        expert = Expert(**{k: v for k, v in meta.items() if k in known}, path=path)
    except TypeError as e:
        raise RegistryError(f"{where}: {e}") from None
    for name, (kinds, said) in _FIELDS.items():
        value = getattr(expert, name)
        if not isinstance(value, kinds) or isinstance(value, bool) or (isinstance(value, int) and value < 0):
            raise RegistryError(f"{where}: {name} must be {said}, got {value!r}")
    if not isinstance(expert.sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", expert.sha256):
        raise RegistryError(f"{where}: sha256 must be 64 hex digits")
    if not isinstance(expert.model, dict):
        raise RegistryError(f"{where}: model must be a mapping of GPTConfig fields")
    if expert.is_hf:
        _check_layout(expert, where)
    elif expert.layout is not None:
        raise RegistryError(f"{where}: only a Hugging Face expert (model source {HF_SOURCE!r}) has a layout")
    else:
        expert.config()  # RegistryError when its model section does not describe a GPT
    if expert.optimizer is not None and not (
        isinstance(expert.optimizer, dict) and {"sha256", "size", "param_groups"} <= set(expert.optimizer)
    ):
        raise RegistryError(f"{where}: optimizer must be null or have sha256, size and param_groups")
    check_name(expert.name)
    return expert


def _check_layout(expert: Expert, where: str) -> None:
    """RegistryError unless a Hugging Face expert's layout lists plain files with their sha256 and size, a config and
    weights among them, and its sha256 and size are the layout's."""
    layout = expert.layout
    if not isinstance(layout, dict):
        raise RegistryError(f"{where}: a Hugging Face expert needs `layout`, {{file: {{sha256, size}}}}")
    for name, entry in layout.items():
        if not FILE_PATTERN.match(name) or name in (META_FILE, OPTIMIZER_FILE):
            raise RegistryError(f"{where}: layout file {name!r} must be a plain file name other than {META_FILE} and "
                                f"{OPTIMIZER_FILE}")
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]) and isinstance(entry.get("size"), int)
                and entry["size"] >= 0):
            raise RegistryError(f"{where}: layout file {name!r} needs a sha256 of 64 hex digits and a size")
    if CONFIG_FILE not in layout or not {MODEL_FILE, INDEX_FILE} & set(layout):
        raise RegistryError(f"{where}: the layout needs {CONFIG_FILE} and {MODEL_FILE} or {INDEX_FILE}")
    if expert.sha256 != layout_digest(layout) or expert.size != sum(e["size"] for e in layout.values()):
        raise RegistryError(f"{where}: sha256 and size must be the layout's (its manifest's sha256, its bytes)")


def verify_expert(expert: Expert, with_optimizer: bool = True) -> None:
    """Raise RegistryError unless each of the expert's files (the optimizer state only `with_optimizer`) has its
    recorded size and sha256."""
    for name, (sha256, size) in expert.files(with_optimizer).items():
        path = expert.folder / name
        if not path.is_file() or path.stat().st_size != size or file_sha256(path) != sha256:
            raise RegistryError(f"expert {expert.name!r}: {path} does not match its recorded sha256 (missing, corrupt or "
                                "changed since it was written): make it again as it was made (seed, branch, add, "
                                "fetch or merge) with --replace")


@contextlib.contextmanager
def staging(folder: str | Path) -> Iterator[Path]:
    """A temporary folder beside `folder` that replaces `folder` when the block ends without an error,
    and is removed when it raises: whoever reads `folder` sees the old version or the whole new one (or,
    once the process was killed between the two renames, nothing until `put_back_set_aside` is called)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    put_back_set_aside(folder)
    tmp = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        yield tmp
        old = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:12]}"
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def put_back_set_aside(folder: Path) -> None:
    """A `staging` killed between its two renames left `folder` missing, its old version set aside as a hidden
    `.NAME.old-*` beside it: put that back (the latest, when there are several)."""
    if folder.exists() or not folder.parent.is_dir():
        return
    prefix = f".{folder.name}.old-"
    set_aside = [p for p in folder.parent.iterdir() if p.name.startswith(prefix) and (p / META_FILE).is_file()]
    if set_aside:
        latest = max(set_aside, key=lambda p: p.stat().st_mtime)
        os.replace(latest, folder)
        log.warning("%s: put back the version set aside by a replacement that was cut off (%s)", folder, latest.name)


def write_meta(folder: Path, expert: Expert) -> None:
    (folder / META_FILE).write_text(json.dumps(expert.to_json(), indent=1) + "\n")


def write_expert(folder: str | Path, write_model, meta: Expert,
                 optimizer: tuple[dict[str, torch.Tensor], list] | None = None) -> Expert:
    """Create expert folder `folder` atomically (see `staging`): `write_model(path)` writes
    model.safetensors (and may return its sha256, when it hashed the bytes as it wrote them),
    `optimizer` (inner optimizer tensors, param_groups) goes to optimizer.safetensors, and their sizes
    and hashes are filled into `meta` before expert.json is written. A failure leaves nothing behind.
    For a Hugging Face expert (`meta.is_hf`) `write_model(folder)` writes save_pretrained's layout into the
    folder (it may return {file: sha256} of those it hashed as it wrote them): each file is `meta.layout`."""
    with staging(folder) as tmp:
        if meta.is_hf:
            _write_layout(tmp, write_model, meta)
        else:
            digest = write_model(tmp / MODEL_FILE)
            meta.size = (tmp / MODEL_FILE).stat().st_size
            meta.sha256 = digest if isinstance(digest, str) else file_sha256(tmp / MODEL_FILE)
        if optimizer is not None:
            tensors, param_groups = optimizer
            (tmp / OPTIMIZER_FILE).write_bytes(model_bytes(tensors))
            meta.optimizer = {"sha256": file_sha256(tmp / OPTIMIZER_FILE), "size": (tmp / OPTIMIZER_FILE).stat().st_size,
                              "param_groups": param_groups}
        write_meta(tmp, meta)
    meta.path = Path(folder)
    return meta


def _write_layout(folder: Path, write_files, meta: Expert) -> None:
    """Let `write_files(folder)` write a Hugging Face model's layout; record its files in `meta` (checked)."""
    hashed = write_files(folder) or {}
    meta.layout = {}
    for path in sorted(folder.iterdir()):
        if not path.is_file():
            raise RegistryError(f"{path.name}: a model's layout is plain files, not folders")
        meta.layout[path.name] = {"sha256": hashed.get(path.name) or file_sha256(path), "size": path.stat().st_size}
    meta.sha256, meta.size = layout_digest(meta.layout), sum(e["size"] for e in meta.layout.values())
    _check_layout(meta, f"expert {meta.name!r}")


def _copy_files(files: list[Path]):
    """A `write_model` for a Hugging Face expert that copies `files` into its folder."""
    def write(folder: Path) -> None:
        for path in files:
            shutil.copyfile(path, folder / path.name)
    return write


def checkpoint_layout(checkpoint: Path) -> list[Path]:
    """The files of a Hugging Face model's save_pretrained layout in a `decentral train` checkpoint."""
    return sorted(p for p in checkpoint.iterdir() if p.is_file() and p.name not in (TENSORS_FILE, CHECKPOINT_META_FILE))


def trained_domains(meta: dict) -> str | None:
    """The --domain values a checkpoint's run trained on (its meta's `data`), comma-separated, as `experts seed` and
    `branch` name an expert's domain; None when it trained on one corpus or its checkpoint does not say."""
    data = meta.get("data")
    domains = data.get("domains") if isinstance(data, dict) else None
    return ",".join(map(str, domains)) if isinstance(domains, list) and domains else None


def expert_from_checkpoint(checkpoint: str | Path, folder: str | Path, *, name: str, domain: str | None,
                           with_optimizer: bool = False) -> Expert:
    """Write the model of a `decentral train` checkpoint as an expert folder, with its lineage (and its
    inner optimizer state when `with_optimizer`, for experts that others will branch from). A Hugging Face
    model's checkpoint holds it in save_pretrained's layout: those files are copied as they are. `domain`
    None: the domains the checkpoint trained on (`trained_domains`)."""
    checkpoint = Path(checkpoint)
    try:
        tensors, meta = load_checkpoint(checkpoint)  # checks every file's sha256, the layout's included
    except CheckpointError as e:
        if (checkpoint / META_FILE).is_file():
            raise RegistryError(f"{checkpoint} is an expert folder ({META_FILE}), not a `decentral train` checkpoint: "
                                "copy it into the registry's folder, or `experts fetch` it from a swarm") from None
        inside = checkpoint / "checkpoint"  # a `decentral train` run's folder holds its checkpoint there
        raise RegistryError(f"{e}" + (f" (did you mean {inside}?)" if inside.is_dir() else "")) from None
    state = model_tensors(tensors)
    hf = "recipe" in meta and meta["recipe"]["model"].get("source", GPT_SOURCE) != GPT_SOURCE
    if not (state or hf) or "recipe" not in meta:
        raise RegistryError(f"{checkpoint} is not a `decentral train` checkpoint (no model tensors or recipe)")
    if hf:
        write_model = _copy_files(checkpoint_layout(checkpoint))
    else:
        data = model_bytes(state)
        write_model = lambda path: path.write_bytes(data)  # noqa: E731
    lineage = meta.get("lineage", {})
    expert = Expert(
        name=check_name(name), domain=domain or trained_domains(meta), sha256="", size=0,
        model={"source": HF_SOURCE} if hf else meta["recipe"]["model"],
        parent=lineage.get("parent"), start_step=int(lineage.get("start_step", 0)),
        steps=int(meta["sync"]["step"]), tokens=int(lineage.get("tokens", 0)), recipe=meta["recipe"],
    )
    optimizer = None
    if with_optimizer:
        optimizer = (inner_tensors(tensors), meta["inner_optimizer"]["param_groups"])
    return write_expert(folder, write_model, expert, optimizer)


class Registry:
    """A folder of expert folders, one per name."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():  # (it was listed as a folder that does not exist)
            raise RegistryError(f"registry {self.root} is a file, not a folder")

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        for hidden in [p for p in self.root.iterdir() if p.name.startswith(".") and ".old-" in p.name]:
            put_back_set_aside(self.root / hidden.name[1:].rsplit(".old-", 1)[0])
        return sorted(p.name for p in self.root.iterdir() if (p / META_FILE).is_file() and not p.name.startswith("."))

    def folder(self, name: str) -> Path:
        return self.root / check_name(name)

    def get(self, name: str) -> Expert:
        folder = self.folder(name)
        put_back_set_aside(folder)
        if not folder.is_dir():
            if not self.root.is_dir():
                raise RegistryError(f"no expert {name!r}: there is no registry folder {self.root}")
            known = ", ".join(self.names()) or "none"
            raise RegistryError(f"no expert {name!r} in {self.root} (there: {known})")
        expert = read_expert(folder)
        if expert.name != name:
            raise RegistryError(f"{folder / META_FILE} names expert {expert.name!r}, not {name!r}")
        return expert

    def add_checkpoint(self, checkpoint: str | Path, name: str, domain: str | None = None,
                       with_optimizer: bool = False) -> Expert:
        return expert_from_checkpoint(checkpoint, self.folder(name), name=name, domain=domain,
                                      with_optimizer=with_optimizer)
