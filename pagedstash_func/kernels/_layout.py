"""Shared layout of the buffers the stash kernels read and write.

Everything here is plain integers (and the same integers as Triton constexprs, for use inside
kernels): the kernels, their torch twins and the functional layer agree on these offsets, so
there is one place to read them.

A *pool* of one (dtype, row width) is five tensors:

- ``cuda_pool``  ``[cuda_pages * page_size, W]`` on the compute device.
- ``host_pool``  ``[host_pages * page_size, W]`` in pinned host memory (on a CPU run, another CPU
  tensor); with no host tier, a one-row placeholder on the device, so every launch has a valid
  pointer.
- ``free_pages`` ``[cuda_pages + host_pages]`` int32, two stacks side by side: CUDA page ids in
  ``[0, cuda_pages)``, host page ids in ``[cuda_pages, cuda_pages + host_pages)``. A page id below
  ``cuda_pages`` lives in the CUDA pool, the rest in the host pool at ``id - cuda_pages``.
- ``cursors``    ``[4]`` int32: free CUDA pages, free host pages and two spare slots (always 0;
  the first held the pop's launch ticket while the pop was one launch).
- ``flags``      ``[4]`` int32, shared by all pools of a state; sticky once set.

A *page table* of one stashed tensor is ``[HEADER + max_pages]`` int32: the rows stashed (``-1``
when nothing is held, after an overflow or a pop), the pages held, how many of them are CUDA
pages (always the first ones), a spare slot, then the page ids in row order.
"""

from ._triton import tl

CUR_CUDA_FREE = 0
CUR_HOST_FREE = 1

FLAG_OVERFLOW = 0
FLAG_HOST_SPILL = 1
FLAG_OVER_BUDGET = 2
FLAG_BAD_ID = 3
NUM_FLAGS = 4
FLAG_NAMES = ("overflow", "host_spill", "over_budget", "bad_id")

TAB_ROWS = 0
TAB_PAGES = 1
TAB_CUDA_PAGES = 2
HEADER = 4

NOTHING_HELD = -1


def table_size(capacity: int, page_size: int) -> int:
    """Length of the page table of a tensor with ``capacity`` rows."""
    return HEADER + -(-capacity // page_size)


# The offsets above as Triton constexprs, for use inside ``@triton.jit`` kernels (a kernel may
# read only constexpr globals).
OVERFLOW_K = tl.constexpr(FLAG_OVERFLOW)
HOST_SPILL_K = tl.constexpr(FLAG_HOST_SPILL)
CUDA_FREE_K = tl.constexpr(CUR_CUDA_FREE)
HOST_FREE_K = tl.constexpr(CUR_HOST_FREE)
ROWS_K = tl.constexpr(TAB_ROWS)
PAGES_K = tl.constexpr(TAB_PAGES)
CUDA_PAGES_K = tl.constexpr(TAB_CUDA_PAGES)
HEADER_K = tl.constexpr(HEADER)
