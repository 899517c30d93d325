"""Stash copy: move the valid rows of a capacity-padded buffer into pages of a pool.

Two launches. The reserve (`_pagestack.reserve_pages_triton`, the kernel of `stash_reserve`)
takes the pages in one program: plan, page table, cursors, flags. Then a page writer copies
each row into the page the table names. The writer reads only the table and the source and
writes only the pool, so none of its programs waits for another or counts in a shared
counter; that is what lets it move small tiles, which stream at ``copy_``'s speed on the H200
(32 KiB tiles lose 3-6 points). Where programmatic dependent launch is available (`use_pdl`:
compute capability 9.0 and later) the writer starts while the reserve runs, loads its first
tile of the source and waits only for the table: that hides part of the second launch, which
shows on small copies (on the H200, about 2 points of ``copy_``'s bandwidth at 8192 rows of
2048; `bench stash --floor` shows what the two launches reach without the table).

Order as in the Triton tutorials: the pure-torch twin, the kernel, the launcher, then the
``torch.library`` op. Bytes moved: ``n * W * itemsize`` read and the same written (plus a few
page ids); the padded tail ``capacity - n`` is never touched, which is the point.
"""

from __future__ import annotations

import torch

from ._triton import gdc_wait, triton, tl
from . import _layout as L
from ._backend import resolve_backend
from ._launch import choose_launch, use_pdl
from ._pagestack import (
    check_pool_args, check_table, grid_size, load_count_k, pool_tile, reserve_pages_triton,
    take_pages_reference, write_held_rows_reference,
)


# ----------------------------------------------------------------------------- torch twin


def stash_copy_reference(src: torch.Tensor, n_rows: torch.Tensor, table: torch.Tensor,
                         cuda_pool: torch.Tensor, host_pool: torch.Tensor,
                         free_pages: torch.Tensor, cursors: torch.Tensor, flags: torch.Tensor,
                         page_size: int) -> None:
    """Pure-torch twin of the stash kernel (same writes, bit for bit; reads ``n_rows`` on the host).

    The allocation is `take_pages_reference`'s (nothing is copied when it does not fit); then
    the first ``n`` rows of ``src`` go into the pages the table now holds.
    """
    take_pages_reference(n_rows, table, cuda_pool, free_pages, cursors, flags, src.shape[0],
                         page_size)
    write_held_rows_reference(src, table, cuda_pool, host_pool, page_size)


# ----------------------------------------------------------------------------- Triton kernel


@triton.jit
def full_tile_of_rows(n, j, c, page_size, width, BLOCK: tl.constexpr):
    """Whether tile ``c`` of page ``j`` lies wholly within the first ``n`` rows. The rows left
    on the page are clamped at 0 before the multiply: past ``n`` they are negative, and times
    a wide row (a capacity of 2^31 elements or more) an int32 product wraps to a positive."""
    return tl.maximum(tl.minimum(page_size, n - j * page_size), 0) * width - c * BLOCK >= BLOCK


@triton.jit
def _write_pages_kernel(
    src_ptr, n_ptr, table_ptr, cuda_ptr, host_ptr, capacity, width, page_elems, cuda_pages,
    page_size, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    # The table is written by the reserve launch before this one: its rows (-1 after an
    # overflow: nothing to write) and its page ids. Nothing here writes what any program
    # reads, so programs run and retire independently.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # A page of rows is contiguous both in the source and in the pool, so tiles are flat runs of
    # BLOCK elements inside one page: full-width vector accesses whatever the row width.
    # `page_elems` comes in as an argument (not page_size * width computed here) so that Triton's
    # divisibility specialisation can prove page starts aligned and emit 16-byte accesses.
    chunks = tl.cdiv(page_elems, BLOCK)
    lanes = tl.arange(0, BLOCK)
    # With PDL this launch starts while the reserve runs, so the first tile of the source is
    # loaded before waiting for the table (the reserve does not write the source; the count
    # is read as the reserve reads it). Only a full tile: a uniform mask keeps the load
    # vectorised, and a partial first tile (rare) is loaded again below.
    n = load_count_k(n_ptr, capacity)
    j0 = pid // chunks
    c0 = pid - j0 * chunks
    ahead = full_tile_of_rows(n, j0, c0, page_size, width, BLOCK)
    first = tl.load(src_ptr + j0.to(tl.int64) * page_elems + c0 * BLOCK + lanes,
                    mask=lanes < tl.where(ahead, BLOCK, 0))
    if PDL:
        gdc_wait()
    rows = tl.load(table_ptr + L.ROWS_K)
    total = tl.where(rows > 0, (rows + page_size - 1) // page_size, 0) * chunks
    for t in range(pid, total, nprog):
        j = t // chunks
        c = t - j * chunks
        page = tl.load(table_ptr + L.HEADER_K + j).to(tl.int64)
        limit = tl.minimum(page_size, rows - j * page_size) * width - c * BLOCK
        src = src_ptr + j.to(tl.int64) * page_elems + c * BLOCK
        dst = pool_tile(cuda_ptr, host_ptr, page, cuda_pages, page_elems, c * BLOCK)
        if (t == pid) & ahead & (rows == n):    # the table's rows are the rows loaded ahead
            tl.store(dst + lanes, first)
        elif limit >= BLOCK:      # full tile: unmasked, so the accesses vectorise
            tl.store(dst + lanes, tl.load(src + lanes))
        else:
            mask = lanes < limit
            tl.store(dst + lanes, tl.load(src + lanes, mask=mask), mask=mask)


# ----------------------------------------------------------------------------- launcher


def stash_copy_triton(src, n_rows, table, cuda_pool, host_pool, free_pages, cursors, flags,
                      page_size: int, block: int = 0, programs: int = 0,
                      warps: int = 0, expected_rows: int = 0) -> None:
    """Reserve the pages, then launch the page writer; ``block``/``programs``/``warps``
    override the writer's launch, whose grid is sized for ``expected_rows`` (`grid_size`).
    Where `use_pdl` holds, the writer starts while the reserve runs."""
    capacity, width = src.shape
    pdl = use_pdl(src.device)
    reserve_pages_triton(n_rows, table, cuda_pool, free_pages, cursors, flags, capacity,
                         page_size, pdl)
    launch = choose_launch(src.device, width, src.element_size(), page_size, block, programs,
                           warps, kernel="stash")
    grid = (grid_size(capacity, width, page_size, launch.block, launch.programs,
                      expected_rows),)
    # Nothing may come between the two launches: PDL pairs the writer with the launch just
    # before it on the stream.
    _write_pages_kernel[grid](
        src, n_rows, table, cuda_pool, host_pool, capacity, width, page_size * width,
        cuda_pool.shape[0] // page_size, page_size,
        BLOCK=launch.block, PDL=pdl, num_warps=launch.num_warps, launch_pdl=pdl,
    )


# ----------------------------------------------------------------------------- torch.library op


@torch.library.custom_op(
    "pagedstash_func::stash_copy",
    mutates_args=("table", "cuda_pool", "host_pool", "free_pages", "cursors", "flags"))
def stash_copy(src: torch.Tensor, n_rows: torch.Tensor, table: torch.Tensor,
               cuda_pool: torch.Tensor, host_pool: torch.Tensor, free_pages: torch.Tensor,
               cursors: torch.Tensor, flags: torch.Tensor, page_size: int,
               backend: str = "auto", block: int = 0, programs: int = 0,
               warps: int = 0, expected_rows: int = 0) -> None:
    """Copy the first ``n_rows`` rows of ``src [capacity, W]`` into free pages of a pool.

    ``n_rows`` is a one-element int tensor on the device (never read on the host by the Triton
    backend). The table must hold nothing (fresh, popped or released): stashing over held pages
    loses them (`psf.validate_state` reports them lost). Mutates the page ``table``, the pools,
    the free lists, the cursors and ``flags``. ``expected_rows`` (a host hint, e.g. the spec's
    ``balanced_rows``; 0 for the capacity) sizes the grid and never changes what is written.
    """
    check_pool_args(src, cuda_pool, host_pool, free_pages, cursors, page_size, flags, n_rows)
    check_table(table, src.shape[0], page_size, cuda_pool.device)
    if resolve_backend(backend, src.device) == "torch":
        stash_copy_reference(src, n_rows, table, cuda_pool, host_pool, free_pages, cursors,
                             flags, page_size)
    else:
        stash_copy_triton(src, n_rows, table, cuda_pool, host_pool, free_pages, cursors, flags,
                          page_size, block, programs, warps, expected_rows)


@stash_copy.register_fake
def _(src, n_rows, table, cuda_pool, host_pool, free_pages, cursors, flags, page_size,
      backend="auto", block=0, programs=0, warps=0, expected_rows=0):
    return None
