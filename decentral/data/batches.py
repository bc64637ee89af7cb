"""Batches of next-token windows from a token stream, and a loss evaluator."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from decentral.data.corpus import DataError

Batch = tuple[torch.Tensor, torch.Tensor]  # (x, y): int64 (batch_size, context), y is x shifted by one token


def shard_bounds(n_tokens: int, worker: int, num_workers: int) -> tuple[int, int]:
    """[start, end) of `worker`'s contiguous share of a stream of `n_tokens`; the shares tile the stream."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, got {num_workers}")
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker must be in [0, {num_workers}), got {worker}")
    return n_tokens * worker // num_workers, n_tokens * (worker + 1) // num_workers


def train_batches(
    tokens: np.ndarray | Sequence[np.ndarray], *, batch_size: int, context: int, worker: int = 0,
    num_workers: int = 1, seed: int = 0, device: torch.device | str = "cpu", skip: int = 0,
) -> Iterator[Batch]:
    """Endless random windows from `worker`'s shard only, on `device`; the sequence depends only on
    (tokens, seed, worker). `skip` starts it that many batches in (a resumed or late-joining worker
    goes on where the sequence was, not from its start).

    `tokens` may be a list of streams (domains): then every batch is domain-balanced, each stream giving
    batch_size // n rows and the remainder rows rotating over the streams from batch to batch, and each
    stream is sharded on its own.
    """
    streams = [tokens] if isinstance(tokens, np.ndarray) else list(tokens)
    if not streams:
        raise ValueError("train_batches needs at least one token stream")
    shards = []
    for index, stream in enumerate(streams):
        start, end = shard_bounds(len(stream), worker, num_workers)
        shards.append(stream[start:end])
        if end - start < context + 1:
            which = f"worker {worker}'s shard" + (f" of stream {index}" if len(streams) > 1 else "")
            raise DataError(
                f"{which} has {end - start} tokens, fewer than context + 1 = {context + 1}; "
                f"use more data, fewer workers or a shorter context"
            )
    rng = np.random.default_rng([seed, worker])
    n = len(shards)

    def starts(batch: int) -> list[np.ndarray]:
        return [rng.integers(0, len(shard) - context, size=batch_size // n + ((index - batch) % n < batch_size % n))
                for index, shard in enumerate(shards)]

    def batches() -> Iterator[Batch]:
        for batch in range(skip):
            starts(batch)
        for batch in itertools.count(skip):
            rows = [_windows(shard, where, context, device) for shard, where in zip(shards, starts(batch))]
            yield (rows[0] if n == 1 else tuple(torch.cat(part) for part in zip(*rows)))

    return batches()


def eval_starts(n_tokens: int, *, context: int, count: int, seed: int = 1234) -> np.ndarray:
    """Where `eval_batches`' `count` windows start: evenly spaced over the stream, `seed` picks the offset."""
    span = n_tokens - context  # number of valid window starts
    if span < 1:
        raise DataError(f"{n_tokens} tokens are fewer than context + 1 = {context + 1}")
    stride = span / count
    offset = np.random.default_rng(seed).uniform(0, stride)
    return np.minimum((offset + stride * np.arange(count)).astype(np.int64), span - 1)


def eval_batches(
    tokens: np.ndarray, *, batch_size: int, context: int, num_batches: int, seed: int = 1234,
    device: torch.device | str = "cpu",
) -> list[Batch]:
    """`num_batches` fixed batches of windows evenly spaced over `tokens`, on `device` (see `eval_starts`)."""
    starts = eval_starts(len(tokens), context=context, count=batch_size * num_batches, seed=seed)
    return [_windows(tokens, part, context, device) for part in starts.reshape(num_batches, batch_size)]


def evaluate(model: nn.Module, batches: Sequence[Batch]) -> float:
    """Mean loss of `model(x, y)` over `batches`, without gradients and in eval mode; the mode is restored."""
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return sum(float(model(x, y)[1]) for x, y in batches) / len(batches)
    finally:
        model.train(was_training)


def _windows(tokens: np.ndarray, starts: np.ndarray, context: int, device: torch.device | str) -> Batch:
    rows = torch.from_numpy(tokens[starts[:, None] + np.arange(context + 1)].astype(np.int64)).to(device)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
