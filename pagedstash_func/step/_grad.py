"""`value_and_grad`: first-order gradients of a pure function, with nothing kept past backward.

``torch.func.grad_and_value`` builds its backward with ``create_graph=True`` (so that it can
nest), which keeps every tensor backward reads alive until backward ends: on a whole
transformer that is about twice the memory of ``.backward()``. A training step needs one
derivative, so the steps of this library take theirs with plain ``torch.autograd.grad`` over
aliases of the inputs: the same kernels, the same bits, and each saved tensor freed as soon as
backward has read it. Pure from the outside: inputs in, gradients out, no ``.grad`` written.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree


def value_and_grad(fn, argnums=0, has_aux: bool = False):
    """``fn``'s gradients and value, as ``torch.func.grad_and_value`` returns them.

    ``value_and_grad(fn)(*args)`` returns ``(grads, value)``, or ``(grads, (value, aux))`` with
    ``has_aux=True``, where ``fn(*args)`` returns a scalar tensor (or ``(scalar, aux)``) and
    ``grads`` has the structure of ``args[argnums]`` (a tuple of such trees for a tuple of
    argnums). Differentiated arguments must hold floating-point (or complex) tensors only; the
    value must be a 0-d tensor; a tensor that does not reach the value gets a zero gradient.
    ``value`` and the tensors of ``aux`` come back detached.

    Unlike ``torch.func.grad_and_value`` this computes first-order gradients only and keeps
    nothing for a second derivative: compose ``torch.func`` transforms over the function
    itself when a higher-order derivative is wanted.

    Args:
        fn: the function to differentiate, returning a 0-d tensor (or ``(value, aux)``).
        argnums: the positional argument to differentiate, or a non-empty tuple of them.
        has_aux: ``fn`` returns ``(value, aux)``.

    Returns:
        A function of ``fn``'s arguments returning ``(grads, value)`` or
            ``(grads, (value, aux))``. It raises `ValueError` for a differentiated argument
            holding anything but floating-point (or complex) tensors, a value that is not 0-d,
            an ``argnums`` out of range, and under ``torch.inference_mode()`` or inside
            ``torch.func`` transforms.

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: ``argnums`` is not an int or a non-empty tuple of ints.

    Example::

        step = psf.stash_aware(loss_fn, cfg)
        grads, (loss, state) = psf.value_and_grad(step, has_aux=True)(params, batch, state)
    """
    if not callable(fn):
        raise TypeError(f"value_and_grad needs a callable, got {type(fn).__name__}")
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or not all(isinstance(n, int) for n in nums):
        raise ValueError(f"argnums must be an int or a non-empty tuple of ints, got {argnums!r}")

    def wrapped(*args, **kwargs):
        args = list(args)
        for n in nums:
            if not -len(args) <= n < len(args):
                raise ValueError(f"argnums={argnums!r} but the function got {len(args)} "
                                 f"positional arguments")
        if len({n % len(args) for n in nums}) < len(nums):
            raise ValueError(f"argnums={argnums!r} names an argument twice: each must be unique")
        if torch.is_inference_mode_enabled():
            raise ValueError("value_and_grad cannot differentiate under torch.inference_mode(), "
                             "where no tensor records its history: call it outside that block")
        if torch._C._functorch.maybe_current_level() is not None:
            raise ValueError("value_and_grad takes plain autograd gradients and does not nest "
                             "inside torch.func transforms: use torch.func.grad_and_value there")
        inputs, specs = [], []
        for n in nums:
            leaves, spec = pytree.tree_flatten(args[n])
            fresh = [_input_alias(leaf, args[n], n, i) for i, leaf in enumerate(leaves)]
            args[n] = pytree.tree_unflatten(fresh, spec)
            inputs.append(fresh)
            specs.append(spec)
        with torch.enable_grad():
            out = fn(*args, **kwargs)
        value, aux = _split(out, has_aux)
        flat = [t for group in inputs for t in group]
        grads = list(torch.autograd.grad(value, flat, allow_unused=True)
                     if value.requires_grad and flat else [None] * len(flat))
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, flat)]
        trees = []
        for group, spec in zip(inputs, specs):
            trees.append(pytree.tree_unflatten(grads[:len(group)], spec))
            grads = grads[len(group):]
        tree = trees[0] if isinstance(argnums, int) else tuple(trees)
        value = value.detach()
        if not has_aux:
            return tree, value
        return tree, (value, pytree.tree_map(_detached, aux))

    return wrapped


def _input_alias(leaf, tree, n: int, i: int) -> torch.Tensor:
    """A new autograd leaf that shares ``leaf`` 's memory (no copy); ``leaf`` is leaf ``i`` of
    ``tree``, argument ``n``, named in errors."""
    ok = isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())
    if not ok:
        _refuse(leaf, f"argument {n}{_path_of(tree, i)}")
    return leaf.detach().requires_grad_()


def _path_of(tree, i: int) -> str:
    """The key path of leaf ``i`` (only for errors: a node registered without key paths is
    named by the leaf's index)."""
    try:
        return pytree.keystr(pytree.tree_flatten_with_path(tree)[0][i][0])
    except (ValueError, TypeError, IndexError):
        return f" (leaf {i})"


def _refuse(leaf, where: str) -> None:
    if not isinstance(leaf, torch.Tensor):
        raise ValueError(f"{where} is a {type(leaf).__name__}: differentiated arguments must "
                         f"hold tensors only (move other values into another argument)")
    raise ValueError(f"{where} is a {leaf.dtype} tensor: only floating-point tensors have "
                     f"gradients (move it into another argument, such as the batch)")


def _split(out, has_aux: bool):
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError("with has_aux=True the function must return a (value, aux) pair, "
                             f"got {type(out).__name__}")
        value, aux = out
    else:
        value, aux = out, None
    if not isinstance(value, torch.Tensor) or value.ndim != 0:
        raise ValueError(f"gradients are defined for a scalar tensor value; the function "
                         f"returned {getattr(value, 'shape', type(value).__name__)}"
                         + ("" if has_aux else " (pass has_aux=True if it returns (loss, aux))"))
    return value, aux


def _detached(leaf):
    """Cut from the graph what is in it; leave other tensors as they are (a state's pools keep
    their identity, which graphs and the consumed-state check rely on)."""
    return leaf.detach() if isinstance(leaf, torch.Tensor) and leaf.requires_grad else leaf
