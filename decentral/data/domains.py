"""Named text domains, each split by file into train, dev and test.

A domain is `NAME` (one of `BUILTIN_DOMAINS`: text that exists on every Debian-like machine with
Python, so experiments need no download) or `NAME=PATH[,PATH...]` (files or folders of your own).
Branch-train-merge trains one expert per domain on `train`, estimates the ensemble's domain prior
on `dev` and reports perplexity on `test`; the seed model trains on all domains with balanced batches.
"""

from __future__ import annotations

import glob
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from decentral.data.batches import Batch, eval_batches
from decentral.data.corpus import MIN_SPLIT_BYTES, DataError, default_corpus_paths, join_documents, load_documents


def _existing(patterns: Sequence[str]) -> list[Path]:
    return sorted(Path(p) for pattern in patterns for p in glob.glob(pattern) if Path(p).is_file() or Path(p).is_dir())


# name -> (what it is, where it lives, a function listing its files and folders)
BUILTIN_DOMAINS: dict[str, tuple[str, str, Callable[[], list[Path]]]] = {
    "code": ("Python source code", "the Python standard library", default_corpus_paths),
    "legal": ("license texts", "/usr/share/common-licenses, /usr/share/doc/*/copyright",
              lambda: _existing(["/usr/share/common-licenses", "/usr/share/doc/*/copyright"])),
    "manuals": ("manual pages (troff source)", "/usr/share/man/man[1-8]",
                lambda: _existing(["/usr/share/man/man[1-8]"])),
    "headers": ("C headers", "/usr/include", lambda: _existing(["/usr/include"])),
    "changelogs": ("Debian package changelogs", "/usr/share/doc/*/changelog*.gz",
                   lambda: _existing(["/usr/share/doc/*/changelog*.gz"])),
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass
class Domain:
    """uint8 token streams of one domain; the three splits come from disjoint sets of files."""

    name: str
    train: np.ndarray
    dev: np.ndarray
    test: np.ndarray
    num_files: int
    source: str

    def eval_batches(self, split: str, *, batch_size: int, context: int, num_batches: int,
                     device: torch.device | str = "cpu") -> list[Batch]:
        """Fixed batches spread evenly over `split` ("dev" or "test")."""
        return eval_batches(getattr(self, split), batch_size=batch_size, context=context,
                            num_batches=num_batches, device=device)


def parse_domain(spec: str) -> tuple[str, list[str] | None]:
    """`NAME` -> (NAME, None) for a built-in domain; `NAME=PATH[,PATH...]` -> (NAME, paths).

    Raises DataError with the list of built-in names for anything else."""
    name, sep, paths = spec.partition("=")
    name = name.strip()
    if not _NAME.match(name):
        raise DataError(f"domain {spec!r}: the name must be letters, digits, '.', '_' or '-' (NAME or NAME=PATH)")
    if sep:
        given = [p for p in paths.split(",") if p]
        if not given:
            raise DataError(f"domain {spec!r}: no path after '='")
        return name, given
    if name not in BUILTIN_DOMAINS:
        raise DataError(f"unknown domain {name!r}: built-in ones are {sorted(BUILTIN_DOMAINS)}; "
                         f"for your own text write NAME=PATH[,PATH...]")
    return name, None


def load_domain(spec: str, *, max_bytes: int = 8_000_000, seed: int = 0, dev_fraction: float = 0.05,
                test_fraction: float = 0.05) -> Domain:
    """Read domain `spec` (see `parse_domain`): documents are taken as `load_documents` takes them; a
    document goes to dev when its split point is below `dev_fraction`, to test below
    `dev_fraction + test_fraction`, else to train. Raises DataError when a split is too small."""
    if dev_fraction <= 0 or test_fraction <= 0 or dev_fraction + test_fraction >= 1:
        raise ValueError(f"dev_fraction and test_fraction must be positive with a sum below 1, "
                         f"got {dev_fraction} and {test_fraction}")
    name, paths = parse_domain(spec)
    if paths is None:
        _, where, list_paths = BUILTIN_DOMAINS[name]
        found = list_paths()
        if not found:
            raise DataError(f"built-in domain {name!r} has no files on this machine (looked in {where}); "
                             f"give it as {name}=PATH")
        documents, source = load_documents(found, max_bytes=max_bytes, seed=seed, strict=False)
        source = where
    else:
        documents, source = load_documents(paths, max_bytes=max_bytes, seed=seed)
    bounds = (dev_fraction, dev_fraction + test_fraction)
    splits = {
        "dev": [d for d in documents if d.split_point() < bounds[0]],
        "test": [d for d in documents if bounds[0] <= d.split_point() < bounds[1]],
        "train": [d for d in documents if d.split_point() >= bounds[1]],
    }
    streams = {split: join_documents(docs) for split, docs in splits.items()}
    small = {split: len(s) for split, s in streams.items() if len(s) < MIN_SPLIT_BYTES}
    if small:
        raise DataError(
            f"domain {name!r} from {source} is too small: {small} bytes in its splits, each needs at least "
            f"{MIN_SPLIT_BYTES} ({len(documents)} distinct files; the split is by file: give more files)"
        )
    return Domain(name, streams["train"], streams["dev"], streams["test"], len(documents), source)


def load_domains(specs: Sequence[str], **kwargs) -> list[Domain]:
    """`load_domain` for each spec; names must be distinct."""
    domains = [load_domain(spec, **kwargs) for spec in specs]
    names = [d.name for d in domains]
    if len(set(names)) != len(names):
        raise DataError(f"domain names must be distinct, got {names}")
    return domains


def balanced_eval_batches(domains: Sequence[Domain], split: str, *, batch_size: int, context: int,
                          num_batches: int, device: torch.device | str = "cpu") -> list[Batch]:
    """ceil(num_batches / n) batches from each domain's `split`, so every domain weighs the same."""
    each = max(1, math.ceil(num_batches / len(domains)))
    return [b for d in domains for b in d.eval_batches(split, batch_size=batch_size, context=context,
                                                       num_batches=each, device=device)]
