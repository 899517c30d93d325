"""`rms_norm`: transformers' RMSNorm as a function, keeping one fp32 scale per row for backward.

transformers' module (``y = w * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``) keeps the
fp32 copy of ``x`` and the fp32 normalised rows for backward: at the OLMoE shape
(T = 16384, H = 2048, 33 norms) 14 GB of a step's peak. This keeps ``x`` (which the norm's
caller keeps anyway, as the residual) and ``rstd`` ``[T]``, and recomputes the rest in one
backward kernel.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..core._function import active_transforms, fast_apply

__all__ = ["rms_norm"]


@fast_apply
class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(x, weight, eps, backend):
        return kernels.rms_norm_forward(x, weight, eps, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, _, backend = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.backend = backend
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, dy, _):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _RMSNormBackward.apply(dy, x, weight, rstd, ctx.backend)
        return dx, dw, None, None



@fast_apply
class _RMSNormBackward(torch.autograd.Function):
    """The first-order backward as a function of its own, so that ``torch.func.grad`` (which
    runs backward under its transform) composes, and a second derivative raises instead of
    silently giving zeros."""

    @staticmethod
    def forward(dy, x, weight, rstd, backend):
        return kernels.rms_norm_backward(dy, x, weight, rstd, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError("psf.rms_norm is first-order: a second derivative through "
                                  "it is not computed")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             backend: str = "auto") -> torch.Tensor:
    """transformers' RMSNorm as a function: ``w * cast(x * rsqrt(mean(x^2, -1) + eps))``.

    The mean and the product are computed in fp32, ``cast`` back to ``x.dtype``, as
    transformers' Mixtral, Qwen2/3-MoE, OLMoE and DeepSeek-V3 norms compute it (equal to fp32
    rounding before the casts: the Triton kernel's bf16 output may differ by a few bf16 ulps,
    up to 3 seen; the torch twin is op for op). Backward keeps ``x`` and one fp32 scale per
    row, not transformers' two fp32 copies of the rows. Composes with ``torch.func.grad`` and
    `psf.value_and_grad`; first-order.

    Args:
        x: ``[..., H]``, the rows to normalise; ``H`` must be at least 1.
        weight: ``[H]``, the norm's weight (in ``x``'s dtype for the fused kernels; another
            dtype runs the formula in plain torch ops).
        eps: added to the mean of squares.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``, as `StashConfig` takes it.

    Returns:
        ``[..., H]``, shaped like ``x``, in ``x``'s dtype (the promoted dtype for a weight of
            another dtype).

    Raises:
        TypeError: ``x`` or ``weight`` is not a tensor.
        ValueError: the shapes are not ``[..., H]`` and ``[H]``, or ``H`` is 0.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("rms_norm needs tensors x [..., H] and weight [H]")
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0] or not x.shape[-1]:
        raise ValueError(f"rms_norm needs x [..., H] and weight [H], got {list(x.shape)} and "
                         f"{list(weight.shape)}")
    if weight.dtype != x.dtype:            # mixed: y takes the promoted dtype; as written
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if active_transforms(closed_over=True)[0]:     # torch vmaps the Function either way
        raise NotImplementedError("psf.rms_norm does not support vmap: call it on the whole "
                                  "batch (it normalises each row of x [..., H] already)")
    y, _ = _RMSNorm.apply(x.reshape(-1, x.shape[-1]).contiguous(), weight, float(eps),
                          backend)
    return y.reshape(x.shape)
