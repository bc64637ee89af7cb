"""Load text files as documents and byte-token streams, split into train and validation by file."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sysconfig
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SEPARATOR = b"\n\n"  # placed between files in a stream
MIN_SPLIT_BYTES = 4 * 1024  # the smallest train or val stream load_corpus accepts


class DataError(ValueError):
    """Training text is missing, unreadable or too small; the message says which and what to do."""


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


@dataclass
class Document:
    """One distinct text file's contribution to a corpus."""

    key: str  # sha256 of the content salted with the corpus seed: orders documents and picks their split
    text: bytes
    path: Path

    def split_point(self) -> float:
        """Where this document falls in [0, 1): uniform over documents, fixed by content and seed."""
        return int(self.key[:8], 16) % 10_000 / 10_000


def load_documents(
    paths: Sequence[Path | str] | None = None, *, max_bytes: int = 8_000_000, seed: int = 0, strict: bool = True
) -> tuple[list[Document], str]:
    """The distinct text documents under `paths` (files, or folders walked recursively; None =
    `default_corpus_paths()`), in the order of their content hash salted with `seed`, until `max_bytes`
    are taken; and a description of where they came from, for messages.

    Files that cannot be read (a dangling link), are not UTF-8 text or contain NUL bytes are skipped inside
    folders, and rejected when named directly unless `strict` is False; empty files and hidden names
    (".git", ...) inside folders are skipped; `*.gz` files are decompressed first; `*.jsonl` files
    contribute the "text" field of each line. Identical contents count once. The result depends only on
    the files' contents, not on where they live. Raises DataError for missing paths.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if paths is None:
        files = default_corpus_paths()
        named: set[Path] = set()
        source = f"the Python standard library at {sysconfig.get_paths()['stdlib']}"
    else:
        files, named = _expand(paths)
        source = ", ".join(str(p) for p in paths)
        if not strict:
            named = set()

    keys: dict[str, Path] = {}  # salted content hash -> first file with that content
    for path in files:
        text = _read_text(path, path in named)
        if text:
            digest = hashlib.sha256(text).hexdigest()
            keys.setdefault(hashlib.sha256(f"{seed}:{digest}".encode()).hexdigest(), path)

    documents: list[Document] = []
    total = 0
    for key in sorted(keys):
        if total >= max_bytes:
            break
        text = _read_text(keys[key], True)
        documents.append(Document(key, text, keys[key]))
        total += len(text)
    return documents, source


def join_documents(documents: Sequence[Document]) -> np.ndarray:
    """The token stream of `documents`, separated by SEPARATOR."""
    return np.frombuffer(SEPARATOR.join(d.text for d in documents), dtype=np.uint8).copy()


def load_corpus(
    paths: Sequence[Path | str] | None = None,
    *,
    val_fraction: float = 0.05,
    max_bytes: int = 8_000_000,
    seed: int = 0,
) -> Corpus:
    """Read `paths` into a Corpus (see `load_documents` for what is read and in which order).

    A document goes to val when its `split_point` falls below `val_fraction`, so the split is a fair
    sample and does not depend on where files live. Raises DataError for missing paths or a too-small
    result.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    documents, source = load_documents(paths, max_bytes=max_bytes, seed=seed)
    val_docs = [d for d in documents if d.split_point() < val_fraction]
    train_docs = [d for d in documents if d.split_point() >= val_fraction]
    train, val = join_documents(train_docs), join_documents(val_docs)
    if min(len(train), len(val)) < MIN_SPLIT_BYTES:
        raise DataError(
            f"corpus from {source} is too small: train has {len(train)} bytes and val {len(val)} bytes "
            f"from {len(documents)} distinct text files; each needs at least "
            f"{MIN_SPLIT_BYTES}. The split is by file: give more files or a larger val_fraction "
            f"(now {val_fraction})."
        )
    return Corpus(train=train, val=val, num_files=len(documents), source=source)


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
            raise DataError(f"corpus path does not exist or is not a file or folder: {given}")
    return files, named


def _walk(folder: Path) -> Iterator[Path]:
    for parent, subfolders, names in os.walk(folder):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        yield from (Path(parent, name) for name in sorted(names) if not name.startswith("."))


def _read_text(path: Path, required: bool) -> bytes | None:
    """The UTF-8 text `path` contributes, or None when it cannot be read (a dangling link, say) or is not
    text (a ValueError instead if `required`)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        if required:
            raise DataError(f"cannot read corpus file {path}: {e.strerror or e}") from None
        return None
    try:
        if path.suffix == ".gz":
            data = _gunzip(data)
        if b"\0" in data:
            raise ValueError("contains NUL bytes")
        text = data.decode("utf-8")
    except ValueError as e:  # UnicodeDecodeError is a ValueError
        if required:
            raise DataError(f"corpus file is not UTF-8 text: {path} ({e})") from None
        return None
    if path.suffix != ".jsonl" and path.suffixes[-2:] != [".jsonl", ".gz"]:
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
            raise DataError(f"{path}:{number}: expected a JSON object with a string field \"text\"")
        records.append(record.encode("utf-8"))
    return SEPARATOR.join(records)


def _gunzip(data: bytes) -> bytes:
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"not a valid gzip file ({e})") from None
