"""The LM head and its cross-entropy in chunks of rows, so the full logits never exist.

transformers computes ``logits [N, V]`` in the model's dtype, casts them to fp32 and keeps what
the loss backward reads: at a 152k vocabulary and 8192 tokens that is 2.5 GB of bf16 logits
and 5 GB of fp32 ones, twice over in backward. Here each chunk of rows computes its logits,
its loss and (when a gradient is wanted) its gradients in one pass, then frees the logits:
backward only scales the gradients already computed. A chunk's loss and gradient in the
logits are one kernel on CUDA (`cross_entropy_rows`: two passes over the low-precision
logits, no fp32 copy of them). Numerics follow transformers' loss
(logits in the weight's dtype, cross-entropy in fp32, mean over the labels that are not
``-100``), so the loss agrees to fp32 rounding.
"""

from __future__ import annotations

import torch

from ..core._function import active_transforms, fast_apply
from ..kernels._backend import resolve_backend
from ..kernels.cross_entropy import IGNORE, cross_entropy_rows


def chunk_rows(vocab: int) -> int:
    """Rows per chunk: about 128M logits (512 MB in fp32) at once, at least 256 rows."""
    return max(256, (1 << 27) // max(1, vocab))


def lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
            chunk: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, fp32 scalar, with the
    logits made a chunk of rows at a time: they never exist whole, and their gradients are
    computed in the same pass (the loss `from_hf_model` builds; usable in any loss).

    Args:
        hidden: ``[N, H]`` final hidden states (a floating dtype; any device).
        weight: ``[V, H]`` LM head weight, same dtype and device.
        targets: ``[N]`` int64 or int32 token ids, ``-100`` where nothing is predicted. With
            gradients, an id outside ``[0, V)`` makes the loss NaN (checked on the device,
            no host read); without, the gather refuses it.
        chunk: rows per chunk (default: about 128M logits a chunk, at least 256 rows).
        backend: each chunk's cross-entropy with its gradient (`cross_entropy_rows`):
            ``"auto"`` (the Triton kernel on CUDA, its torch twin elsewhere), ``"triton"`` or
            ``"torch"``. Without gradients the loss alone is computed with torch's ops
            whatever the backend.

    Returns:
        ``sum of losses / number of targets that are not -100`` in fp32 (fp64 for fp64
        inputs), NaN when there are none, as transformers gives. Differentiable in ``hidden``
        and ``weight``; first order only.

    Raises:
        ValueError: shapes other than ``[N, H]``, ``[V, H]`` and ``[N]``, ``hidden`` and
            ``weight`` of different or non-floating dtypes, targets not int64 or int32,
            tensors on several devices, ``chunk`` not a positive integer, ``backend`` none
            of the three (or ``"triton"`` where it cannot run).
        RuntimeError: a second derivative (nested ``torch.func.grad``,
            ``create_graph=True``) through the loss.
        NotImplementedError: ``vmap`` or forward-mode AD through it.
    """
    _check_inputs(hidden, weight, targets)
    chunk = chunk_rows(weight.shape[0]) if chunk is None else chunk
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk must be a positive number of rows, got {chunk!r}")
    resolve_backend(backend, hidden.device)        # a bad name refused with or without grads
    # (traced by psf.compile no torch.func transform is active: psf.compile refuses them)
    traced = torch.compiler.is_compiling()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad or (
            not traced and (_wrapped(hidden) or _wrapped(weight)))):
        if not traced and _derivative_levels() > 1:
            raise RuntimeError(SECOND_ORDER.format(what="a second derivative (nested "
                                                        "torch.func.grad, jvp or hessian)"))
        vmap, forward_ad = active_transforms(hidden, weight)
        if forward_ad:
            raise NotImplementedError(SECOND_ORDER.format(what="forward-mode AD"))
        if vmap:
            raise NotImplementedError("the chunked LM loss does not support vmap (nor vmap "
                                      "over its backward: it is differentiable once)")
        return _LMLoss.apply(hidden, weight, targets, chunk, backend)[0]
    return _forward(hidden, weight, targets, chunk, grads=False)[0]


def _check_inputs(hidden, weight, targets) -> None:
    """`ValueError` naming the fix for inputs `lm_loss` would otherwise misread (a targets
    length other than the rows', a batch not flattened, mixed dtypes or devices)."""
    if not all(isinstance(t, torch.Tensor) for t in (hidden, weight, targets)):
        raise ValueError("hidden, weight and targets must be tensors")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"lm_loss takes hidden [N, H] and weight [V, H], got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}: flatten a batch "
                         f"first (hidden.reshape(-1, H), targets.reshape(-1))")
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share one floating dtype, got "
                         f"{hidden.dtype} and {weight.dtype}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], a token id (or -100) "
                         f"for each row of hidden, got {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be int64 or int32 token ids, got {targets.dtype}")
    if not hidden.device == weight.device == targets.device:
        raise ValueError(f"hidden, weight and targets must be on one device, got "
                         f"{hidden.device}, {weight.device} and {targets.device}")


def _derivative_levels() -> int:
    """How many torch.func transforms that differentiate (grad, vjp, jvp) are active."""
    from torch._C._functorch import TransformType
    stack = torch._C._functorch.get_interpreter_stack() or ()
    return sum(i.key() in (TransformType.Grad, TransformType.Jvp) for i in stack)


def _wrapped(t) -> bool:
    """A tensor being differentiated by a ``torch.func`` transform."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def _forward(hidden, weight, targets, chunk, grads: bool, backend: str = "auto"):
    """``(loss, grad_hidden, grad_weight)``, the gradients of the loss itself (None unless
    ``grads``); one chunk's logits at a time."""
    valid = targets != IGNORE
    count = valid.sum()
    acc = torch.promote_types(weight.dtype, torch.float32)      # fp32 (fp64 stays fp64)
    total = hidden.new_zeros((), dtype=acc)
    g_hidden = torch.empty_like(hidden) if grads else None
    g_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if grads else None
    inv = 1.0 / count.clamp_min(1).to(acc)
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start:start + chunk]
        t = targets[start:start + chunk]
        logits = h @ weight.T                                   # [c, V], the weight's dtype
        if grads:       # each row's loss and (softmax - onehot) / count, in two passes a row
            rows, g = cross_entropy_rows(logits, t, inv, backend)
            total = total + rows.to(acc).sum()
            g = g.to(hidden.dtype)
            g_hidden[start:start + chunk] = g @ weight
            g_weight = _accumulate(g_weight, g.T, h)
        else:
            x = logits.to(acc)
            ok = valid[start:start + chunk]
            picked = x.gather(1, torch.where(ok, t, 0)[:, None])[:, 0]
            total = total + torch.where(ok, torch.logsumexp(x, dim=-1) - picked, 0.0).sum()
    loss = total / count.to(acc)
    return loss, g_hidden, g_weight


def _accumulate(acc, a, b):
    """``acc + a @ b`` with ``acc`` in fp32 and ``a``, ``b`` in a lower precision: on CUDA one
    GEMM that writes fp32 (no rounding of each chunk's product, no extra pass over ``acc``)."""
    if acc.dtype != a.dtype and a.is_cuda:
        try:
            return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    return acc.add_((a @ b).to(acc.dtype))


@torch.library.custom_op("pagedstash_func::lm_loss_with_grads", mutates_args=())
def lm_loss_with_grads(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       chunk: int, backend: str = "auto"
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, grad_hidden, grad_weight)`` of `lm_loss`, one chunk of rows at a time.

    An op the compiler keeps whole, so a compiled step runs the same kernels in the same order
    as eager and holds one chunk's logits at a time: traced, the compiler's ``addmm`` takes no
    fp32 output for bf16 operands (fp32 operands would run the head's weight gradient, 2 N V H
    flops, at fp32 GEMM speed), and its scheduler is free to keep several chunks' logits alive.

    Returns:
        the loss (fp32 scalar; fp64 for fp64 inputs), ``grad_hidden`` ``[N, H]`` in
        ``hidden``'s dtype and ``grad_weight`` ``[V, H]`` in ``weight``'s dtype (summed in
        fp32), on ``hidden``'s device.
    """
    loss, g_hidden, g_weight = _forward(hidden, weight, targets, chunk, grads=True,
                                        backend=backend)
    return loss, g_hidden, g_weight.to(weight.dtype)


@lm_loss_with_grads.register_fake
def _(hidden, weight, targets, chunk, backend="auto"):
    acc = torch.promote_types(weight.dtype, torch.float32)
    # the strides the op's own outputs have (empty_like keeps a permuted tensor's strides;
    # the weight's gradient is made contiguous)
    return (hidden.new_empty((), dtype=acc), torch.empty_like(hidden),
            weight.new_empty(weight.shape))


@fast_apply
class _LMLoss(torch.autograd.Function):
    """`lm_loss` with its gradients computed in forward (one pass over the logits); backward
    scales them by the incoming gradient."""

    @staticmethod
    def forward(hidden, weight, targets, chunk, backend):
        # the weight's gradient kept in its dtype through the model's backward (a 152k x 2048
        # head's is 1.2 GB in fp32); the incoming gradient scales it in fp32, one more rounding
        return lm_loss_with_grads(hidden, weight, targets, chunk, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, g_hidden, g_weight = output
        ctx.mark_non_differentiable(g_hidden, g_weight)
        ctx.save_for_backward(g_hidden, g_weight)
        ctx.weight_dtype = inputs[1].dtype

    @staticmethod
    def backward(ctx, grad, _gh, _gw):
        if torch.is_grad_enabled() and torch._C._functorch.maybe_current_level() is None:
            raise RuntimeError(SECOND_ORDER.format(what="a backward with create_graph=True"))
        vmap, forward_ad = active_transforms(grad)
        if vmap or forward_ad:
            raise NotImplementedError(SECOND_ORDER.format(
                what="vmap over its backward" if vmap else "forward-mode AD"))
        g_hidden, g_weight = ctx.saved_tensors
        g_hidden, g_weight = _Scaled.apply(g_hidden, g_weight, grad, ctx.weight_dtype)
        return g_hidden, g_weight, None, None, None


SECOND_ORDER = ("the chunked LM loss is differentiable once (its gradients are computed in "
                "forward), so {what} through it is refused rather than computed wrong: take "
                "first-order gradients, or build the loss with from_hf_model(model, "
                "loss_chunk=None) for transformers' own head and loss")


@fast_apply
class _Scaled(torch.autograd.Function):
    """The kept gradients times the incoming one, multiplied in fp32 and rounded to their
    dtypes; its own derivative is refused (a second derivative would silently be zero)."""

    @staticmethod
    def forward(g_hidden, g_weight, grad, weight_dtype):
        scale = grad.to(torch.promote_types(grad.dtype, torch.float32))
        return ((g_hidden.to(scale.dtype) * scale).to(g_hidden.dtype),
                (g_weight.to(scale.dtype) * scale).to(weight_dtype))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(SECOND_ORDER.format(what="a second derivative"))

