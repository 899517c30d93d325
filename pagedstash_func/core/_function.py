"""`fast_apply`: an ``autograd.Function`` whose ``apply`` does not rebuild its signature."""

from __future__ import annotations

import inspect

import torch
import torch.utils._pytree as pytree


def fast_apply(cls):
    """Class decorator for an ``autograd.Function`` with ``setup_context``.

    Such a Function's ``apply`` binds its arguments to ``forward``'s signature on every call,
    and ``inspect.signature`` rebuilds that signature each time (about 20 microseconds of
    host time a call, which a whole-model step pays some 80 times); the signature computed
    once here is what ``inspect.signature`` then returns. Nothing else changes."""
    cls.forward.__signature__ = inspect.signature(cls.forward)
    return cls


def active_transforms(*inputs, closed_over: bool = False) -> tuple[bool, bool]:
    """``(vmap, forward_ad)``: whether ``vmap``, or forward-mode AD (``torch.func.jvp``,
    ``hessian``, ``jacfwd``, or dual tensors of ``torch.autograd.forward_ad``), would run the
    caller on ``inputs`` (tensors or trees of them): a transform counts where one of them is
    its own (wrapped by functorch, or dual), not where it only closes over them
    (``closed_over=True``: there too, for a Function that torch would still vmap). Read from
    what is active (functorch's interpreter stack, the forward-AD level), so that a Function
    with no rule for them can refuse them at its entry instead of by ``vmap``/``jvp``
    methods, which keep ``torch.compile`` from tracing it."""
    stack = torch._C._functorch.maybe_current_level() is not None and [
        i.key() for i in _interpreters()]
    tensors = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    dual = torch.autograd.forward_ad._current_level >= 0 and any(
        torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in tensors)
    # an input of the transform's own (batched, or wrapped by it), not one it closes over
    ours = bool(stack) and (closed_over or any(
        torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors))
    return bool(ours and _VMAP in stack), bool(dual or (ours and _JVP in stack))


def _interpreters():
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    return retrieve_all_functorch_interpreters()


_VMAP = torch._C._functorch.TransformType.Vmap
_JVP = torch._C._functorch.TransformType.Jvp
