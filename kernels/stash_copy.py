"""Stash copy: move the valid rows of a capacity-padded buffer into pages of a pool.

Order as in the Triton tutorials: the pure-torch twin, the kernel, the launcher, then the
``torch.library`` op. Bytes moved: ``n * W * itemsize`` read and the same written (plus a few
page ids); the padded tail ``capacity - n`` is never touched, which is the point.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _constexpr as K
from ._backend import resolve_backend
from ._launch import choose_launch
from ._layout import (
    CUR_CUDA_FREE, CUR_HOST_FREE, FLAG_HOST_SPILL, FLAG_OVERFLOW, HEADER,
    NOTHING_HELD, TAB_CUDA_PAGES, TAB_PAGES, TAB_ROWS,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _plan(n_rows: int, capacity: int, page_size: int, cuda_free: int, host_free: int,
          overflowed: bool) -> tuple[int, int, int, int, bool]:
    """(n, pages, from_cuda, from_host, fits): the allocation both twin and kernel make."""
    n = min(max(n_rows, 0), capacity)
    pages = _cdiv(n, page_size)
    from_cuda = min(pages, cuda_free)
    from_host = pages - from_cuda
    fits = (not overflowed) and from_host <= host_free
    return n, pages, from_cuda, from_host, fits


# ----------------------------------------------------------------------------- torch twin


def stash_copy_reference(src: torch.Tensor, n_rows: torch.Tensor, table: torch.Tensor,
                         cuda_pool: torch.Tensor, host_pool: torch.Tensor,
                         free_pages: torch.Tensor, cursors: torch.Tensor, flags: torch.Tensor,
                         page_size: int) -> None:
    """Pure-torch twin of the stash kernel (same writes, bit for bit; reads ``n_rows`` on the host).

    Allocation: page ``j`` of the tensor is popped off the CUDA free stack while it has pages
    (``free_pages[cuda_free - 1 - j]``), then off the host stack; if both together cannot hold
    ``ceil(n / page_size)`` pages, or the overflow flag is already set, nothing is copied, the
    table says ``-1`` rows and the overflow flag is set.
    """
    capacity, _ = src.shape
    cuda_pages = cuda_pool.shape[0] // page_size
    ctop, htop = int(cursors[CUR_CUDA_FREE]), int(cursors[CUR_HOST_FREE])
    n, pages, from_cuda, from_host, fits = _plan(
        int(n_rows.reshape(-1)[0]), capacity, page_size, ctop, htop,
        bool(flags[FLAG_OVERFLOW] != 0))
    if not fits:
        table[TAB_ROWS], table[TAB_PAGES], table[TAB_CUDA_PAGES] = NOTHING_HELD, 0, 0
        flags[FLAG_OVERFLOW] = 1
        return
    for j in range(pages):
        slot = ctop - 1 - j if j < from_cuda else cuda_pages + htop - 1 - (j - from_cuda)
        page = int(free_pages[slot])
        table[HEADER + j] = page
        rows = slice(j * page_size, min(n, (j + 1) * page_size))
        count = rows.stop - rows.start
        if page < cuda_pages:
            cuda_pool[page * page_size: page * page_size + count] = src[rows]
        else:
            h = page - cuda_pages
            host_pool[h * page_size: h * page_size + count] = src[rows].to(host_pool.device)
    table[TAB_ROWS], table[TAB_PAGES], table[TAB_CUDA_PAGES] = n, pages, from_cuda
    cursors[CUR_CUDA_FREE] = ctop - from_cuda
    cursors[CUR_HOST_FREE] = htop - from_host
    if from_host > 0:
        flags[FLAG_HOST_SPILL] = 1


# ----------------------------------------------------------------------------- Triton kernel



@triton.jit
def pool_tile(cuda_ptr, host_ptr, page, cuda_pages, page_elems, offset):
    """Pointer to element ``offset`` of pool page ``page``: CUDA pool below ``cuda_pages``."""
    if page < cuda_pages:
        ptr = cuda_ptr + page * page_elems + offset
    else:
        ptr = host_ptr + (page - cuda_pages) * page_elems + offset
    return ptr


@triton.jit
def _page_of_tile(free_ptr, t, chunks, total, from_cuda, ctop, cuda_pages, htop):
    """Pool page id of tile ``t`` (as int64), read off the free stacks; 0 past the last tile."""
    j = t // chunks
    slot = tl.where(j < from_cuda, ctop - 1 - j, cuda_pages + htop - 1 - (j - from_cuda))
    return tl.load(free_ptr + slot, mask=t < total, other=0).to(tl.int64)


@triton.jit
def _stash_copy_kernel(
    src_ptr, n_ptr, table_ptr, cuda_ptr, host_ptr, free_ptr, cur_ptr, flag_ptr,
    capacity, width, page_elems, cuda_pages, page_size,
    BLOCK: tl.constexpr, IDS_BLOCK: tl.constexpr, EVICT_FIRST: tl.constexpr,
):
    # Every program plans the same allocation from the cursors as they were at launch; only the
    # program that finishes last (by ticket) writes the new cursors and flags, so no program can
    # read a cursor that this launch already moved. One launch, no host round trip.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n = tl.load(n_ptr).to(tl.int32)
    n = tl.minimum(tl.maximum(n, 0), capacity)
    pages = (n + page_size - 1) // page_size
    ctop = tl.load(cur_ptr + K.CUDA_FREE)
    htop = tl.load(cur_ptr + K.HOST_FREE)
    overflowed = tl.load(flag_ptr + K.OVERFLOW) != 0
    from_cuda = tl.minimum(pages, ctop)
    from_host = pages - from_cuda
    fits = (from_host <= htop) & (overflowed == 0)

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
            if EVICT_FIRST:
                tl.store(dst + lanes, tl.load(src + lanes, eviction_policy="evict_first"),
                         eviction_policy="evict_first")
            else:
                tl.store(dst + lanes, tl.load(src + lanes))
        else:
            mask = lanes < limit
            tl.store(dst + lanes, tl.load(src + lanes, mask=mask), mask=mask)

    if pid == 0:
        tl.store(table_ptr + K.ROWS, tl.where(fits, n, -1))
        tl.store(table_ptr + K.PAGES, tl.where(fits, pages, 0))
        tl.store(table_ptr + K.CUDA_PAGES, tl.where(fits, from_cuda, 0))
        ids_end = tl.where(fits, pages, 0)
        for b in range(0, ids_end, IDS_BLOCK):
            j = b + tl.arange(0, IDS_BLOCK)
            m = j < ids_end
            slot = tl.where(j < from_cuda, ctop - 1 - j, cuda_pages + htop - 1 - (j - from_cuda))
            ids = tl.load(free_ptr + slot, mask=m, other=0)
            tl.store(table_ptr + K.HEADER + j, ids, mask=m)

    ticket = tl.atomic_add(cur_ptr + K.TICKET, 1, sem="acq_rel")
    if ticket == nprog - 1:
        tl.store(cur_ptr + K.CUDA_FREE, tl.where(fits, ctop - from_cuda, ctop))
        tl.store(cur_ptr + K.HOST_FREE, tl.where(fits, htop - from_host, htop))
        if fits:
            if from_host > 0:
                tl.store(flag_ptr + K.HOST_SPILL, 1)
        else:
            tl.store(flag_ptr + K.OVERFLOW, 1)
        tl.store(cur_ptr + K.TICKET, 0)


# ----------------------------------------------------------------------------- launcher

IDS_BLOCK = 256


def _grid_size(capacity: int, width: int, page_size: int, block: int, programs: int) -> int:
    """Programs for the largest possible copy (``n = capacity``), capped at ``programs``."""
    tiles = _cdiv(capacity, page_size) * _cdiv(page_size * width, block)
    return max(1, min(programs, tiles))


def stash_copy_triton(src, n_rows, table, cuda_pool, host_pool, free_pages, cursors, flags,
                      page_size: int, block: int = 0, programs: int = 0) -> None:
    """Launch the stash kernel once; ``block``/``programs`` override the per-device choice."""
    capacity, width = src.shape
    launch = choose_launch(src.device, width, src.element_size(), page_size, block, programs)
    grid = (_grid_size(capacity, width, page_size, launch.block, launch.programs),)
    _stash_copy_kernel[grid](
        src, n_rows, table, cuda_pool, host_pool, free_pages, cursors, flags,
        capacity, width, page_size * width, cuda_pool.shape[0] // page_size, page_size,
        BLOCK=launch.block, IDS_BLOCK=IDS_BLOCK, EVICT_FIRST=launch.evict_first,
        num_warps=launch.num_warps,
    )


def check_pool_args(src_or_width, cuda_pool, host_pool, free_pages, cursors, page_size):
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if cuda_pool.dim() != 2 or host_pool.dim() != 2 or cuda_pool.shape[0] % page_size:
        raise ValueError("pools must be [pages * page_size, W]; build them with "
                         "pagedstash_func.init_stash_state")
    if isinstance(src_or_width, torch.Tensor):
        src = src_or_width
        if src.dim() != 2 or src.shape[1] != cuda_pool.shape[1] or src.dtype != cuda_pool.dtype:
            raise ValueError(
                f"source {tuple(src.shape)} {src.dtype} does not fit a pool of rows of width "
                f"{cuda_pool.shape[1]} and dtype {cuda_pool.dtype}")
        if not src.is_contiguous():
            raise ValueError("the source must be contiguous: pass src.contiguous()")
    if free_pages.dtype != torch.int32 or cursors.dtype != torch.int32:
        raise ValueError("free_pages and cursors must be int32")


# ----------------------------------------------------------------------------- torch.library op


@torch.library.custom_op(
    "pagedstash_func::stash_copy",
    mutates_args=("table", "cuda_pool", "host_pool", "free_pages", "cursors", "flags"))
def stash_copy(src: torch.Tensor, n_rows: torch.Tensor, table: torch.Tensor,
               cuda_pool: torch.Tensor, host_pool: torch.Tensor, free_pages: torch.Tensor,
               cursors: torch.Tensor, flags: torch.Tensor, page_size: int,
               backend: str = "auto", block: int = 0, programs: int = 0) -> None:
    """Copy the first ``n_rows`` rows of ``src [capacity, W]`` into free pages of a pool.

    ``n_rows`` is a one-element int tensor on the device (never read on the host by the Triton
    backend). Mutates the page ``table``, the pools, the free lists, the cursors and ``flags``.
    """
    check_pool_args(src, cuda_pool, host_pool, free_pages, cursors, page_size)
    if resolve_backend(backend, src.device) == "torch":
        stash_copy_reference(src, n_rows, table, cuda_pool, host_pool, free_pages, cursors,
                             flags, page_size)
    else:
        stash_copy_triton(src, n_rows, table, cuda_pool, host_pool, free_pages, cursors, flags,
                          page_size, block, programs)


@stash_copy.register_fake
def _(src, n_rows, table, cuda_pool, host_pool, free_pages, cursors, flags, page_size,
      backend="auto", block=0, programs=0):
    return None
