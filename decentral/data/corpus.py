"""Load text files as byte-token streams, split into train and validation by file."""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SEPARATOR = b"\n\n"  # placed between files in a stream
MIN_SPLIT_BYTES = 4 * 1024  # the smallest train or val stream load_corpus accepts


@dataclass
class Corpus:
    """uint8 token streams; `train` and `val` are built from disjoint sets of distinct files."""

    train: np.ndarray
    val: np.ndarray
    num_files: int  # distinct files used, both splits together
    source: str  # where the text came from, for messages


def default_corpus_paths() -> list[Path]:
    """Every `*.py` file of the Python standard library, without site-packages and test folders, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "test", "tests")]
        found.extend(Path(folder, name) for name in names if name.endswith(".py"))
    return sorted(found)


def load_corpus(
    paths: Sequence[Path | str] | None = None,
    *,
    val_fraction: float = 0.05,
    max_bytes: int = 8_000_000,
    seed: int = 0,
) -> Corpus:
    """Read `paths` (files, or folders walked recursively; None = `default_corpus_paths()`) into a Corpus.

    Files that are not UTF-8 text or contain NUL bytes are skipped inside folders and rejected when named
    directly; empty files and hidden names (".git", ...) inside folders are skipped; `*.jsonl` files
    contribute the "text" field of each line. Identical contents count once. Files are taken in the order of
    their content hash (salted with `seed`) until `max_bytes` are read, so the subset is a fair sample; a file
    goes to val when that hash falls in the lowest `val_fraction` of its range. The result depends only on
    the files' contents, not on where they live. Raises ValueError for missing paths or a too-small result.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if paths is None:
        files = default_corpus_paths()
        named: set[Path] = set()
        source = f"the Python standard library at {sysconfig.get_paths()['stdlib']}"
    else:
        files, named = _expand(paths)
        source = ", ".join(str(p) for p in paths)

    keys: dict[str, Path] = {}  # salted content hash -> first file with that content
    for path in files:
        text = _read_text(path, path in named)
        if text:
            digest = hashlib.sha256(text).hexdigest()
            keys.setdefault(hashlib.sha256(f"{seed}:{digest}".encode()).hexdigest(), path)

    splits: dict[bool, list[bytes]] = {False: [], True: []}
    total = 0
    for key in sorted(keys):
        if total >= max_bytes:
            break
        text = _read_text(keys[key], True)
        splits[int(key[:8], 16) % 10_000 < val_fraction * 10_000].append(text)
        total += len(text)

    train, val = (np.frombuffer(SEPARATOR.join(splits[v]), dtype=np.uint8).copy() for v in (False, True))
    if min(len(train), len(val)) < MIN_SPLIT_BYTES:
        raise ValueError(
            f"corpus from {source} is too small: train has {len(train)} bytes and val {len(val)} bytes "
            f"from {len(splits[False]) + len(splits[True])} distinct text files; each needs at least "
            f"{MIN_SPLIT_BYTES}. The split is by file: give more files or a larger val_fraction "
            f"(now {val_fraction})."
        )
    return Corpus(train=train, val=val, num_files=len(splits[False]) + len(splits[True]), source=source)


def _expand(paths: Sequence[Path | str]) -> tuple[list[Path], set[Path]]:
    """All files under `paths`, and the set of files named directly."""
    files: list[Path] = []
    named: set[Path] = set()
    for given in paths:
        path = Path(given)
        if path.is_dir():
            files.extend(_walk(path))
        elif path.is_file():
            files.append(path)
            named.add(path)
        else:
            raise ValueError(f"corpus path does not exist or is not a file or folder: {given}")
    return files, named


def _walk(folder: Path) -> Iterator[Path]:
    for parent, subfolders, names in os.walk(folder):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        yield from (Path(parent, name) for name in sorted(names) if not name.startswith("."))


def _read_text(path: Path, required: bool) -> bytes | None:
    """The UTF-8 text `path` contributes, or None when it is not text (a ValueError instead if `required`)."""
    data = path.read_bytes()
    try:
        if b"\0" in data:
            raise ValueError("contains NUL bytes")
        text = data.decode("utf-8")
    except ValueError as e:  # UnicodeDecodeError is a ValueError
        if required:
            raise ValueError(f"corpus file is not UTF-8 text: {path} ({e})") from None
        return None
    if path.suffix != ".jsonl":
        return data
    records = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)["text"]
        except (ValueError, TypeError, KeyError):
            record = None
        if not isinstance(record, str):
            raise ValueError(f"{path}:{number}: expected a JSON object with a string field \"text\"")
        records.append(record.encode("utf-8"))
    return SEPARATOR.join(records)
