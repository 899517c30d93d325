"""The imperative core of pagedstash_func: Triton kernels, their torch twins, launch sizes.

Each entry point is a ``torch.library`` custom op that names what it mutates;
``backend="auto"`` runs Triton on CUDA and the torch twin on the CPU.

``help()`` on a custom op shows torch's wrapper; each op's own docstring (arguments, shapes,
what it mutates) is in its file here, and at ``op._init_fn.__doc__``.
"""

from . import _layout as layout
from ._backend import BACKENDS, resolve_backend
from .cross_entropy import (
    cross_entropy_rows, cross_entropy_rows_reference, cross_entropy_rows_triton,
)
from ._launch import ONE_PER_TILE, PDL_OFF_ENV, Launch, choose_launch, use_pdl
from .gather_rows import gather_rows, gather_rows_reference, gather_rows_triton
from .gather_sum import gather_sum, gather_sum_reference, gather_sum_triton
from ._pagestack import grid_size
from .launch_floor import FLOOR_SHAPES, floor_copy_reference, floor_copy_triton
from .rms_norm import (
    rms_norm_backward, rms_norm_backward_reference, rms_norm_backward_triton,
    rms_norm_forward, rms_norm_forward_reference, rms_norm_forward_triton,
)
from .stash_copy import stash_copy, stash_copy_reference, stash_copy_triton
from .stash_pop import (
    stash_pop, stash_pop_reference, stash_pop_triton, stash_release, stash_release_reference,
)
from .stash_reserve import stash_reserve, stash_reserve_reference
from .swiglu import (
    swiglu_backward, swiglu_backward_paged, swiglu_backward_paged_reference,
    swiglu_backward_reference, swiglu_backward_triton, swiglu_forward, swiglu_forward_reference,
    swiglu_forward_stash, swiglu_forward_stash_reference, swiglu_forward_triton,
)

__all__ = [
    "BACKENDS", "Launch", "ONE_PER_TILE", "choose_launch", "grid_size", "layout",
    "resolve_backend",
    "PDL_OFF_ENV", "use_pdl", "stash_copy", "stash_copy_reference", "stash_copy_triton",
    "stash_pop", "stash_pop_reference", "stash_pop_triton", "stash_release",
    "stash_release_reference", "gather_sum", "gather_sum_reference", "gather_sum_triton",
    "gather_rows", "gather_rows_reference", "gather_rows_triton",
    "FLOOR_SHAPES", "floor_copy_reference", "floor_copy_triton",
    "stash_reserve", "stash_reserve_reference",
    "swiglu_backward", "swiglu_backward_paged", "swiglu_backward_paged_reference",
    "swiglu_backward_reference", "swiglu_backward_triton", "swiglu_forward",
    "swiglu_forward_reference", "swiglu_forward_stash", "swiglu_forward_stash_reference",
    "swiglu_forward_triton",
    "rms_norm_backward", "rms_norm_backward_reference", "rms_norm_backward_triton",
    "rms_norm_forward", "rms_norm_forward_reference", "rms_norm_forward_triton",
    "cross_entropy_rows", "cross_entropy_rows_reference", "cross_entropy_rows_triton",
]
