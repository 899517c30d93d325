"""The `_layout` offsets as Triton constexprs, for use inside both kernels."""

import triton.language as tl

from . import _layout

OVERFLOW = tl.constexpr(_layout.FLAG_OVERFLOW)
HOST_SPILL = tl.constexpr(_layout.FLAG_HOST_SPILL)
CUDA_FREE = tl.constexpr(_layout.CUR_CUDA_FREE)
HOST_FREE = tl.constexpr(_layout.CUR_HOST_FREE)
TICKET = tl.constexpr(_layout.CUR_TICKET)
ROWS = tl.constexpr(_layout.TAB_ROWS)
PAGES = tl.constexpr(_layout.TAB_PAGES)
CUDA_PAGES = tl.constexpr(_layout.TAB_CUDA_PAGES)
HEADER = tl.constexpr(_layout.HEADER)
