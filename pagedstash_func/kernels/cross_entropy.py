"""Cross-entropy of rows of logits and its gradient in the logits, in two passes over each row.

For a chunk of ``c`` rows of logits ``[c, V]`` (the LM head's output, in the weight's dtype)
and their targets: each row's loss ``logsumexp(x) - x[target]`` (0 where the target is
``-100``) and the gradient ``(softmax(x) - onehot(target)) * scale`` (0 on such rows), in the
logits' dtype, with everything computed in fp32. The torch twin takes eight elementwise passes
over an fp32 copy of the logits (at a 152k vocabulary and 883 rows, about 4.5 GB of memory
traffic a chunk); the kernel reads the low-precision logits twice (a running max and sum for
``logsumexp``, then the gradient) and writes the gradient once.

Order as in the Triton tutorials: the torch twin, the kernel, the launcher, the
``torch.library`` op. One program a row; no atomics: the row's sums have a fixed order.
"""

from __future__ import annotations

import torch

from ._backend import resolve_backend
from ._triton import tl, triton

IGNORE = -100

# ----------------------------------------------------------------------------- torch twin


def cross_entropy_rows_reference(logits: torch.Tensor, targets: torch.Tensor,
                                 scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss [c] in fp32, grad [c, V] in logits.dtype)``: op for op what the chunked LM
    loss computed (fp64 logits are computed in fp64)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(acc, copy=True)              # the logits themselves are not written
    lse = torch.logsumexp(x, dim=-1)
    ok = targets != IGNORE
    safe = torch.where(ok, targets, 0)
    picked = x.gather(1, safe[:, None])[:, 0]
    loss = torch.where(ok, lse - picked, 0.0)
    probs = torch.exp(x.sub_(lse[:, None]))                       # softmax, in place
    rows = torch.arange(probs.shape[0], device=probs.device)
    probs[rows, safe] = probs[rows, safe] - ok.to(probs.dtype)    # no accumulation
    probs.mul_((ok.to(probs.dtype) * scale.to(acc))[:, None])
    return loss, probs.to(logits.dtype)


# ----------------------------------------------------------------------------- Triton kernel


@triton.jit
def _cross_entropy_rows_kernel(x_ptr, t_ptr, scale_ptr, loss_ptr, g_ptr, width,
                               BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * width
    cols = tl.arange(0, BLOCK)
    # pass 1: a running max and sum of exp (logsumexp), block by block in column order
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(0, width, BLOCK):
        c = start + cols
        x = tl.load(x_ptr + base + c, mask=c < width, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
    lse = m + tl.log(s)
    t = tl.load(t_ptr + row)
    ok = t != -100
    safe = tl.where(ok, t, 0)
    picked = tl.load(x_ptr + base + safe).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(ok, lse - picked, 0.0))
    coef = tl.where(ok, tl.load(scale_ptr).to(tl.float32), 0.0)
    # pass 2: (softmax - onehot) * coef, in the logits' dtype
    for start in range(0, width, BLOCK):
        c = start + cols
        x = tl.load(x_ptr + base + c, mask=c < width, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        p = tl.where(c == safe, p - 1.0, p) * coef
        tl.store(g_ptr + base + c, p.to(g_ptr.dtype.element_ty), mask=c < width)


# ----------------------------------------------------------------------------- launcher


def cross_entropy_rows_triton(logits: torch.Tensor, targets: torch.Tensor,
                              scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel: `cross_entropy_rows_reference`'s outputs, equal to fp32 rounding
    (its sums run in another order)."""
    rows, width = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    grad = torch.empty_like(logits)
    if rows == 0 or width == 0:
        return loss.zero_(), grad
    block = 4096 if logits.device.type == "cuda" else 1024
    _cross_entropy_rows_kernel[(rows,)](logits, targets, scale, loss, grad, width,
                                        BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return loss, grad


def _check(logits, targets, scale):
    if logits.dim() != 2 or targets.shape != logits.shape[:1] or scale.dim() != 0:
        raise ValueError(f"cross_entropy_rows needs logits [c, V], targets [c] and a 0-d "
                         f"scale, got {tuple(logits.shape)}, {tuple(targets.shape)} and "
                         f"{tuple(scale.shape)}")
    if not logits.is_contiguous():
        raise ValueError("logits must be contiguous: pass logits.contiguous()")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    if targets.device != logits.device or scale.device != logits.device:
        raise ValueError("logits, targets and scale must be on one device")


# ----------------------------------------------------------------------------- torch.library op


@torch.library.custom_op("pagedstash_func::cross_entropy_rows", mutates_args=())
def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                       backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss [c] fp32, grad [c, V])`` of ``logits [c, V]`` (contiguous; bf16, fp16 or fp32:
    fp64 runs the twin) against ``targets [c]`` (int64 or int32, ``-100``: no target), the gradient
    times ``scale`` (0-d), in the logits' dtype; all on one device."""
    _check(logits, targets, scale)
    if logits.dtype == torch.float64 or resolve_backend(backend, logits.device) == "torch":
        return cross_entropy_rows_reference(logits, targets, scale)
    return cross_entropy_rows_triton(logits, targets, scale)


@cross_entropy_rows.register_fake
def _(logits, targets, scale, backend="auto"):
    acc = torch.promote_types(logits.dtype, torch.float32)
    return logits.new_empty(logits.shape[0], dtype=acc), torch.empty_like(logits)
