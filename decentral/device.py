"""Which torch device a worker trains on, from the recipe's `train.device`, and the collective backend
its island's ranks use (`island.backend`)."""

from __future__ import annotations

import torch


class DeviceError(ValueError):
    """The recipe names a device that is malformed or not on this machine."""


def pick_device(spec: str, slot: int = 0) -> torch.device:
    """The device named by `spec`: "cpu", "cuda", "cuda:N", or "auto".

    "auto" is CUDA when it is available, else the CPU. "auto" and a bare "cuda" put worker `slot`
    (an island's rank, a local worker's index) on GPU `slot % device_count`, so the ranks of one
    machine spread over its GPUs. Raises DeviceError for a malformed name or a GPU that is not there.
    """
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise DeviceError(f"train.device {spec!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise DeviceError(f"train.device {spec!r}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        raise DeviceError(f"train.device {spec!r} asks for CUDA, but torch sees no GPU here (torch {torch.__version__})")
    count = torch.cuda.device_count()
    index = slot % count if device.index is None else device.index
    if index >= count:
        raise DeviceError(f"train.device {spec!r}: this machine has {count} GPU(s)")
    return torch.device("cuda", index)


def island_backend(choice: str, device: torch.device, local_ranks: int) -> str:
    """The torch.distributed backend of an island whose rank trains on `device`, with `local_ranks` of its
    ranks on this machine: `choice`, or for "auto" NCCL when each of those ranks has a GPU of its own and
    gloo otherwise (the CPU, or ranks sharing a GPU: NCCL refuses two ranks on one GPU, gloo all-reduces
    CUDA tensors through host memory). DeviceError when NCCL is asked for where it cannot run."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    own_gpus = gpus >= local_ranks
    if choice == "auto":
        return "nccl" if own_gpus else "gloo"
    if choice == "nccl" and not own_gpus:
        where = "on the CPU" if gpus == 0 else f"{local_ranks} ranks on this machine's {gpus} GPU(s)"
        raise DeviceError(f"island.backend nccl needs a GPU per rank, and the island trains {where}: use gloo or "
                          "auto (train.device picks where it trains)")
    return choice
