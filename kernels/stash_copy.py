"""Stash copy: move the valid rows of a capacity-padded buffer into pages of a pool.

Order as in the Triton tutorials: the pure-torch twin, the kernel, the launcher, then the
``torch.library`` op. Bytes moved: ``n * W * itemsize`` read and the same written (plus a few
page ids); the padded tail ``capacity - n`` is never touched, which is the point.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import resolve_backend
from ._launch import choose_launch
from ._pagestack import (
    IDS_BLOCK, check_pool_args, check_table, grid_size, is_last_program, plan_k, pool_tile,
    publish_k, record_pages_k, reset_ticket, take_pages_reference, taken_slot_k,
    write_held_rows_reference,
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
def _page_of_tile(free_ptr, t, chunks, total, from_cuda, ctop, cuda_pages, htop):
    """Pool page id of tile ``t`` (as int64), read off the free stacks; 0 past the last tile."""
    slot = taken_slot_k(t // chunks, from_cuda, ctop, cuda_pages, htop)
    return tl.load(free_ptr + slot, mask=t < total, other=0).to(tl.int64)


@triton.jit
def _stash_copy_kernel(
    src_ptr, n_ptr, table_ptr, cuda_ptr, host_ptr, free_ptr, cur_ptr, flag_ptr,
    capacity, width, page_elems, cuda_pages, page_size,
    BLOCK: tl.constexpr, IDS_BLOCK: tl.constexpr,
):
    # Every program plans the same allocation from the cursors as they were at launch; only the
    # program that finishes last (by ticket) writes the new cursors and flags. One launch, no
    # host round trip.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n, pages, ctop, htop, from_cuda, from_host, fits = plan_k(n_ptr, cur_ptr, flag_ptr,
                                                              capacity, page_size)

    # A page of rows is contiguous both in the source and in the pool, so tiles are flat runs of
    # BLOCK elements inside one page: full-width vector accesses whatever the row width.
    # `page_elems` comes in as an argument (not page_size * width computed here) so that Triton's
    # divisibility specialisation can prove page starts aligned and emit 16-byte accesses.
    chunks = tl.cdiv(page_elems, BLOCK)
    total = tl.where(fits, pages * chunks, 0)
    lanes = tl.arange(0, BLOCK)
    # The page id of a tile is a dependent load before its data can move; fetch the next
    # tile's id one iteration ahead so that latency hides behind this tile's copy.
    next_page = _page_of_tile(free_ptr, pid, chunks, total, from_cuda, ctop, cuda_pages, htop)
    for t in range(pid, total, nprog):
        page = next_page
        next_page = _page_of_tile(free_ptr, t + nprog, chunks, total, from_cuda, ctop,
                                  cuda_pages, htop)
        j = t // chunks
        c = t - j * chunks
        limit = tl.minimum(page_size, n - j * page_size) * width - c * BLOCK
        src = src_ptr + j.to(tl.int64) * page_elems + c * BLOCK
        dst = pool_tile(cuda_ptr, host_ptr, page, cuda_pages, page_elems, c * BLOCK)
        if limit >= BLOCK:      # full tile: unmasked, so the accesses vectorise
            tl.store(dst + lanes, tl.load(src + lanes))
        else:
            mask = lanes < limit
            tl.store(dst + lanes, tl.load(src + lanes, mask=mask), mask=mask)

    if pid == 0:
        record_pages_k(table_ptr, free_ptr, n, pages, ctop, htop, from_cuda, cuda_pages, fits,
                       IDS_BLOCK)

    if is_last_program(cur_ptr):
        publish_k(cur_ptr, flag_ptr, ctop, htop, from_cuda, from_host, fits)
        reset_ticket(cur_ptr)


# ----------------------------------------------------------------------------- launcher


def stash_copy_triton(src, n_rows, table, cuda_pool, host_pool, free_pages, cursors, flags,
                      page_size: int, block: int = 0, programs: int = 0,
                      warps: int = 0, expected_rows: int = 0) -> None:
    """Launch the stash kernel once; ``block``/``programs``/``warps`` override the choice, the
    grid is sized for ``expected_rows`` (`grid_size`)."""
    capacity, width = src.shape
    launch = choose_launch(src.device, width, src.element_size(), page_size, block, programs,
                           warps)
    grid = (grid_size(capacity, width, page_size, launch.block, launch.programs,
                      expected_rows),)
    _stash_copy_kernel[grid](
        src, n_rows, table, cuda_pool, host_pool, free_pages, cursors, flags,
        capacity, width, page_size * width, cuda_pool.shape[0] // page_size, page_size,
        BLOCK=launch.block, IDS_BLOCK=IDS_BLOCK, num_warps=launch.num_warps,
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
