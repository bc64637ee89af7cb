"""Checkpoints: a directory holding `tensors.safetensors` and `meta.json`, replaced atomically.

`meta.json` carries the caller's metadata plus `format`, the sha256 of the tensor file and its own
(`meta_sha256`, over the rest of it), so a torn or corrupted checkpoint is refused on load instead of
silently resuming from garbage, a step or schedule flipped in meta.json included. A caller
may put more files into the directory (`save_checkpoint(files=...)`, e.g. a model in Hugging Face's
save_pretrained layout); they are written inside the same atomic swap and checked the same way
(`files_sha256` in meta.json).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save_file

FORMAT = 1
TENSORS_FILE = "tensors.safetensors"
META_FILE = "meta.json"
_RESERVED = ("format", "tensors_sha256", "files_sha256", "meta_sha256")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt, or another process writes to its folder."""


@contextlib.contextmanager
def sole_writer(out: Path):
    """Hold an exclusive lock on run folder OUT (OUT/.lock) while a run writes there: a second process given
    the same --out (two island ranks, a run started twice) stops at once instead of writing over the first's
    checkpoints and metrics. CheckpointError when another process holds it. A POSIX record lock: the
    process's own, not inherited by the processes it forks (a DHT process may outlive a killed worker for a
    few seconds)."""
    with open(Path(out) / ".lock", "a") as lock:
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise CheckpointError(f"another process is writing to {out} (a run with the same --out): give each "
                                  "run its own --out") from None
        yield


def save_checkpoint(directory: str | Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                    files: Callable[[Path], None] | None = None) -> Path:
    """Write `tensors` and JSON-serialisable `meta` to `directory`, replacing any checkpoint there.
    `files(folder)`, when given, writes more files into the new checkpoint's folder before it is put in
    place (any names but ours); `load_checkpoint` checks their sha256 too.

    A crash at any point leaves a complete checkpoint on disk: the old one (at `directory`, or
    moved aside to `.<name>.old` next to it, where `load_checkpoint` finds it) or the new one.
    Meta keys `format`, `tensors_sha256`, `files_sha256` and `meta_sha256` are reserved. Not safe for two concurrent
    writers of the same directory. Returns `directory` as a Path. CheckpointError when the tensors cannot be
    written (a full disk), OSError when another file cannot; the checkpoint there before is kept either way.
    """
    directory = Path(directory)
    parent = directory.parent
    parent.mkdir(parents=True, exist_ok=True)
    storable = _storable(tensors)
    tmp = parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    aside = _aside(directory)
    try:
        checked = {"format": FORMAT}
        if files is not None:
            checked["files_sha256"] = _add_files(tmp, files)
        try:
            save_file(storable, tmp / TENSORS_FILE)  # from the tensors' memory to the file, no copy of them in memory
        except SafetensorError as e:  # (its I/O errors, a full disk's among them, are no OSError)
            raise CheckpointError(f"could not write the checkpoint {directory}: {' '.join(str(e).split())} (the "
                                  "last one saved there, if any, is kept)") from None
        checked["tensors_sha256"] = _synced_sha256(tmp / TENSORS_FILE)
        whole = {**meta, **checked}
        meta_text = json.dumps({**whole, "meta_sha256": _meta_sha256(whole)}, indent=1)
        _write_synced(tmp / META_FILE, meta_text.encode())
        _fsync_dir(tmp)
        if directory.exists():
            if aside.exists():  # left by an earlier crash after the new checkpoint was in place
                shutil.rmtree(aside)
            os.replace(directory, aside)
        os.replace(tmp, directory)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    return directory


def load_checkpoint(directory: str | Path, files: Callable[[Path], Mapping[str, torch.Tensor]] | None = None
                    ) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a checkpoint written by `save_checkpoint`: (tensors on CPU, the meta that was saved). `files(folder)`,
    when given, reads tensors from the files a save's `files` wrote (once their checksums passed); they
    join the tensors returned.

    Raises CheckpointError naming the path when anything is missing, unreadable or fails its checksum.
    """
    directory, meta = _read_meta(directory)
    tensors_path = directory / TENSORS_FILE
    data = tensors_path.read_bytes()
    if hashlib.sha256(data).hexdigest() != meta["tensors_sha256"]:
        raise CheckpointError(f"corrupt checkpoint {tensors_path} (checksum mismatch)")
    _check_files(directory, meta)
    try:
        tensors = load_tensors(data)
    except SafetensorError as e:
        raise CheckpointError(f"corrupt checkpoint {tensors_path}: {e}") from e
    if files is not None:
        tensors.update(files(directory))
    return tensors, {k: v for k, v in meta.items() if k not in _RESERVED}


def check_saved_files(directory: str | Path) -> None:
    """The checksums of the files a save's `files` wrote, as `load_checkpoint` checks them, for a reader that
    opens those files alone (`--model CHECKPOINT` reads a Hugging Face model's save_pretrained files);
    CheckpointError as `load_checkpoint`."""
    _check_files(*_read_meta(directory))


def _check_files(directory: Path, meta: dict) -> None:
    for name, digest in meta.get("files_sha256", {}).items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"incomplete checkpoint {directory}: {name} is missing")
        if file_sha256(path) != digest:
            raise CheckpointError(f"corrupt checkpoint {path} (checksum mismatch)")


def read_checkpoint_meta(directory: str | Path) -> dict:
    """The meta that was saved with a checkpoint, read without its tensors (meta.json's own checksum is checked,
    not those of the other files: `load_checkpoint` does that); CheckpointError as `load_checkpoint` when it is
    missing, unreadable or corrupt."""
    _, meta = _read_meta(directory)
    return {k: v for k, v in meta.items() if k not in _RESERVED}


def _read_meta(directory: str | Path) -> tuple[Path, dict]:
    """(the checkpoint's folder: `directory`, or where a save that crashed left it; its meta.json, reserved keys
    included); CheckpointError naming what is missing or unreadable."""
    directory = Path(directory)
    if not directory.is_dir() and _aside(directory).is_dir():  # a save crashed between its two renames
        directory = _aside(directory)
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint at {directory}: directory does not exist")
    meta_path = directory / META_FILE
    for path in (meta_path, directory / TENSORS_FILE):
        if not path.is_file():
            raise CheckpointError(f"incomplete checkpoint {directory}: {path.name} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"corrupt checkpoint {meta_path}: not valid JSON ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "tensors_sha256" not in meta:
        raise CheckpointError(f"corrupt checkpoint {meta_path}: not a format-{FORMAT} checkpoint meta")
    own = meta.get("meta_sha256")  # (checkpoints saved before 2026-12-04 have none)
    if own is not None and own != _meta_sha256({k: v for k, v in meta.items() if k != "meta_sha256"}):
        raise CheckpointError(f"corrupt checkpoint {meta_path} (checksum mismatch: its contents changed after it "
                              "was saved)")
    return directory, meta


def _meta_sha256(meta: Mapping[str, Any]) -> str:
    """sha256 of `meta` in one canonical JSON form (keys sorted, no spaces): the same for the dict saved and the
    dict read back."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _storable(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors with no two sharing storage (safetensors refuses both)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu")
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        seen.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


def _add_files(folder: Path, write: Callable[[Path], None]) -> dict[str, str]:
    """Let `write` add files to `folder`; {path relative to it: sha256} of each, synced to disk."""
    write(folder)
    digests = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        if name in (TENSORS_FILE, META_FILE):
            raise ValueError(f"a checkpoint's files may not include {name}: it is the checkpoint's own")
        digests[name] = _synced_sha256(path)
    return digests


def checkpoint_present(directory: str | Path) -> bool:
    """Whether `load_checkpoint(directory)` has something to read (a folder there, or one a crashed save moved
    aside)."""
    directory = Path(directory)
    return directory.is_dir() or _aside(directory).is_dir()


def _aside(directory: Path) -> Path:
    return directory.with_name(f".{directory.name}.old")


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, as hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _synced_sha256(path: Path) -> str:
    """The sha256 of a file just written, once it is on disk (fsync)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return file_sha256(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as flat named tensors: `inner.{param index}.{key}`."""
    out = {}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            out[f"inner.{index}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return out


def optimizer_state_dict(tensors: dict[str, torch.Tensor], param_groups: list) -> dict[str, Any]:
    """Inverse of `optimizer_tensors`, plus the param groups: a state dict for `load_state_dict`."""
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": param_groups}


def training_state(model_tensors: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                   sync: Mapping[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, meta) to resume training from: the model's tensors as `model.*`, the inner optimizer's
    state as `inner.*` (its param groups in meta), and a sync protocol's `state_dict()` as `outer.*`
    (its meta as meta["sync"])."""
    tensors = {f"model.{k}": v for k, v in model_tensors.items()}
    tensors.update(optimizer_tensors(optimizer))
    meta: dict[str, Any] = {"inner_optimizer": {"param_groups": optimizer.state_dict()["param_groups"]}}
    if sync is not None:
        tensors.update({f"outer.{k}": v for k, v in sync["tensors"].items()})
        meta["sync"] = sync["meta"]
    return tensors, meta


def model_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors of a `training_state` checkpoint, named as in its state dict (no `model.`)."""
    return {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}


def inner_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inner optimizer's tensors of a `training_state` checkpoint (`inner.*`, for `optimizer_state_dict`)."""
    return {k: v for k, v in tensors.items() if k.startswith("inner.")}


def load_training_state(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                        optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Inverse of `training_state`: loads the inner optimizer's state; returns the model's tensors and the
    sync protocol's state dict (None when the checkpoint has none)."""
    optimizer.load_state_dict(optimizer_state_dict(inner_tensors(tensors), meta["inner_optimizer"]["param_groups"]))
    model = model_tensors(tensors)
    if "sync" not in meta:
        return model, None
    return model, {"meta": meta["sync"], "tensors": {k[len("outer."):]: v for k, v in tensors.items()
                                                       if k.startswith("outer.")}}
