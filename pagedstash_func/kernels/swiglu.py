"""SwiGLU of the grouped MoE experts, forward and backward, on the valid rows of a row buffer.

Order as in the Triton tutorials: the pure-torch twins, the kernels, the launchers, then the
``torch.library`` ops. A buffer holds ``C`` rows (the expert capacity) of which only the first
``n`` are valid; ``n`` is a one-element device tensor that the Triton path never reads on the
host. Rows ``>= n`` may hold anything (NaN and inf included) and are never read.

Per valid row ``r``, with gate ``g = gate_up[r, :F]``, up ``u = gate_up[r, F:]`` and routing
weight ``w[r]``, computed in fp32 (fp64 for fp64 activations) and rounded once::

    s = sigmoid(g);  a = g * s * u  (= silu(g) * u);  z = a * w[r]
    d_w[r] = sum_f dz * a;  d_act = dz * w[r]
    d_g = d_act * u * s * (1 + g * (1 - s));  d_u = d_act * g * s

Rows ``>= n`` of ``z`` and ``d_gate_up`` are left unwritten (whatever ``torch.empty`` gave):
every consumer, the grouped GEMMs, reads only rows below ``n``. ``d_w`` is written over all
``C`` rows, zero past ``n``: it is small and its consumer gathers it by index.

Fused with the stash (one constexpr, ``PAGED``, of the same two kernels, so the numbers are the
same bits): `swiglu_forward_stash` also writes the ``gate_up`` rows it reads into pages reserved
by `stash_reserve`, and `swiglu_backward_paged` reads them from the pages. A stashed ``gate_up``
then costs one write and one read of its valid rows, instead of a copy each way (read + write)
plus a popped buffer of ``n`` rows written and read again.
"""

from __future__ import annotations

import torch

from ._triton import triton, tl
from . import _layout as L
from ._backend import resolve_backend
from ._pagestack import (
    check_count, check_table, read_held_rows_reference, write_held_rows_reference,
)

# ----------------------------------------------------------------------------- torch twins


def _valid_rows(n_valid: torch.Tensor, capacity: int) -> int:
    """``n`` clamped to ``[0, capacity]`` (read on the host: fine for the twin only)."""
    return min(max(int(n_valid.reshape(-1)[0]), 0), capacity)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """Register dtype: fp32, or fp64 for fp64 activations."""
    return torch.promote_types(dtype, torch.float32)


def _silu_mul_reference(g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, a): one helper for forward and backward, so both compute ``a`` in the same order."""
    s = torch.sigmoid(g)
    return s, g * s * u


def swiglu_forward_reference(gate_up: torch.Tensor, w: torch.Tensor,
                             n_valid: torch.Tensor) -> torch.Tensor:
    """Pure-torch twin of the forward kernel: ``z [C, F]``, rows ``>= n`` left unwritten.

    Bytes: reads ``n * 2F`` activations and ``n`` weights, writes ``n * F``. Agrees with the
    kernel to floating-point tolerance, not bit for bit (sigmoid is computed differently).
    """
    capacity, width = gate_up.shape[0], gate_up.shape[1] // 2
    n = _valid_rows(n_valid, capacity)
    wide = _wide(gate_up.dtype)
    z = gate_up.new_empty(capacity, width)
    g = gate_up[:n, :width].to(wide)
    u = gate_up[:n, width:].to(wide)
    _, a = _silu_mul_reference(g, u)
    z[:n] = (a * w[:n].to(wide)[:, None]).to(z.dtype)
    return z


def swiglu_backward_reference(gate_up: torch.Tensor, dz: torch.Tensor, w: torch.Tensor,
                              n_valid: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch twin of the backward kernel: ``(d_gate_up [C, 2F], z [C, F], d_w [C])``.

    ``z`` is recomputed exactly as :func:`swiglu_forward_reference` computes it (bit for bit).
    Rows ``>= n`` of ``d_gate_up`` and ``z`` are left unwritten; ``d_w`` is zero there.
    Bytes: reads ``n * (2F + F)`` and ``n`` weights, writes ``n * (2F + F)`` and ``C`` weights.
    Agrees with the kernel to floating-point tolerance: the kernel sums ``d_w`` in BLOCK_F
    chunks, torch in its own order.
    """
    capacity, width = gate_up.shape[0], gate_up.shape[1] // 2
    n = _valid_rows(n_valid, capacity)
    wide = _wide(gate_up.dtype)
    d_gate_up = gate_up.new_empty(capacity, 2 * width)
    z = gate_up.new_empty(capacity, width)
    d_w = w.new_empty(capacity)
    g = gate_up[:n, :width].to(wide)
    u = gate_up[:n, width:].to(wide)
    dzw = dz[:n].to(wide)
    ww = w[:n].to(wide)[:, None]
    s, a = _silu_mul_reference(g, u)
    z[:n] = (a * ww).to(z.dtype)
    d_w[:n] = (dzw * a).sum(1).to(d_w.dtype)
    d_w[n:] = 0
    d_act = dzw * ww
    d_gate_up[:n, :width] = (d_act * u * s * (1 + g * (1 - s))).to(d_gate_up.dtype)
    d_gate_up[:n, width:] = (d_act * g * s).to(d_gate_up.dtype)
    return d_gate_up, z, d_w


def swiglu_forward_stash_reference(gate_up: torch.Tensor, w: torch.Tensor,
                                   n_valid: torch.Tensor, table: torch.Tensor,
                                   cuda_pool: torch.Tensor, host_pool: torch.Tensor,
                                   page_size: int) -> torch.Tensor:
    """Twin of the forward kernel that also stashes: `swiglu_forward_reference`, and rows
    ``[0, n)`` of ``gate_up`` copied into the pages the table holds (as `stash_copy` would)."""
    z = swiglu_forward_reference(gate_up, w, n_valid)
    n = _valid_rows(n_valid, gate_up.shape[0])
    write_held_rows_reference(gate_up[:n], table, cuda_pool, host_pool, page_size)
    return z


def swiglu_backward_paged_reference(table: torch.Tensor, cuda_pool: torch.Tensor,
                                    host_pool: torch.Tensor, dz: torch.Tensor, w: torch.Tensor,
                                    n_valid: torch.Tensor, page_size: int
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of the backward kernel reading ``gate_up`` from pages: the held rows (zeros where
    the table holds nothing), then `swiglu_backward_reference`. The pages stay held."""
    gate_up = read_held_rows_reference(table, cuda_pool, host_pool, dz.shape[0], page_size)
    return swiglu_backward_reference(gate_up, dz, w, n_valid)


# ----------------------------------------------------------------------------- Triton kernels


@triton.jit
def _silu_mul(g, u):
    """(s, a) in the registers' dtype; one helper so forward and backward round alike."""
    s = 1.0 / (1.0 + tl.exp(-g))
    return s, g * s * u


@triton.jit
def _row_block(n_ptr, w_ptr, capacity, width, BLOCK_R: tl.constexpr, WIDE: tl.constexpr):
    """This program's rows, which of them are valid, the column-loop end, their weights.

    A block at or past n gets an empty column range, so it reads nothing (the tail may be
    NaN) and the launch never needs n on the host.
    """
    n = tl.minimum(tl.maximum(tl.load(n_ptr), 0), capacity)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n
    f_end = tl.where(tl.program_id(0) * BLOCK_R < n, width, 0)
    w = tl.load(w_ptr + rows, mask=row_ok, other=0).to(WIDE)
    return rows, row_ok, f_end, w


@triton.jit
def _page_rows(table_ptr, cuda_ptr, host_ptr, rows, cuda_pages, pool_pages, page_size,
               row_elems):
    """``([BLOCK_R, 1] pointers, [BLOCK_R] held)``: where buffer rows ``rows`` live in the
    pages of a table (`_layout`), and which of them the table holds. A page id outside the
    pools (a table from other pools, or another page size) counts as not held: never touched."""
    held_rows = tl.load(table_ptr + L.ROWS_K + rows * 0)     # -1 when nothing is held
    held = rows < held_rows
    page = tl.load(table_ptr + L.HEADER_K + rows // page_size, mask=held, other=0).to(tl.int64)
    held = held & (page >= 0) & (page < pool_pages)
    at = page * page_size + (rows % page_size)
    ptr = tl.where(page < cuda_pages, cuda_ptr + at * row_elems,
                   host_ptr + (at - cuda_pages * page_size) * row_elems)
    return ptr[:, None], held


@triton.jit
def _swiglu_forward_kernel(
    gu_ptr, w_ptr, n_ptr, z_ptr, table_ptr, cuda_ptr, host_ptr,
    capacity, width, cuda_pages, pool_pages, page_size,
    stride_gu, stride_z,
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr, WIDE: tl.constexpr, PAGED: tl.constexpr,
):
    # PAGED: also write the gate_up rows read here into their pages (reserved beforehand by
    # `stash_reserve`): the stash of gate_up costs a write, not a read and a write.
    rows, row_ok, f_end, w = _row_block(n_ptr, w_ptr, capacity, width, BLOCK_R, WIDE)
    # int64 row offsets: C * 2F can pass 2**31 elements on a large capacity.
    gu_row = gu_ptr + rows.to(tl.int64)[:, None] * stride_gu
    z_row = z_ptr + rows.to(tl.int64)[:, None] * stride_z
    if PAGED:
        page_row, held = _page_rows(table_ptr, cuda_ptr, host_ptr, rows, cuda_pages,
                                    pool_pages, page_size, 2 * width)
    for f0 in range(0, f_end, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        m = row_ok[:, None] & (cols < width)[None, :]
        g_in = tl.load(gu_row + cols[None, :], mask=m, other=0)
        u_in = tl.load(gu_row + width + cols[None, :], mask=m, other=0)
        if PAGED:
            pm = m & held[:, None]
            tl.store(page_row + cols[None, :], g_in, mask=pm)
            tl.store(page_row + width + cols[None, :], u_in, mask=pm)
        _, a = _silu_mul(g_in.to(WIDE), u_in.to(WIDE))
        tl.store(z_row + cols[None, :], (a * w[:, None]).to(z_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_backward_kernel(
    gu_ptr, dz_ptr, w_ptr, n_ptr, dgu_ptr, z_ptr, dw_ptr, table_ptr, cuda_ptr, host_ptr,
    capacity, width, cuda_pages, pool_pages, page_size,
    stride_gu, stride_dz, stride_dgu, stride_z,
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr, WIDE: tl.constexpr, PAGED: tl.constexpr,
):
    # Blocks past n skip the loop but still run to the end: they write d_w = 0 for their rows,
    # so the consumer that gathers d_w by index never meets uninitialised memory.
    # PAGED: gate_up is read from its pages (rows the table does not hold read as zeros, as a
    # pop would give them), so no popped buffer of n rows is written and read again.
    rows, row_ok, f_end, w = _row_block(n_ptr, w_ptr, capacity, width, BLOCK_R, WIDE)
    r64 = rows.to(tl.int64)[:, None]
    if PAGED:
        gu_row, gu_ok = _page_rows(table_ptr, cuda_ptr, host_ptr, rows, cuda_pages,
                                   pool_pages, page_size, 2 * width)
        gu_ok = gu_ok & row_ok
    else:
        gu_row = gu_ptr + r64 * stride_gu
        gu_ok = row_ok
    dz_row = dz_ptr + r64 * stride_dz
    dgu_row = dgu_ptr + r64 * stride_dgu
    z_row = z_ptr + r64 * stride_z
    # One program owns whole rows, so d_w is summed in registers, chunk after chunk in column
    # order: a fixed order, no atomics, the same bits on every run. Masked lanes load zeros
    # (dz = 0 and a = 0 there), so they add exact zeros.
    dw = tl.zeros([BLOCK_R], dtype=WIDE)
    for f0 in range(0, f_end, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        m = row_ok[:, None] & (cols < width)[None, :]
        gm = m & gu_ok[:, None]
        g = tl.load(gu_row + cols[None, :], mask=gm, other=0).to(WIDE)
        u = tl.load(gu_row + width + cols[None, :], mask=gm, other=0).to(WIDE)
        dz = tl.load(dz_row + cols[None, :], mask=m, other=0).to(WIDE)
        s, a = _silu_mul(g, u)
        tl.store(z_row + cols[None, :], (a * w[:, None]).to(z_ptr.dtype.element_ty), mask=m)
        dw += tl.sum(dz * a, axis=1)
        d_act = dz * w[:, None]
        d_g = d_act * u * s * (1 + g * (1 - s))
        d_u = d_act * g * s
        tl.store(dgu_row + cols[None, :], d_g.to(dgu_ptr.dtype.element_ty), mask=m)
        tl.store(dgu_row + width + cols[None, :], d_u.to(dgu_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + rows, dw.to(dw_ptr.dtype.element_ty), mask=rows < capacity)


# ----------------------------------------------------------------------------- launchers

# (BLOCK_R, BLOCK_F, num_warps). Both kernels stream memory: a tile of 1024 elements per
# operand and iteration, few rows per program so the grid fills the SMs (C / BLOCK_R programs)
# and d_w's partial sums stay in registers. Wide experts take wider, shorter tiles. Measured on
# the H200 (bf16, C = 32768, n = 0.9 C; BLOCK_R 1-16, BLOCK_F 128-1024, warps 2-8): these were
# at or within ~3 % of the best found at F = 768, 1408 and 2048 (forward 3.5-4.0 TB/s, backward
# 3.8-4.0 TB/s counting bytes read and written; a device clone 3.8-4.1 TB/s; eager torch's
# silu(g) * u * w forward ~0.7 TB/s).
_CUDA_NARROW = (4, 256, 4)      # F <= 1024
_CUDA_WIDE = (2, 512, 4)        # F > 1024
_CPU = (16, 64, 4)              # interpreter: fewer, larger programs run faster


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _launch(device: torch.device, width: int, block_r: int, block_f: int,
            num_warps: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_F, num_warps); positive arguments override the choice."""
    if device.type == "cuda":
        auto_r, auto_f, auto_w = _CUDA_WIDE if width > 1024 else _CUDA_NARROW
    else:
        auto_r, auto_f, auto_w = _CPU
    auto_f = min(auto_f, max(16, _next_pow2(width)))
    return (_next_pow2(block_r) if block_r > 0 else auto_r,
            _next_pow2(block_f) if block_f > 0 else auto_f,
            num_warps if num_warps > 0 else auto_w)


def _wide_tl(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def swiglu_forward_triton(gate_up: torch.Tensor, w: torch.Tensor, n_valid: torch.Tensor,
                          block_r: int = 0, block_f: int = 0, num_warps: int = 0,
                          pages: tuple | None = None) -> torch.Tensor:
    """Launch the forward kernel once; the block sizes and warps override the default if > 0.

    ``pages = (table, cuda_pool, host_pool, page_size)``: also write the held rows of
    ``gate_up`` into the table's pages (`swiglu_forward_stash`).
    """
    capacity, width = gate_up.shape[0], gate_up.shape[1] // 2
    z = gate_up.new_empty(capacity, width)
    if capacity == 0:
        return z
    br, bf, warps = _launch(gate_up.device, width, block_r, block_f, num_warps)
    table, cuda_pool, host_pool, page_size = pages or (n_valid, gate_up, gate_up, 1)
    grid = (triton.cdiv(capacity, br),)
    _swiglu_forward_kernel[grid](
        gate_up, w, n_valid, z, table, cuda_pool, host_pool,
        capacity, width, cuda_pool.shape[0] // page_size,
        (cuda_pool.shape[0] + host_pool.shape[0]) // page_size, page_size,
        gate_up.stride(0), z.stride(0),
        BLOCK_R=br, BLOCK_F=bf, WIDE=_wide_tl(gate_up.dtype), PAGED=pages is not None,
        num_warps=warps,
    )
    return z


def swiglu_backward_triton(gate_up: torch.Tensor | None, dz: torch.Tensor, w: torch.Tensor,
                           n_valid: torch.Tensor, block_r: int = 0, block_f: int = 0,
                           num_warps: int = 0, pages: tuple | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernel once; the block sizes and warps override the default if > 0.

    ``pages = (table, cuda_pool, host_pool, page_size)``: read ``gate_up``'s rows from the
    table's pages instead (``gate_up`` is then None).
    """
    capacity, width = dz.shape
    d_gate_up = dz.new_empty(capacity, 2 * width)
    z = dz.new_empty(capacity, width)
    d_w = w.new_empty(capacity)
    if capacity == 0:
        return d_gate_up, z, d_w
    br, bf, warps = _launch(dz.device, width, block_r, block_f, num_warps)
    table, cuda_pool, host_pool, page_size = pages or (n_valid, dz, dz, 1)
    gate_up = dz if gate_up is None else gate_up     # never read when the rows are paged
    grid = (triton.cdiv(capacity, br),)
    _swiglu_backward_kernel[grid](
        gate_up, dz, w, n_valid, d_gate_up, z, d_w, table, cuda_pool, host_pool,
        capacity, width, cuda_pool.shape[0] // page_size,
        (cuda_pool.shape[0] + host_pool.shape[0]) // page_size, page_size,
        gate_up.stride(0), dz.stride(0), d_gate_up.stride(0), z.stride(0),
        BLOCK_R=br, BLOCK_F=bf, WIDE=_wide_tl(dz.dtype), PAGED=pages is not None,
        num_warps=warps,
    )
    return d_gate_up, z, d_w


def check_swiglu_args(gate_up: torch.Tensor | None, w: torch.Tensor, n_valid: torch.Tensor,
                      dz: torch.Tensor | None = None) -> None:
    """ValueError, naming the fix, unless the arguments fit the kernels (``gate_up`` is None
    when its rows come from pages: then ``dz`` gives the shape)."""
    if gate_up is None:
        if dz.dim() != 2 or not dz.is_floating_point():
            raise ValueError(f"dz must be a floating-point [C, F], got {tuple(dz.shape)} "
                             f"{dz.dtype}")
        capacity, width, like = dz.shape[0], dz.shape[1], dz
    else:
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(
                f"gate_up must be [C, 2F] (gate columns, then up columns), got "
                f"{tuple(gate_up.shape)}: concatenate gate and up along the last dim")
        if not gate_up.is_floating_point():
            raise ValueError(f"gate_up must be floating point, got {gate_up.dtype}")
        capacity, width, like = gate_up.shape[0], gate_up.shape[1] // 2, gate_up
    if w.dim() != 1 or w.shape[0] != capacity:
        raise ValueError(f"w must be the [C] = [{capacity}] routing weights of the rows, got "
                         f"{tuple(w.shape)}: pass one weight per row of gate_up")
    if not w.is_floating_point():
        raise ValueError(f"w must be floating point, got {w.dtype}: pass w.float()")
    check_count(n_valid, "n_valid", like.device)
    tensors = {"w": w}
    if gate_up is not None:
        tensors["gate_up"] = gate_up
    if dz is not None:
        if dz.shape != (capacity, width):
            raise ValueError(f"dz must be [C, F] = [{capacity}, {width}] like z, got "
                             f"{tuple(dz.shape)}")
        if dz.dtype != like.dtype:
            raise ValueError(f"dz is {dz.dtype} but gate_up is {like.dtype}: pass "
                             "dz.to(gate_up.dtype)")
        tensors["dz"] = dz
    for name, t in tensors.items():
        if t.device != like.device:
            raise ValueError(f"{name} is on {t.device} but gate_up on {like.device}: pass "
                             f"{name}.to({like.device})")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous: pass {name}.contiguous()")


def check_page_args(table: torch.Tensor, cuda_pool: torch.Tensor, host_pool: torch.Tensor,
                    like: torch.Tensor, width: int, page_size: int) -> None:
    """ValueError unless the pools hold rows of ``width`` elements of ``like``'s dtype (the
    gate_up rows), the CUDA pool and table sit on ``like``'s device, and the table can describe
    ``like``'s rows."""
    for name, pool in (("cuda_pool", cuda_pool), ("host_pool", host_pool)):
        if pool.dim() != 2 or pool.shape[1] != width or pool.dtype != like.dtype \
                or not pool.is_contiguous():
            raise ValueError(f"{name} must be contiguous rows of {width} {like.dtype} (the "
                             f"gate_up rows, 2F wide for z and dz F wide), got "
                             f"{tuple(pool.shape)} {pool.dtype}: pass the pool of the stashed "
                             f"name (psf.stash_slot), or check the width of gate_up or dz")
    if page_size < 1 or cuda_pool.shape[0] % page_size:
        raise ValueError(f"page_size {page_size} does not divide the CUDA pool's "
                         f"{cuda_pool.shape[0]} rows: pass the state's page size, and the "
                         f"CUDA pool before the host one")
    if cuda_pool.device != like.device:
        raise ValueError(f"the CUDA pool must be on {like.device}, like the rows")
    check_table(table, like.shape[0], page_size, like.device)


# ----------------------------------------------------------------------------- torch.library ops


@torch.library.custom_op("pagedstash_func::swiglu_forward", mutates_args=())
def swiglu_forward(gate_up: torch.Tensor, w: torch.Tensor, n_valid: torch.Tensor,
                   backend: str = "auto") -> torch.Tensor:
    """``z [C, F] = silu(gate) * up * w`` on the first ``n_valid`` rows of ``gate_up [C, 2F]``.

    Rows ``>= n`` of ``z`` are not written (every consumer reads only rows below ``n``).
    """
    check_swiglu_args(gate_up, w, n_valid)
    if resolve_backend(backend, gate_up.device) == "torch":
        return swiglu_forward_reference(gate_up, w, n_valid)
    return swiglu_forward_triton(gate_up, w, n_valid)


@swiglu_forward.register_fake
def _(gate_up, w, n_valid, backend="auto"):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


@torch.library.custom_op("pagedstash_func::swiglu_backward", mutates_args=())
def swiglu_backward(gate_up: torch.Tensor, dz: torch.Tensor, w: torch.Tensor,
                    n_valid: torch.Tensor, backend: str = "auto"
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_gate_up [C, 2F], z [C, F], d_w [C])`` for ``dz``, the gradient w.r.t. ``z``.

    ``z`` is recomputed bit for bit as :func:`swiglu_forward` gives it on the same backend.
    Rows ``>= n`` of ``d_gate_up`` and ``z`` are not written; ``d_w`` is zero there.
    """
    check_swiglu_args(gate_up, w, n_valid, dz)
    if resolve_backend(backend, gate_up.device) == "torch":
        return swiglu_backward_reference(gate_up, dz, w, n_valid)
    return swiglu_backward_triton(gate_up, dz, w, n_valid)


@swiglu_backward.register_fake
def _(gate_up, dz, w, n_valid, backend="auto"):
    capacity, width = gate_up.shape[0], gate_up.shape[1] // 2
    return (gate_up.new_empty(capacity, 2 * width), gate_up.new_empty(capacity, width),
            w.new_empty(capacity))



@torch.library.custom_op("pagedstash_func::swiglu_forward_stash",
                         mutates_args=("cuda_pool", "host_pool"))
def swiglu_forward_stash(gate_up: torch.Tensor, w: torch.Tensor, n_valid: torch.Tensor,
                         table: torch.Tensor, cuda_pool: torch.Tensor, host_pool: torch.Tensor,
                         page_size: int, backend: str = "auto") -> torch.Tensor:
    """`swiglu_forward` that also writes rows ``[0, n)`` of ``gate_up`` into the pages of
    ``table`` (reserved first with `stash_reserve` for the same ``n_valid``).

    The pages end exactly as `stash_copy` of ``gate_up`` would leave them, for one read of
    ``gate_up`` instead of two. A table that holds nothing (the reserve overflowed) gets no
    rows. Mutates the pools. The table is trusted to come from that reserve: one reserved for
    another ``n`` (or another page size) is not detected on the device; rows it does not hold
    are not written, and page ids outside the pools are never touched.
    """
    check_swiglu_args(gate_up, w, n_valid)
    check_page_args(table, cuda_pool, host_pool, gate_up, gate_up.shape[1], page_size)
    if resolve_backend(backend, gate_up.device) == "torch":
        return swiglu_forward_stash_reference(gate_up, w, n_valid, table, cuda_pool, host_pool,
                                              page_size)
    return swiglu_forward_triton(gate_up, w, n_valid,
                                 pages=(table, cuda_pool, host_pool, page_size))


@swiglu_forward_stash.register_fake
def _(gate_up, w, n_valid, table, cuda_pool, host_pool, page_size, backend="auto"):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


@torch.library.custom_op("pagedstash_func::swiglu_backward_paged", mutates_args=())
def swiglu_backward_paged(table: torch.Tensor, cuda_pool: torch.Tensor, host_pool: torch.Tensor,
                          dz: torch.Tensor, w: torch.Tensor, n_valid: torch.Tensor,
                          page_size: int, backend: str = "auto"
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`swiglu_backward` with ``gate_up`` read from the pages of ``table`` (rows it does not
    hold read as zeros, as a pop gives them). The pages stay held: give them back with
    `stash_release` once nothing else reads them. As with `stash_pop`, a table already given
    back reads as zeros: the layer refuses a second backward on the host before it gets here.
    """
    check_swiglu_args(None, w, n_valid, dz)
    check_page_args(table, cuda_pool, host_pool, dz, 2 * dz.shape[1], page_size)
    if resolve_backend(backend, dz.device) == "torch":
        return swiglu_backward_paged_reference(table, cuda_pool, host_pool, dz, w, n_valid,
                                               page_size)
    return swiglu_backward_triton(None, dz, w, n_valid,
                                  pages=(table, cuda_pool, host_pool, page_size))


@swiglu_backward_paged.register_fake
def _(table, cuda_pool, host_pool, dz, w, n_valid, page_size, backend="auto"):
    capacity, width = dz.shape
    return dz.new_empty(capacity, 2 * width), dz.new_empty(capacity, width), w.new_empty(capacity)
