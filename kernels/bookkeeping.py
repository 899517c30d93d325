"""Flag and counter updates as custom ops: the only writes to a state besides the stash kernels.

These are a handful of integers per MoE call, so they are plain torch (no Triton kernel): what
matters is that they run on the device without a host read and that the mutation is declared
to torch (``mutates_args``), like every other write into a state.
"""

from __future__ import annotations

import torch


def raise_flags_reference(flags: torch.Tensor, raised: torch.Tensor) -> None:
    """``flags = max(flags, raised)`` elementwise: flags are sticky."""
    torch.maximum(flags, raised.to(flags.dtype), out=flags)


@torch.library.custom_op("pagedstash_func::raise_flags", mutates_args=("flags",))
def raise_flags(flags: torch.Tensor, raised: torch.Tensor) -> None:
    """Set the flags whose entry in ``raised`` (same length, any int/bool dtype) is non-zero."""
    raise_flags_reference(flags, raised)


@raise_flags.register_fake
def _(flags, raised):
    return None


@torch.library.custom_op("pagedstash_func::add_counts", mutates_args=("counts",))
def add_counts(counts: torch.Tensor, delta: torch.Tensor) -> None:
    """``counts += delta`` (int64 routing statistics; integer sums are order-independent)."""
    counts.add_(delta.to(counts.dtype))


@add_counts.register_fake
def _(counts, delta):
    return None
