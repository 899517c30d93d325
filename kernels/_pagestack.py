"""The free-page stacks and pool addressing that the stash and pop kernels share.

A pool's ``free_pages`` holds two stacks side by side (see `_layout`): CUDA page ids in
``[0, cuda_pages)`` with ``ctop`` of them free, host page ids after them with ``htop`` free.
A stash takes its pages off the top of the CUDA stack, then off the host stack; a pop pushes
them back in the reverse order, so a stash followed by its pop leaves both stacks as they were.
The slot formulas are written here once as Triton functions (for the kernels) and once as
plain Python (for the torch twins), side by side so that they cannot drift apart.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _layout as L

IDS_BLOCK = 256   # page ids copied per step when a kernel writes or reads a table


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


# ----------------------------------------------------------------------------- kernel helpers


@triton.jit
def load_cursors(cur_ptr):
    """Free CUDA pages and free host pages, as they were when the launch began."""
    return tl.load(cur_ptr + L.CUDA_FREE_K), tl.load(cur_ptr + L.HOST_FREE_K)


@triton.jit
def is_last_program(cur_ptr):
    """Take a ticket; true for the one program that finishes last.

    Every program plans from the cursors as they were at launch; only the last one may publish
    new cursors (and must then call `reset_ticket`), so no program reads a cursor that this
    launch already moved. The ticket is the only atomic: it orders bookkeeping, never data.
    """
    ticket = tl.atomic_add(cur_ptr + L.TICKET_K, 1, sem="acq_rel")
    return ticket == tl.num_programs(0) - 1


@triton.jit
def reset_ticket(cur_ptr):
    tl.store(cur_ptr + L.TICKET_K, 0)


@triton.jit
def pool_tile(cuda_ptr, host_ptr, page, cuda_pages, page_elems, offset):
    """Pointer to element ``offset`` of pool page ``page``: CUDA pool below ``cuda_pages``."""
    if page < cuda_pages:
        ptr = cuda_ptr + page * page_elems + offset
    else:
        ptr = host_ptr + (page - cuda_pages) * page_elems + offset
    return ptr


# ----------------------------------------------------------------------------- launcher helpers


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def grid_size(capacity: int, width: int, page_size: int, block: int, programs: int) -> int:
    """Programs for the largest possible copy (``n = capacity``), capped at ``programs``."""
    tiles = cdiv(capacity, page_size) * cdiv(page_size * width, block)
    return max(1, min(programs, tiles))


def check_pool_args(src_or_width, cuda_pool, host_pool, free_pages, cursors, page_size):
    """`ValueError` for pool arguments the kernels cannot use (shapes, dtypes, contiguity)."""
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
