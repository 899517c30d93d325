"""Which implementation of a kernel op runs: the Triton kernel or its pure-torch twin."""

from __future__ import annotations

import os

import torch

from ._triton import AVAILABLE, MISSING

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` means Triton on CUDA and the torch twin on the CPU (and everywhere when
    Triton is not installed: it has wheels for Linux only).

    ``"triton"`` on CPU tensors needs the Triton interpreter (``TRITON_INTERPRET=1`` set before
    the kernels are imported), which is how the tests hold every kernel to its twin on a CPU.
    """
    if backend == "auto":
        return "triton" if device.type == "cuda" and AVAILABLE else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and not AVAILABLE:
        raise ValueError(f"backend='triton': {MISSING}")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' on CPU tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before pagedstash_func is imported, or use backend='torch'.")
    return backend
