"""Stash pop: rebuild a capacity-padded buffer from its pages and give the pages back.

Two launches. A page reader copies each held row from its page into the output; then the
release (`_pagestack.release_pages_triton`, the kernel of `stash_release`, which gives pages
back without reading them: a stash whose backward never ran) pushes the page ids back, moves
the cursors and empties the table. The reader writes only the output, so none of its programs
waits for another, and it moves 4 KiB tiles. Where programmatic dependent launch is available
(`use_pdl`) the release starts while the reader runs, gives the ids back at once (the reader
never reads the free stacks or the cursors) and waits for the reader only to empty the header.

Order as in the Triton tutorials: the pure-torch twin, the kernel, the launcher, then the
``torch.library`` op. Bytes moved: ``n * W * itemsize`` read, ``capacity * W * itemsize``
written: the tail ``capacity - n`` is written as zeros in the same pass, because uninitialised
rows there would reach gradient reductions (a NaN in a dropped row poisons a weight gradient).
With ``zero_tail=False`` only the ``n`` rows are written, for a consumer that reads rows below
``n`` alone (the layer's backward, see `_experts._pop`).
"""

from __future__ import annotations

import torch

from ._triton import gdc_launch_dependents, triton, tl
from . import _layout as L
from ._backend import resolve_backend
from ._launch import choose_launch, use_pdl
from ._pagestack import (
    check_pool_args, check_table, grid_size, held_pages_k, pool_tile, release_pages_triton,
    returned_slot,
)

# ----------------------------------------------------------------------------- torch twin


def stash_pop_reference(table: torch.Tensor, cuda_pool: torch.Tensor, host_pool: torch.Tensor,
                        free_pages: torch.Tensor, cursors: torch.Tensor, capacity: int,
                        page_size: int, zero_tail: bool = True) -> torch.Tensor:
    """Pure-torch twin of the pop (reader, then release): returns ``[capacity, W]`` with rows
    ``>= n`` zero (with ``zero_tail=False`` they are left unwritten, unless nothing is held:
    then zeros).

    The pages are pushed back on their free stacks in the reverse of the order they were taken,
    so a stash followed by its pop leaves the free lists exactly as they were. The table is left
    saying ``-1`` rows: a second pop of the same table gives zeros and frees nothing.
    """
    width = cuda_pool.shape[1]
    held = int(table[L.TAB_ROWS]) >= 0
    make = torch.zeros if zero_tail or not held else torch.empty
    out = make(capacity, width, dtype=cuda_pool.dtype, device=cuda_pool.device)
    _give_back_reference(table, cuda_pool, host_pool, free_pages, cursors, page_size, out)
    return out


def _give_back_reference(table, cuda_pool, host_pool, free_pages, cursors, page_size,
                         out: torch.Tensor | None) -> None:
    """Push the table's pages back (copying their rows into ``out`` unless it is None)."""
    cuda_pages = cuda_pool.shape[0] // page_size
    n = int(table[L.TAB_ROWS])
    pages = min(int(table[L.TAB_PAGES]), len(table) - L.HEADER)     # as the kernel cuts it
    ncuda = min(int(table[L.TAB_CUDA_PAGES]), pages)
    if n >= 0:
        ctop, htop = int(cursors[L.CUR_CUDA_FREE]), int(cursors[L.CUR_HOST_FREE])
        nhost = pages - ncuda
        for j in range(pages):
            page = int(table[L.HEADER + j])
            end = min(n, (j + 1) * page_size, len(out) if out is not None else n)
            rows = slice(j * page_size, max(end, j * page_size))   # rows past `out` are dropped
            count = rows.stop - rows.start
            if out is None or count == 0:
                pass
            elif page < cuda_pages:
                out[rows] = cuda_pool[page * page_size: page * page_size + count]
            else:
                h = page - cuda_pages
                out[rows] = host_pool[h * page_size: h * page_size + count].to(out.device)
            free_pages[returned_slot(j, ncuda, nhost, ctop, cuda_pages, htop)] = page
        cursors[L.CUR_CUDA_FREE] = ctop + ncuda
        cursors[L.CUR_HOST_FREE] = htop + nhost
    table[L.TAB_ROWS], table[L.TAB_PAGES], table[L.TAB_CUDA_PAGES] = L.NOTHING_HELD, 0, 0


def stash_release_reference(table, cuda_pool, host_pool, free_pages, cursors,
                            page_size: int) -> None:
    """Pure-torch twin of `stash_release`: the pop's bookkeeping without the copy."""
    _give_back_reference(table, cuda_pool, host_pool, free_pages, cursors, page_size, None)


# ----------------------------------------------------------------------------- Triton kernel


@triton.jit
def _read_pages_kernel(
    out_ptr, table_ptr, cuda_ptr, host_ptr, capacity, width, page_elems, cuda_pages,
    page_size, max_pages, BLOCK: tl.constexpr, ZERO_TAIL: tl.constexpr, PDL: tl.constexpr,
):
    # The output is walked page by page like the pool, so one pass writes held rows and (with
    # ZERO_TAIL) the zero tail alike. Without ZERO_TAIL the rows past n are not written at all:
    # for consumers that read only rows below n. A table that holds nothing (overflow, or popped
    # already) gives all zeros either way, never uninitialised memory. This launch reads the
    # table and the pools and writes only the output; the release after it does the rest.
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    held, n, pages = held_pages_k(table_ptr, max_pages)
    chunks = tl.cdiv(page_elems, BLOCK)
    out_pages = (capacity + page_size - 1) // page_size
    lanes = tl.arange(0, BLOCK)
    if ZERO_TAIL:
        tiles = out_pages * chunks
    else:
        tiles = tl.where(held, pages * chunks, out_pages * chunks)
    for t in range(pid, tiles, nprog):
        j = t // chunks
        c = t - j * chunks
        page = tl.load(table_ptr + L.HEADER_K + j, mask=j < pages, other=0).to(tl.int64)
        out_limit = tl.minimum(page_size, capacity - j * page_size) * width - c * BLOCK
        valid_limit = tl.minimum(tl.maximum(n - j * page_size, 0), page_size) * width - c * BLOCK
        valid_limit = tl.where(j < pages, valid_limit, 0)
        if ZERO_TAIL:
            limit = out_limit
        else:
            limit = tl.where(held, tl.minimum(out_limit, valid_limit), out_limit)
        src = pool_tile(cuda_ptr, host_ptr, page, cuda_pages, page_elems, c * BLOCK)
        dst = out_ptr + j.to(tl.int64) * page_elems + c * BLOCK
        # Each branch loads and stores its own tile: no register tile crosses a branch.
        if (valid_limit >= BLOCK) & (limit >= BLOCK):     # full tile: the accesses vectorise
            tl.store(dst + lanes, tl.load(src + lanes))
        else:
            vals = tl.load(src + lanes, mask=lanes < valid_limit, other=0)
            tl.store(dst + lanes, vals, mask=lanes < limit)


# ----------------------------------------------------------------------------- launcher


def stash_pop_triton(table, cuda_pool, host_pool, free_pages, cursors, capacity: int,
                     page_size: int, block: int = 0, programs: int = 0,
                     warps: int = 0, zero_tail: bool = True,
                     expected_rows: int = 0) -> torch.Tensor:
    """Read the pages into a fresh ``[capacity, W]`` buffer, then release them (two launches;
    where `use_pdl` holds, the release starts while the reader runs). The reader's grid is
    sized for ``expected_rows`` (`grid_size`; with ``zero_tail`` for the capacity, whose every
    row is written)."""
    width = cuda_pool.shape[1]
    out = torch.empty(capacity, width, dtype=cuda_pool.dtype, device=cuda_pool.device)
    if capacity == 0:
        release_pages_triton(table, cuda_pool, free_pages, cursors, page_size)
        return out
    pdl = use_pdl(out.device)
    launch = choose_launch(out.device, width, out.element_size(), page_size, block, programs,
                           warps, kernel="pop")
    grid = (grid_size(capacity, width, page_size, launch.block, launch.programs,
                      0 if zero_tail else expected_rows),)
    _read_pages_kernel[grid](
        out, table, cuda_pool, host_pool, capacity, width, page_size * width,
        cuda_pool.shape[0] // page_size, page_size, table.numel() - L.HEADER,
        BLOCK=launch.block, ZERO_TAIL=zero_tail, PDL=pdl, num_warps=launch.num_warps,
    )
    # Nothing may come between the two launches: PDL pairs the release with the reader.
    release_pages_triton(table, cuda_pool, free_pages, cursors, page_size, pdl)
    return out


def stash_release_triton(table, cuda_pool, host_pool, free_pages, cursors,
                         page_size: int) -> None:
    """The release alone: one program pushes the ids back, reads and writes no rows."""
    release_pages_triton(table, cuda_pool, free_pages, cursors, page_size)


# ----------------------------------------------------------------------------- torch.library ops


@torch.library.custom_op("pagedstash_func::stash_pop",
                         mutates_args=("table", "free_pages", "cursors"))
def stash_pop(table: torch.Tensor, cuda_pool: torch.Tensor, host_pool: torch.Tensor,
              free_pages: torch.Tensor, cursors: torch.Tensor, capacity: int, page_size: int,
              backend: str = "auto", block: int = 0, programs: int = 0,
              warps: int = 0, zero_tail: bool = True, expected_rows: int = 0,
              after: torch.Tensor | None = None) -> torch.Tensor:
    """Return the stashed rows as ``[capacity, W]`` (rows ``>= n`` zero) and free their pages.

    ``zero_tail=False`` leaves rows ``>= n`` unwritten (fewer bytes), for a consumer that reads
    only rows below ``n``; a table that holds nothing still pops as zeros. Mutates the page
    ``table`` (left holding nothing), ``free_pages`` and ``cursors``. The output lives on
    ``cuda_pool``'s device with its dtype. ``expected_rows`` sizes the grid as in `stash_copy`
    when ``zero_tail=False``; with the zero tail every row is written, so the grid covers the
    capacity. ``after``: a tensor this pop must follow, never read (see `stash_release`).
    """
    check_pool_args(None, cuda_pool, host_pool, free_pages, cursors, page_size)
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    check_table(table, capacity, page_size, cuda_pool.device)
    if resolve_backend(backend, cuda_pool.device) == "torch":
        return stash_pop_reference(table, cuda_pool, host_pool, free_pages, cursors, capacity,
                                   page_size, zero_tail)
    return stash_pop_triton(table, cuda_pool, host_pool, free_pages, cursors, capacity,
                            page_size, block, programs, warps, zero_tail, expected_rows)


@stash_pop.register_fake
def _(table, cuda_pool, host_pool, free_pages, cursors, capacity, page_size, backend="auto",
      block=0, programs=0, warps=0, zero_tail=True, expected_rows=0, after=None):
    return cuda_pool.new_empty(capacity, cuda_pool.shape[1])


@torch.library.custom_op("pagedstash_func::stash_release",
                         mutates_args=("table", "free_pages", "cursors"))
def stash_release(table: torch.Tensor, cuda_pool: torch.Tensor, host_pool: torch.Tensor,
                  free_pages: torch.Tensor, cursors: torch.Tensor, page_size: int,
                  backend: str = "auto", after: torch.Tensor | None = None) -> None:
    """Give the pages of ``table`` back without reading them; the table then holds nothing.

    How the layer's fused SwiGLU backward gives its pages back once it has read them, and how
    `run_step` / `reclaim` give back stashes whose backward never ran (an output that never
    reached the loss): the free stacks end as a pop would leave them.

    ``after``: a tensor this release must follow, never read. A compiled graph orders ops by
    their data alone, and its partitioner may move any that needs no gradient into the
    forward graph: the values stay right (functionalised), but a pop's padded output would
    then be held from forward to backward, and pages would count as free while their rows
    wait to be read. Passing what the pages' reader computed from the gradient keeps the
    release (and the pop) in backward, after the reader, whatever the partitioner decides.
    """
    check_pool_args(None, cuda_pool, host_pool, free_pages, cursors, page_size)
    check_table(table, 0, page_size, cuda_pool.device)
    if resolve_backend(backend, cuda_pool.device) == "torch":
        stash_release_reference(table, cuda_pool, host_pool, free_pages, cursors, page_size)
    else:
        stash_release_triton(table, cuda_pool, host_pool, free_pages, cursors, page_size)


@stash_release.register_fake
def _(table, cuda_pool, host_pool, free_pages, cursors, page_size, backend="auto",
      after=None):
    return None
