"""Stash reserve: take the pages for ``n`` rows off the free stacks without copying anything.

For a producer that writes its rows into pages itself (`swiglu.swiglu_forward_stash` writes
the ``gate_up`` rows it reads), so the rows are read once instead of twice. The allocation is
exactly the stash copy's, from the same `_pagestack` pieces (`plan_k`, `record_pages_k`,
`publish_k`; twin `take_pages_reference`): the same pages in the same table slots, the same
cursors and flags; only the copy is left to the producer, which finds each row's page at
``table[HEADER + row // page_size]``.

One program: a thousand page ids or so (65536 rows in pages of 64), moved in one step, so
nothing in it waits for another program and the launch costs what any launch costs. Order as
in the Triton tutorials: twin, kernel (shared with `stash_copy`, in `_pagestack`), op.
"""

from __future__ import annotations

import torch

from ._backend import resolve_backend
from ._pagestack import (
    check_pool_args, check_table, reserve_pages_triton, take_pages_reference,
)

# ----------------------------------------------------------------------------- torch twins


def stash_reserve_reference(n_rows: torch.Tensor, table: torch.Tensor, cuda_pool: torch.Tensor,
                            free_pages: torch.Tensor, cursors: torch.Tensor, flags: torch.Tensor,
                            capacity: int, page_size: int) -> None:
    """Pure-torch twin of the reserve kernel: `stash_copy_reference`'s bookkeeping alone."""
    take_pages_reference(n_rows, table, cuda_pool, free_pages, cursors, flags, capacity,
                         page_size)


# ----------------------------------------------------------------------------- Triton kernel

# The kernel and its launcher live in `_pagestack` (`reserve_pages_triton`): the stash copy
# launches the same bookkeeping before its page writer.
stash_reserve_triton = reserve_pages_triton


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
