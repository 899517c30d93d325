"""The free-page stacks and pool addressing that the stash and pop kernels share.

A pool's ``free_pages`` holds two stacks side by side (see `_layout`): CUDA page ids in
``[0, cuda_pages)`` with ``ctop`` of them free, host page ids after them with ``htop`` free.
A stash takes its pages off the top of the CUDA stack, then off the host stack; a pop pushes
them back in the reverse order, so a stash followed by its pop leaves both stacks as they were.
The slot formulas, and a stash's whole bookkeeping (plan, table, cursors and flags: shared by
the stash copy and the reserve kernel), are written here once as Triton functions (for the
kernels) and once as plain Python (for the torch twins), side by side so that they cannot
drift apart.
"""

from __future__ import annotations

import torch

from ._triton import gdc_launch_dependents, gdc_wait, triton, tl
from . import _layout as L

IDS_BLOCK = 256   # fewest page ids the reservation and the release move per step
IDS_BLOCK_MAX = 4096


# ----------------------------------------------------------------------------- slot formulas


def taken_slot(j: int, from_cuda: int, ctop: int, cuda_pages: int, htop: int) -> int:
    """Index into ``free_pages`` of the ``j``-th page a stash takes (twin of `taken_slot_k`)."""
    return ctop - 1 - j if j < from_cuda else cuda_pages + htop - 1 - (j - from_cuda)


@triton.jit
def taken_slot_k(j, from_cuda, ctop, cuda_pages, htop):
    return tl.where(j < from_cuda, ctop - 1 - j, cuda_pages + htop - 1 - (j - from_cuda))


def returned_slot(j: int, ncuda: int, nhost: int, ctop: int, cuda_pages: int,
                  htop: int) -> int:
    """Index into ``free_pages`` where a pop puts back the ``j``-th page of a table."""
    return ctop + ncuda - 1 - j if j < ncuda else cuda_pages + htop + nhost - 1 - (j - ncuda)


@triton.jit
def returned_slot_k(j, ncuda, nhost, ctop, cuda_pages, htop):
    return tl.where(j < ncuda, ctop + ncuda - 1 - j,
                    cuda_pages + htop + nhost - 1 - (j - ncuda))


def plan_allocation(n_rows: int, capacity: int, page_size: int, cuda_free: int, host_free: int,
                    overflowed: bool) -> tuple[int, int, int, int, bool]:
    """(n, pages, from_cuda, from_host, fits): the allocation both twin and kernel make."""
    n = min(max(n_rows, 0), capacity)
    pages = cdiv(n, page_size)
    from_cuda = min(pages, cuda_free)
    from_host = pages - from_cuda
    fits = (not overflowed) and from_host <= host_free
    return n, pages, from_cuda, from_host, fits


def take_pages_reference(n_rows: torch.Tensor, table: torch.Tensor, cuda_pool: torch.Tensor,
                         free_pages: torch.Tensor, cursors: torch.Tensor, flags: torch.Tensor,
                         capacity: int, page_size: int) -> None:
    """A stash's bookkeeping in torch (the twin of `plan_k`, `record_pages_k` and
    `publish_k`): page ``j`` comes off the CUDA free stack while it has pages
    (``free_pages[cuda_free - 1 - j]``), then off the host stack; if both together cannot hold
    ``ceil(n / page_size)`` pages, or the overflow flag is already set, the table says ``-1``
    rows and the overflow flag is set. Reads ``n_rows`` on the host."""
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


def write_held_rows_reference(rows: torch.Tensor, table: torch.Tensor, cuda_pool: torch.Tensor,
                              host_pool: torch.Tensor, page_size: int) -> None:
    """Copy the rows of ``rows`` into the pages the table holds, up to the rows it holds
    (nothing if it holds nothing; a page id outside the pools is skipped): what a producer
    fused with the stash writes."""
    for span, pool, at in _held_spans(table, cuda_pool, host_pool, page_size, len(rows)):
        pool[at: at + span.stop - span.start] = rows[span].to(pool.device)


def read_held_rows_reference(table: torch.Tensor, cuda_pool: torch.Tensor,
                             host_pool: torch.Tensor, capacity: int,
                             page_size: int) -> torch.Tensor:
    """``[capacity, W]``: the held rows from their pages, zeros elsewhere (what a consumer
    fused with the pop reads; the pages stay held)."""
    out = torch.zeros(capacity, cuda_pool.shape[1], dtype=cuda_pool.dtype,
                      device=cuda_pool.device)
    for span, pool, at in _held_spans(table, cuda_pool, host_pool, page_size, capacity):
        out[span] = pool[at: at + span.stop - span.start].to(out.device)
    return out


def _held_spans(table, cuda_pool, host_pool, page_size, limit):
    """``(rows, pool, first pool row)`` of each held page, rows cut at ``limit``; page ids
    outside the pools are skipped (the fused kernels mask them the same way)."""
    n = min(int(table[L.TAB_ROWS]), limit)
    cuda_pages = cuda_pool.shape[0] // page_size
    pool_pages = (cuda_pool.shape[0] + host_pool.shape[0]) // page_size
    for j in range(cdiv(max(n, 0), page_size)):
        page = int(table[L.HEADER + j])
        if not 0 <= page < pool_pages:
            continue
        span = slice(j * page_size, min(n, (j + 1) * page_size))
        if page < cuda_pages:
            yield span, cuda_pool, page * page_size
        else:
            yield span, host_pool, (page - cuda_pages) * page_size


# ----------------------------------------------------------------------------- kernel helpers


@triton.jit
def load_cursors(cur_ptr):
    """Free CUDA pages and free host pages, as they were when the launch began."""
    return tl.load(cur_ptr + L.CUDA_FREE_K), tl.load(cur_ptr + L.HOST_FREE_K)


@triton.jit
def load_count_k(n_ptr, capacity):
    """The row count of a stash, read on the device and clamped to ``[0, capacity]`` (then
    narrowed to int32): the rows the reserve plans for, and so the rows its table holds."""
    return tl.minimum(tl.maximum(tl.load(n_ptr), 0), capacity).to(tl.int32)


@triton.jit
def held_pages_k(table_ptr, max_pages):
    """``(held, n, pages)`` of a page table: whether it holds anything, its rows (0 if not)
    and its pages. A header claiming more pages than the table has slots (a corrupted table)
    is cut to the slots: nothing is read past the table."""
    held_rows = tl.load(table_ptr + L.ROWS_K)
    held = held_rows >= 0
    pages = tl.minimum(tl.where(held, tl.load(table_ptr + L.PAGES_K), 0), max_pages)
    return held, tl.where(held, held_rows, 0), pages


@triton.jit
def plan_k(n_ptr, cur_ptr, flag_ptr, capacity, page_size):
    """``(n, pages, ctop, htop, from_cuda, from_host, fits)``: the allocation of a stash of
    ``n`` rows (`load_count_k`) from the cursors and the overflow flag as they are at launch
    (twin: `plan_allocation`)."""
    n = load_count_k(n_ptr, capacity)
    pages = (n + page_size - 1) // page_size
    ctop, htop = load_cursors(cur_ptr)
    overflowed = tl.load(flag_ptr + L.OVERFLOW_K) != 0
    from_cuda = tl.minimum(pages, ctop)
    from_host = pages - from_cuda
    fits = (from_host <= htop) & (overflowed == 0)
    return n, pages, ctop, htop, from_cuda, from_host, fits


@triton.jit
def record_pages_k(table_ptr, free_ptr, n, pages, ctop, htop, from_cuda, cuda_pages, fits,
                   IDS_BLOCK: tl.constexpr):
    """Write the table of a planned stash: its header, and the ids it takes off the stacks."""
    tl.store(table_ptr + L.ROWS_K, tl.where(fits, n, -1))
    tl.store(table_ptr + L.PAGES_K, tl.where(fits, pages, 0))
    tl.store(table_ptr + L.CUDA_PAGES_K, tl.where(fits, from_cuda, 0))
    ids_end = tl.where(fits, pages, 0)
    for b in range(0, ids_end, IDS_BLOCK):
        j = b + tl.arange(0, IDS_BLOCK)
        m = j < ids_end
        ids = tl.load(free_ptr + taken_slot_k(j, from_cuda, ctop, cuda_pages, htop), mask=m,
                      other=0)
        tl.store(table_ptr + L.HEADER_K + j, ids, mask=m)


@triton.jit
def publish_k(cur_ptr, flag_ptr, ctop, htop, from_cuda, from_host, fits):
    """Move the cursors past a planned stash and set its flags (host spill, or overflow)."""
    tl.store(cur_ptr + L.CUDA_FREE_K, tl.where(fits, ctop - from_cuda, ctop))
    tl.store(cur_ptr + L.HOST_FREE_K, tl.where(fits, htop - from_host, htop))
    if fits:
        if from_host > 0:
            tl.store(flag_ptr + L.HOST_SPILL_K, 1)
    else:
        tl.store(flag_ptr + L.OVERFLOW_K, 1)


@triton.jit
def pool_tile(cuda_ptr, host_ptr, page, cuda_pages, page_elems, offset):
    """Pointer to element ``offset`` of pool page ``page``: CUDA pool below ``cuda_pages``."""
    if page < cuda_pages:
        ptr = cuda_ptr + page * page_elems + offset
    else:
        ptr = host_ptr + (page - cuda_pages) * page_elems + offset
    return ptr


@triton.jit
def _reserve_pages_kernel(
    n_ptr, table_ptr, free_ptr, cur_ptr, flag_ptr, capacity, cuda_pages, page_size,
    IDS_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        # The page writer may launch now: it loads its source until it needs the table.
        gdc_launch_dependents()
    n, pages, ctop, htop, from_cuda, from_host, fits = plan_k(n_ptr, cur_ptr, flag_ptr,
                                                              capacity, page_size)
    record_pages_k(table_ptr, free_ptr, n, pages, ctop, htop, from_cuda, cuda_pages, fits,
                   IDS_BLOCK)
    # Every warp loads the cursors and flags itself, and one thread publishes: without the
    # barrier a warp that starts late could plan from cursors a faster warp already moved.
    # Each warp's loads feed its loop bound above, so they are done when it reaches the
    # barrier (a warp cannot pass an instruction whose operand is a load in flight).
    tl.debug_barrier()
    publish_k(cur_ptr, flag_ptr, ctop, htop, from_cuda, from_host, fits)


def reserve_pages_triton(n_rows, table, cuda_pool, free_pages, cursors, flags, capacity: int,
                         page_size: int, pdl: bool = False) -> None:
    """Take the pages for ``n_rows`` rows and write the table, cursors and flags (twin:
    `take_pages_reference`): one program. The bookkeeping launch of `stash_reserve` and of
    `stash_copy` (before its page writer); with ``pdl`` it lets the next launch start at once
    (programmatic dependent launch: only for a next launch that waits before it reads what
    this one writes, as the page writer does).

    The page ids move in one step when they are up to 4096 (4 warps): the page writer waits
    for this launch, and moving 1024 ids 256 at a time with one warp cost the stash of 65536
    rows of 2048 about a point of ``copy_``'s bandwidth on the H200 (96.2 % against 97.3 %).
    """
    _reserve_pages_kernel[(1,)](
        n_rows, table, free_pages, cursors, flags, capacity, cuda_pool.shape[0] // page_size,
        page_size, IDS_BLOCK=ids_block(cdiv(capacity, page_size)), PDL=pdl, num_warps=4,
    )


@triton.jit
def _release_pages_kernel(
    table_ptr, free_ptr, cur_ptr, cuda_pages, max_pages,
    IDS_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    # With PDL this runs while the pop's page reader still does: the reader reads the table
    # (header and page ids) and the pools, never the free stacks or the cursors, so the ids go
    # back and the cursors move at once; only emptying the header waits for the reader.
    held, _, pages = held_pages_k(table_ptr, max_pages)
    ncuda = tl.minimum(tl.where(held, tl.load(table_ptr + L.CUDA_PAGES_K), 0), pages)
    ctop, htop = load_cursors(cur_ptr)
    nhost = pages - ncuda
    # Push the pages back in reverse order of allocation: a stash then its pop restores the
    # free stacks exactly, so page order stays a function of the state alone.
    for b in range(0, pages, IDS_BLOCK):
        j = b + tl.arange(0, IDS_BLOCK)
        m = j < pages
        ids = tl.load(table_ptr + L.HEADER_K + j, mask=m, other=0)
        tl.store(free_ptr + returned_slot_k(j, ncuda, nhost, ctop, cuda_pages, htop), ids,
                 mask=m)
    tl.debug_barrier()      # as in the reserve: every warp has read what one thread rewrites
    tl.store(cur_ptr + L.CUDA_FREE_K, ctop + ncuda)
    tl.store(cur_ptr + L.HOST_FREE_K, htop + nhost)
    if PDL:
        gdc_wait()
    tl.store(table_ptr + L.ROWS_K, -1)
    tl.store(table_ptr + L.PAGES_K, 0)
    tl.store(table_ptr + L.CUDA_PAGES_K, 0)


def release_pages_triton(table, cuda_pool, free_pages, cursors, page_size: int,
                         pdl: bool = False) -> None:
    """Give the pages of ``table`` back and leave it holding nothing (twin:
    `stash_pop.stash_release_reference`): one program. The bookkeeping launch of
    `stash_release` and of `stash_pop` (after its page reader); with ``pdl`` it starts while
    the launch before it runs, and waits for it only to empty the table header (for a launch
    before it that reads the table and the pools, never the free stacks or cursors)."""
    max_pages = table.numel() - L.HEADER
    _release_pages_kernel[(1,)](
        table, free_pages, cursors, cuda_pool.shape[0] // page_size, max_pages,
        IDS_BLOCK=ids_block(max_pages), PDL=pdl, num_warps=4, launch_pdl=pdl,
    )


# ----------------------------------------------------------------------------- launcher helpers


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ids_block(pages: int) -> int:
    """Page ids the reserve and the release move per step: all ``pages`` of a table in one
    step up to `IDS_BLOCK_MAX` (a power of two, at least `IDS_BLOCK`)."""
    return min(IDS_BLOCK_MAX, max(IDS_BLOCK, 1 << max(0, (pages - 1).bit_length())))


def grid_size(capacity: int, width: int, page_size: int, block: int, programs: int,
              expected_rows: int = 0) -> int:
    """Programs: one per tile of three quarters of ``expected_rows`` rows, but of no fewer
    than a quarter of the capacity nor more than all of it (all of it when ``expected_rows``
    is 0), capped at ``programs``.

    The kernels loop over tiles, so any grid copies every valid row; the size only decides
    how the work is spread. A grid for more rows than arrive gives programs that start, find
    nothing and leave, and each costs a launch slot: on the H200, at 80 % valid rows and 65536
    rows, a grid for the capacity cost the stash's page writer (2 KiB tiles) 7-13 points of
    ``copy_``'s bandwidth, and the pop (then one launch of 16 KiB tiles) 2-9 points. A grid for
    fewer rows than arrive makes programs loop and cost at most 2 points down to 0.6x, so the
    grid is sized below the expectation: the rows may fall to 3/4 of it before a program
    idles. It never covers less than a quarter of the capacity, so a far too small
    expectation (a busy rank, a hand-built spec) leaves each program about four tiles at
    most, not hundreds.
    """
    if expected_rows <= 0:
        rows = capacity
    else:
        rows = min(max(-(-3 * expected_rows // 4), -(-capacity // 4)), capacity)
    tiles = cdiv(rows, page_size) * cdiv(page_size * width, block)
    return max(1, min(programs, tiles))


def check_pool_args(rows, cuda_pool, host_pool, free_pages, cursors, page_size, flags=None,
                    n_rows=None):
    """`ValueError` for pool arguments the kernels cannot use (shapes, dtypes, devices,
    contiguity: the kernels index flat memory and never look at strides).

    ``rows``: the ``[C, W]`` rows a stash reads or a pop writes, or None. ``flags`` and
    ``n_rows`` are checked when given.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if cuda_pool.dim() != 2 or host_pool.dim() != 2 or cuda_pool.shape[0] % page_size \
            or host_pool.shape[1] != cuda_pool.shape[1] or host_pool.dtype != cuda_pool.dtype \
            or not cuda_pool.is_contiguous() or not host_pool.is_contiguous():
        raise ValueError("pools must be contiguous [pages * page_size, W] of one dtype; build "
                         "them with pagedstash_func.init_stash_state")
    if rows is not None:
        if rows.dim() != 2 or rows.shape[1] != cuda_pool.shape[1] \
                or rows.dtype != cuda_pool.dtype:
            raise ValueError(
                f"rows {tuple(rows.shape)} {rows.dtype} do not fit a pool of rows of width "
                f"{cuda_pool.shape[1]} and dtype {cuda_pool.dtype}")
        if not rows.is_contiguous():
            raise ValueError("the rows must be contiguous: pass a .contiguous() tensor")
        if rows.device != cuda_pool.device:
            raise ValueError(f"the rows are on {rows.device}, the pool on {cuda_pool.device}")
    cuda_pages = cuda_pool.shape[0] // page_size
    bookkeeping = {"free_pages": (free_pages, cuda_pages), "cursors": (cursors, 4)}
    if flags is not None:
        bookkeeping["flags"] = (flags, L.NUM_FLAGS)
    for name, (t, least) in bookkeeping.items():
        if t.dtype != torch.int32 or t.dim() != 1 or t.numel() < least \
                or not t.is_contiguous() or t.device != cuda_pool.device:
            raise ValueError(
                f"{name} must be a contiguous int32 [{least}] or longer on {cuda_pool.device}, "
                f"got {t.dtype} {list(t.shape)} on {t.device}: use the state's own tensors "
                f"(psf.stash_slot, state.flags)")
    if free_pages.numel() > cuda_pages + host_pool.shape[0] // page_size:
        raise ValueError(f"free_pages lists {free_pages.numel()} pages; the pools hold "
                         f"{cuda_pages + host_pool.shape[0] // page_size} of {page_size} rows: "
                         f"use the page size the pools were built with")
    if n_rows is not None:
        check_count(n_rows, "n_rows", cuda_pool.device)


INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def check_count(count: torch.Tensor, name: str, device: torch.device) -> None:
    """`ValueError` unless ``count`` (a row count every kernel reads on the device) is a
    one-element integer tensor on ``device``."""
    if count.numel() != 1 or count.dtype not in INT_DTYPES or count.device != device:
        raise ValueError(
            f"{name} must be a one-element integer tensor on {device}, got "
            f"{tuple(count.shape)} {count.dtype} on {count.device}: pass "
            f"torch.tensor([n], dtype=torch.int32, device={str(device)!r})")


def check_table(table: torch.Tensor, capacity: int, page_size: int,
                device: torch.device) -> None:
    """`ValueError` for a page table too short for ``capacity`` rows (the kernels index it
    by page without a bound), or one they cannot address (dtype, strides, device)."""
    if table.dim() != 1 or table.dtype != torch.int32 or not table.is_contiguous() \
            or table.numel() < L.table_size(capacity, page_size) or table.device != device:
        raise ValueError(
            f"a page table for {capacity} rows in pages of {page_size} is a contiguous int32 "
            f"[{L.table_size(capacity, page_size)}] or longer on {device}; got {table.dtype} "
            f"{list(table.shape)} on {table.device}: use the table the stash was made with "
            f"(psf.stash_slot)")
