"""Which torch device a worker trains on, from the recipe's `train.device`."""

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
