"""torch sends float unary ops on the CPU (sqrt, exp, log, erf, tanh, ...) to MKL's vector math library,
which picks each function's kernel on its first call. When threads make that first call at the same
time, one of them can run a low-accuracy kernel for it (pytorch/pytorch#188792): a thread's first
`sqrt` of a float32 came out 1.75e-4 too large, relative, in about one fresh process in 3000 here,
once as a NoLoCo test's spread. Replicas that must stay bit-identical, and the stages of a pipeline
serving several microbatches at once, start threads that compute; `resolve_kernels()` makes those
first calls once, on one thread, before they do."""

from __future__ import annotations

import functools

import torch

# the ops torch 2.x computes with MKL's VML (ATen/cpu/vml.h), each with a kernel per dtype
MKL_UNARY_OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2",
                 "sin", "sqrt", "tan", "tanh", "trunc")


@functools.cache
def resolve_kernels() -> None:
    """Call each of `MKL_UNARY_OPS` once in float32 and float64, on this thread (once per process)."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((8,), 0.5, dtype=dtype)
        for name in MKL_UNARY_OPS:
            getattr(torch, name)(x)
