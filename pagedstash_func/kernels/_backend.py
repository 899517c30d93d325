"""Which implementation of a kernel op runs: the Triton kernel or its pure-torch twin."""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` means Triton on CUDA and the torch twin on the CPU.

    ``"triton"`` on CPU tensors needs the Triton interpreter (``TRITON_INTERPRET=1`` set before
    the kernels are imported), which is how the tests hold every kernel to its twin on a CPU.
    """
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' on CPU tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before pagedstash_func is imported, or use backend='torch'.")
    return backend
