"""The imperative core of pagedstash_func: Triton kernels, their torch twins, launch sizes.

Installed as ``pagedstash_func.kernels`` (never as a bare top-level ``kernels``, a name that
belongs to another package). Each entry point is a ``torch.library`` custom op that names what
it mutates; ``backend="auto"`` runs Triton on CUDA and the torch twin on the CPU.
"""

from . import _layout as layout
from ._launch import Launch, choose_launch
from .bookkeeping import add_counts, raise_flags
from .stash_copy import stash_copy, stash_copy_reference, stash_copy_triton
from .stash_pop import stash_pop, stash_pop_reference, stash_pop_triton

__all__ = [
    "Launch", "add_counts", "choose_launch", "layout", "raise_flags",
    "stash_copy", "stash_copy_reference", "stash_copy_triton",
    "stash_pop", "stash_pop_reference", "stash_pop_triton",
]
