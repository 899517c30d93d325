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
    bad = ok & ((targets < 0) | (targets >= x.shape[1]))     # no such token: NaN, no read
    safe = torch.where(ok & ~bad, targets, 0)
    picked = x.gather(1, safe[:, None])[:, 0]
    loss = torch.where(ok, lse - picked, 0.0).masked_fill(bad, float("nan"))
    probs = torch.exp(x.sub_(lse[:, None]))                       # softmax, in place
    rows = torch.arange(probs.shape[0], device=probs.device)
    probs[rows, safe] = probs[rows, safe] - ok.to(probs.dtype)    # no accumulation
    probs.mul_((ok.to(probs.dtype) * scale.to(acc))[:, None])
    probs[bad] = float("nan")
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
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)   # -inf so far: nothing summed
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = new_m
    lse = m + tl.log(s)
    t = tl.load(t_ptr + row)
    ok = t != -100
    bad = ok & ((t < 0) | (t >= width))          # no such token: NaN, and nothing read there
    safe = tl.where(ok & (t >= 0) & (t < width), t, 0)
    picked = tl.load(x_ptr + base + safe).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(bad, float("nan"), tl.where(ok, lse - picked, 0.0)))
    coef = tl.where(bad, float("nan"), tl.where(ok, tl.load(scale_ptr).to(tl.float32), 0.0))
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
    if rows == 0:
        return loss, grad
    targets = targets.contiguous()
    block = 4096 if logits.device.type == "cuda" else 1024
    _cross_entropy_rows_kernel[(rows,)](logits, targets, scale, loss, grad, width,
                                        BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return loss, grad


def _check(logits, targets, scale):
    if logits.dim() != 2 or targets.shape != logits.shape[:1] or scale.dim() != 0 \
            or logits.shape[1] == 0:
        raise ValueError(f"cross_entropy_rows needs logits [c, V] (V > 0), targets [c] and a "
                         f"0-d scale, got {tuple(logits.shape)}, {tuple(targets.shape)} and "
                         f"{tuple(scale.shape)}")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError(f"logits must be bf16, fp16, fp32 or fp64, got {logits.dtype}")
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
    """``(loss [c], grad [c, V])`` of ``logits [c, V]`` (contiguous; bf16, fp16 or fp32, or
    fp64, which runs the twin) against ``targets [c]`` (int64 or int32; ``-100``: no target,
    loss and gradient 0), the gradient times ``scale`` (0-d) in the logits' dtype, the loss in
    fp32 (fp64 for fp64 logits); all on one device. A target outside ``[0, V)`` other than
    ``-100`` names no token: its row's loss and gradient are NaN (checked on the device, no
    host read), so the step's loss is NaN."""
    _check(logits, targets, scale)
    if logits.dtype == torch.float64 or resolve_backend(backend, logits.device) == "torch":
        return cross_entropy_rows_reference(logits, targets, scale)
    return cross_entropy_rows_triton(logits, targets, scale)


@cross_entropy_rows.register_fake
def _(logits, targets, scale, backend="auto"):
    acc = torch.promote_types(logits.dtype, torch.float32)
    return logits.new_empty(logits.shape[0], dtype=acc), torch.empty_like(logits)
