"""Row gather: fill the valid rows of a capacity buffer, ``out[r] = src[index[r]]`` for ``r < n``.

Order as in the Triton tutorials: the pure-torch twin, the kernel, the launcher, then the
``torch.library`` op. ``n`` is a one-element device tensor that the Triton path never reads on
the host; rows ``>= n`` of ``out`` are left unwritten, because every consumer (the grouped GEMMs
and their weight gradients) reads only rows inside the expert groups, which end at
``offs[-1] = n``. ``index_select`` over the whole buffer would also copy the ``C - n`` rows
nobody reads: at capacity factor 1.25 a fifth of the bytes, more with padding tokens.
Bytes: reads and writes ``n * H`` (plus ``n`` indices).
"""

from __future__ import annotations

import torch

from ._triton import triton, tl
from ._backend import resolve_backend
from ._pagestack import check_count

# ----------------------------------------------------------------------------- torch twin


def gather_rows_reference(src: torch.Tensor, index: torch.Tensor,
                          n_valid: torch.Tensor) -> torch.Tensor:
    """Pure-torch twin of the kernel: ``[C, H]``, rows ``>= n`` not gathered (reads ``n`` on
    the host: fine for the twin only).

    Where the kernel leaves those rows unwritten, the twin fills floating-point ones with NaN,
    so that a consumer that reads past ``n`` turns every CPU test of it red instead of passing
    on whatever memory held.
    """
    capacity = index.shape[0]
    n = min(max(int(n_valid.reshape(-1)[0]), 0), capacity)
    out = src.new_empty(capacity, src.shape[1])
    if out.dtype.is_floating_point:
        out[n:] = float("nan")
    picked = index[:n].to(torch.int64)
    inside = (picked >= 0) & (picked < src.shape[0])
    rows = src.index_select(0, torch.where(inside, picked, 0)) if src.shape[0] else \
        src.new_zeros(n, src.shape[1])
    out[:n] = torch.where(inside[:, None], rows, torch.zeros((), dtype=src.dtype,
                                                             device=src.device))
    return out


# ----------------------------------------------------------------------------- Triton kernel


@triton.jit
def _gather_rows_kernel(
    src_ptr, idx_ptr, n_ptr, out_ptr,
    src_rows, capacity, width,
    stride_src, stride_out,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # Row blocks run along grid axis 0 (up to 2**31 - 1 programs; axis 1 stops at 65535). A
    # block at or past n returns before loading anything, so the launch never needs n on the
    # host and the rows past n cost nothing.
    n = tl.minimum(tl.maximum(tl.load(n_ptr), 0), capacity)
    first = tl.program_id(0) * BLOCK_R
    if first < n:
        rows = first + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = rows < n
        # int64 offsets: T * H and C * H pass 2**31 elements on large buffers.
        src_row = tl.load(idx_ptr + rows, mask=ok, other=0).to(tl.int64)
        inside = (src_row >= 0) & (src_row < src_rows)     # an index off the source: zeros
        m = ok[:, None] & (cols < width)[None, :]
        x = tl.load(src_ptr + src_row[:, None] * stride_src + cols[None, :],
                    mask=m & inside[:, None], other=0)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], x, mask=m)


# ----------------------------------------------------------------------------- launcher

# (BLOCK_R, BLOCK_H, num_warps): one row and 2048 columns a program, as in gather_sum (each
# gathered row a contiguous 4 KiB run of bf16; the grid fills the SMs).
_CUDA = (1, 2048, 4)
_CPU = (8, 128, 4)      # interpreter: fewer, larger programs keep tests fast


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def gather_rows_triton(src: torch.Tensor, index: torch.Tensor, n_valid: torch.Tensor,
                       block_r: int = 0, block_h: int = 0, num_warps: int = 0) -> torch.Tensor:
    """Launch the kernel once; the block sizes and warps override the default if > 0."""
    capacity, width = index.shape[0], src.shape[1]
    if src.shape[0] and src.stride(1) != 1:     # rows may be strided, columns must not
        src = src.contiguous()
    out = src.new_empty(capacity, width)
    if capacity == 0 or width == 0:
        return out
    auto_r, auto_h, auto_w = _CUDA if src.device.type == "cuda" else _CPU
    br = _next_pow2(block_r) if block_r > 0 else auto_r
    bh = _next_pow2(block_h) if block_h > 0 else min(auto_h, max(16, _next_pow2(width)))
    grid = (triton.cdiv(capacity, br), triton.cdiv(width, bh))
    _gather_rows_kernel[grid](
        src, index, n_valid, out,
        src.shape[0], capacity, width,
        src.stride(0), out.stride(0),
        BLOCK_R=br, BLOCK_H=bh, num_warps=num_warps if num_warps > 0 else auto_w,
    )
    return out


def check_gather_rows_args(src: torch.Tensor, index: torch.Tensor,
                           n_valid: torch.Tensor) -> None:
    """ValueError, naming the fix, unless the arguments fit the kernel."""
    if src.dim() != 2:
        raise ValueError(f"src must be [T, H], got {tuple(src.shape)}")
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index must be a [C] int32 or int64 tensor, got {tuple(index.shape)} "
                         f"{index.dtype}: pass index.reshape(-1).long()")
    if src.dtype.is_complex:
        raise ValueError(f"src must be real, got {src.dtype}")
    check_count(n_valid, "n_valid", src.device)
    if index.device != src.device:
        raise ValueError(f"index is on {index.device} but src on {src.device}: pass "
                         f"index.to(src.device)")
    if not index.is_contiguous():
        raise ValueError("index must be contiguous: pass index.contiguous()")


# ----------------------------------------------------------------------------- torch.library op


@torch.library.custom_op("pagedstash_func::gather_rows", mutates_args=())
def gather_rows(src: torch.Tensor, index: torch.Tensor, n_valid: torch.Tensor,
                backend: str = "auto", after: torch.Tensor | None = None) -> torch.Tensor:
    """``out [C, H]`` with ``out[r] = src[index[r]]`` for ``r < n_valid``; rows past it are not
    written (for consumers that read only rows below ``n``). A row whose index lies outside
    ``[0, T)`` gets zeros (it is not checked on the host: that would need the index there).
    ``after``: a tensor this gather must follow, never read: in a compiled backward, what keeps
    a gather that needs no gradient from being moved into the forward graph and its ``[C, H]``
    output saved (`stash_release` says why)."""
    check_gather_rows_args(src, index, n_valid)
    if resolve_backend(backend, src.device) == "torch":
        return gather_rows_reference(src, index, n_valid)
    return gather_rows_triton(src, index, n_valid)


@gather_rows.register_fake
def _(src, index, n_valid, backend="auto", after=None):
    return src.new_empty(index.shape[0], src.shape[1])
