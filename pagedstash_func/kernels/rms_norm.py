"""RMSNorm as transformers' Llama-family models compute it, forward and backward in one pass each.

``y = w * cast(x * rsqrt(mean(x^2) + eps))``, the mean and the product in fp32 and ``cast``
back to ``x``'s dtype (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3 norms). transformers' module
keeps the fp32 copy of ``x`` and the fp32 normalised rows for backward (two fp32 tensors the
size of ``x``, six elementwise kernels each way); this keeps nothing but ``rstd`` (``[T]``
fp32) beside ``x`` (which backward reads anyway) and recomputes the normalised rows.

Order as in the Triton tutorials: the pure-torch twins, the kernels, the launchers, then the
``torch.library`` ops. Backward's weight gradient is summed per program into a fixed
``[P, H]`` buffer of partial sums, then over ``P`` by ``torch.sum``: a fixed order, no atomics.
Bytes: forward reads ``x`` and writes ``y`` (plus ``T`` floats); backward reads ``x``, ``dy``,
writes ``dx``.
"""

from __future__ import annotations

import torch

from ._triton import triton, tl
from ._backend import resolve_backend

# ----------------------------------------------------------------------------- torch twins


def rms_norm_forward_reference(x: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [T, H] in x.dtype, rstd [T] fp32)``: transformers' formula, op for op."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return weight * (xf * rstd[:, None]).to(x.dtype), rstd


def rms_norm_backward_reference(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx [T, H] in x.dtype, dw [H] in weight.dtype)`` from the saved ``rstd``: with
    ``xh = x * rstd`` and ``g = dy * w`` (fp32), ``dx = rstd * (g - xh * mean(g * xh))``
    and ``dw = sum over rows of dy * cast(xh)``."""
    xf = x.float()
    xh = xf * rstd[:, None]
    g = dy.float() * weight.float()
    dx = rstd[:, None] * (g - xh * (g * xh).mean(-1, keepdim=True))
    dw = (dy.float() * xh.to(x.dtype).float()).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


# ----------------------------------------------------------------------------- Triton kernels


@triton.jit
def _rms_norm_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, rows, width, eps,
                             BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_H)
    ok_r, ok_c = r < rows, c < width
    m = ok_r[:, None] & ok_c[None, :]
    at = r.to(tl.int64)[:, None] * width + c[None, :]
    x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / width + eps)
    w = tl.load(w_ptr + c, mask=ok_c, other=0.0).to(tl.float32)
    xh = (x * rstd[:, None]).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + at, (w[None, :] * xh).to(y_ptr.dtype.element_ty), mask=m)
    tl.store(rstd_ptr + r, rstd, mask=ok_r)


@triton.jit
def _rms_norm_backward_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, rows, width,
                              rows_per_program,
                              BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    # Program p handles rows [p * rows_per_program, (p + 1) * rows_per_program), BLOCK_R at a
    # time in order, and writes its partial weight gradient to row p of dw: the sum over the
    # programs happens afterwards, in a fixed order.
    p = tl.program_id(0)
    c = tl.arange(0, BLOCK_H)
    ok_c = c < width
    w = tl.load(w_ptr + c, mask=ok_c, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    first = p * rows_per_program
    for start in range(first, first + rows_per_program, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        ok_r = (r < rows) & (r < first + rows_per_program)
        m = ok_r[:, None] & ok_c[None, :]
        at = r.to(tl.int64)[:, None] * width + c[None, :]
        x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + at, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=ok_r, other=0.0)
        xh = x * rstd[:, None]
        g = dy * w[None, :]
        dot = tl.sum(g * xh, axis=1) / width
        dx = rstd[:, None] * (g - xh * dot[:, None])
        tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=m)
        dw += tl.sum(dy * xh.to(x_ptr.dtype.element_ty).to(tl.float32), axis=0)
    tl.store(dw_ptr + p.to(tl.int64) * width + c, dw, mask=ok_c)


# ----------------------------------------------------------------------------- launchers


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _blocks(width: int, device) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_H, warps)``: a whole row per program row (``BLOCK_H`` its width
    rounded up), as many rows as keep about 4096 elements a program (16 on the CPU)."""
    bh = max(16, _next_pow2(width))
    per = 4096 if device.type == "cuda" else 16384
    br = max(1, min(64, per // bh))
    return br, bh, 8 if bh >= 4096 else 4


def rms_norm_forward_triton(x: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel: ``(y, rstd)`` as `rms_norm_forward_reference` returns them
    (equal to fp32 rounding: the sum of squares is reduced in another order)."""
    rows, width = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return y, rstd
    br, bh, warps = _blocks(width, x.device)
    _rms_norm_forward_kernel[(triton.cdiv(rows, br),)](
        x, weight, y, rstd, rows, width, eps, BLOCK_R=br, BLOCK_H=bh, num_warps=warps)
    return y, rstd


def rms_norm_backward_triton(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                             rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel: ``(dx, dw)`` as `rms_norm_backward_reference` returns them
    (equal to fp32 rounding), ``dw`` summed over a fixed number of partial sums."""
    rows, width = x.shape
    dx = torch.empty_like(x)
    if rows == 0:
        return dx, torch.zeros_like(weight)
    br, bh, warps = _blocks(width, x.device)
    programs = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count \
        if x.device.type == "cuda" else 4
    per_program = triton.cdiv(triton.cdiv(rows, programs), br) * br
    programs = triton.cdiv(rows, per_program)
    partial = torch.empty(programs, width, dtype=torch.float32, device=x.device)
    _rms_norm_backward_kernel[(programs,)](
        dy, x, weight, rstd, dx, partial, rows, width, per_program,
        BLOCK_R=br, BLOCK_H=bh, num_warps=warps)
    return dx, partial.sum(0).to(weight.dtype)


def _check(x, weight):
    if x.dim() != 2 or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"rms_norm needs x [T, H] and weight [H], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous: pass x.contiguous()")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x on {x.device}")


# ----------------------------------------------------------------------------- torch.library ops


@torch.library.custom_op("pagedstash_func::rms_norm_forward", mutates_args=())
def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [T, H], rstd [T] fp32)`` of ``x [T, H]`` (contiguous) and ``weight [H]``."""
    _check(x, weight)
    if resolve_backend(backend, x.device) == "torch":
        return rms_norm_forward_reference(x, weight, eps)
    return rms_norm_forward_triton(x, weight.contiguous(), eps)


@rms_norm_forward.register_fake
def _(x, weight, eps, backend="auto"):
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("pagedstash_func::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor,
                      backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx [T, H], dw [H])`` from ``dy``, the forward's ``x``, ``weight`` and ``rstd``."""
    _check(x, weight)
    if dy.shape != x.shape:
        raise ValueError(f"dy {tuple(dy.shape)} must have x's shape {tuple(x.shape)}")
    if resolve_backend(backend, x.device) == "torch":
        return rms_norm_backward_reference(dy, x, weight, rstd)
    return rms_norm_backward_triton(dy.contiguous(), x, weight.contiguous(), rstd)


@rms_norm_backward.register_fake
def _(dy, x, weight, rstd, backend="auto"):
    return torch.empty_like(x), torch.empty_like(weight)
