"""Stash reserve: take the pages for ``n`` rows off the free stacks without copying anything.

For a producer that writes its rows into pages itself (`swiglu.swiglu_forward_stash` writes
the ``gate_up`` rows it reads), so the rows are read once instead of twice. The allocation is
exactly the stash copy's (`_pagestack.plan_allocation`): the same pages in the same table
slots, the same cursors and flags; only the copy is left to the producer, which finds each
row's page at ``table[HEADER + row // page_size]``.

One program: a thousand page ids or so (65536 rows in pages of 64), so no ticket is needed
and the launch costs what any launch costs. Order as in the Triton tutorials: twin, kernel,
launcher, op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _layout as L
from ._backend import resolve_backend
from ._pagestack import (
    IDS_BLOCK, check_pool_args, check_table, load_cursors, plan_allocation, taken_slot,
    taken_slot_k,
)

# ----------------------------------------------------------------------------- torch twins


def stash_reserve_reference(n_rows: torch.Tensor, table: torch.Tensor, cuda_pool: torch.Tensor,
                            free_pages: torch.Tensor, cursors: torch.Tensor, flags: torch.Tensor,
                            capacity: int, page_size: int) -> None:
    """Pure-torch twin of the reserve kernel: `stash_copy_reference`'s bookkeeping alone."""
    cuda_pages = cuda_pool.shape[0] // page_size
    ctop, htop = int(cursors[L.CUR_CUDA_FREE]), int(cursors[L.CUR_HOST_FREE])
    n, pages, from_cuda, from_host, fits = plan_allocation(
        int(n_rows.reshape(-1)[0]), capacity, page_size, ctop, htop,
        bool(flags[L.FLAG_OVERFLOW] != 0))
    if not fits:
        table[L.TAB_ROWS], table[L.TAB_PAGES], table[L.TAB_CUDA_PAGES] = L.NOTHING_HELD, 0, 0
        flags[L.FLAG_OVERFLOW] = 1
        return
    for j in range(pages):
        table[L.HEADER + j] = free_pages[taken_slot(j, from_cuda, ctop, cuda_pages, htop)]
    table[L.TAB_ROWS], table[L.TAB_PAGES], table[L.TAB_CUDA_PAGES] = n, pages, from_cuda
    cursors[L.CUR_CUDA_FREE] = ctop - from_cuda
    cursors[L.CUR_HOST_FREE] = htop - from_host
    if from_host > 0:
        flags[L.FLAG_HOST_SPILL] = 1


# ----------------------------------------------------------------------------- Triton kernel


@triton.jit
def _stash_reserve_kernel(
    n_ptr, table_ptr, free_ptr, cur_ptr, flag_ptr, capacity, cuda_pages, page_size,
    IDS_BLOCK: tl.constexpr,
):
    n = tl.minimum(tl.maximum(tl.load(n_ptr), 0), capacity).to(tl.int32)   # clamp, then narrow
    pages = (n + page_size - 1) // page_size
    ctop, htop = load_cursors(cur_ptr)
    overflowed = tl.load(flag_ptr + L.OVERFLOW_K) != 0
    from_cuda = tl.minimum(pages, ctop)
    from_host = pages - from_cuda
    fits = (from_host <= htop) & (overflowed == 0)
    ids_end = tl.where(fits, pages, 0)
    for b in range(0, ids_end, IDS_BLOCK):
        j = b + tl.arange(0, IDS_BLOCK)
        m = j < ids_end
        ids = tl.load(free_ptr + taken_slot_k(j, from_cuda, ctop, cuda_pages, htop), mask=m,
                      other=0)
        tl.store(table_ptr + L.HEADER_K + j, ids, mask=m)
    tl.store(table_ptr + L.ROWS_K, tl.where(fits, n, -1))
    tl.store(table_ptr + L.PAGES_K, tl.where(fits, pages, 0))
    tl.store(table_ptr + L.CUDA_PAGES_K, tl.where(fits, from_cuda, 0))
    tl.store(cur_ptr + L.CUDA_FREE_K, tl.where(fits, ctop - from_cuda, ctop))
    tl.store(cur_ptr + L.HOST_FREE_K, tl.where(fits, htop - from_host, htop))
    if fits:
        if from_host > 0:
            tl.store(flag_ptr + L.HOST_SPILL_K, 1)
    else:
        tl.store(flag_ptr + L.OVERFLOW_K, 1)


# ----------------------------------------------------------------------------- launcher


def stash_reserve_triton(n_rows, table, cuda_pool, free_pages, cursors, flags, capacity: int,
                         page_size: int) -> None:
    """Launch the reserve kernel: one program of one warp."""
    _stash_reserve_kernel[(1,)](
        n_rows, table, free_pages, cursors, flags, capacity, cuda_pool.shape[0] // page_size,
        page_size, IDS_BLOCK=IDS_BLOCK, num_warps=1,
    )


# ----------------------------------------------------------------------------- torch.library op


@torch.library.custom_op(
    "pagedstash_func::stash_reserve",
    mutates_args=("table", "cursors", "flags"))
def stash_reserve(n_rows: torch.Tensor, table: torch.Tensor, cuda_pool: torch.Tensor,
                  host_pool: torch.Tensor, free_pages: torch.Tensor, cursors: torch.Tensor,
                  flags: torch.Tensor, capacity: int, page_size: int,
                  backend: str = "auto") -> None:
    """Take the pages for the first ``n_rows`` of ``capacity`` rows; the rows are not copied.

    The table must hold nothing (fresh, popped or released): reserving over held pages loses
    them, as `stash_copy` would (`psf.validate_state` then reports them lost). Afterwards the
    table holds the pages exactly as `stash_copy` of a ``[capacity, W]`` source would have
    left it (or says ``-1`` rows and the overflow flag is set); the producer then
    writes the rows (`swiglu_forward_stash`), and the pages come back with
    `stash_release` or a pop. ``n_rows`` is a one-element int tensor on the device, never read
    on the host by the Triton backend. Mutates ``table``, ``cursors`` and ``flags``.
    """
    check_pool_args(None, cuda_pool, host_pool, free_pages, cursors, page_size, flags, n_rows)
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    check_table(table, capacity, page_size, cuda_pool.device)
    if resolve_backend(backend, cuda_pool.device) == "torch":
        stash_reserve_reference(n_rows, table, cuda_pool, free_pages, cursors, flags, capacity,
                                page_size)
    else:
        stash_reserve_triton(n_rows, table, cuda_pool, free_pages, cursors, flags, capacity,
                             page_size)


@stash_reserve.register_fake
def _(n_rows, table, cuda_pool, host_pool, free_pages, cursors, flags, capacity, page_size,
      backend="auto"):
    return None
