"""Byte-level tokenizer: a token is one byte of the UTF-8 encoding."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class ByteTokenizer:
    """Text <-> uint8 token ids. Every string round-trips; undecodable bytes become U+FFFD."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        """UTF-8 bytes of `text` as a uint8 array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Inverse of `encode`; invalid UTF-8 sequences are replaced, never raised."""
        return np.asarray(ids, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")
