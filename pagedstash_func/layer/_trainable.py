"""What an optimizer trains in a psf parameter tree, and its gradients handed over.

A psf tree holds one kind of leaf that no gradient trains: a layer's ``router_bias`` (a
score-correction bias, DeepSeek-V3's ``e_score_correction_bias``), which only chooses experts
and moves between steps by `psf.update_expert_bias`. An optimizer given every leaf would
still decay it (AdamW's weight decay needs no gradient), so these helpers leave it out by
construction.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

__all__ = ["FROZEN", "set_grads", "trainable"]

# Entries of a layer's params that are chosen with, never trained.
FROZEN = ("router_bias",)


def _is_frozen(path) -> bool:
    last = path[-1] if path else None
    return isinstance(last, pytree.MappingKey) and last.key in FROZEN


def trainable(params) -> list[torch.Tensor]:
    """The leaves of ``params`` that training updates, in tree order.

    Every tensor but each layer's ``router_bias``.

    Args:
        params: a psf parameter tree (`psf.moe_init` layers, `psf.from_hf_model`'s dict, or
            any dict/list/tuple nesting of tensors).

    Returns:
        A list of the tensors themselves (no copies), for ``torch.optim.AdamW(trainable(params),
            ...)``; hand their gradients over with `set_grads`.

    Raises:
        ValueError: a leaf of ``params`` is not a tensor.

    Example::

        opt = torch.optim.AdamW(psf.trainable(params), lr=3e-4)
        res = psf.run_step(step, params, batch, state)
        psf.set_grads(params, res.grads)
        opt.step()
    """
    leaves = pytree.tree_flatten_with_path(params)[0]
    bad = [pytree.keystr(p) for p, leaf in leaves if not isinstance(leaf, torch.Tensor)]
    if bad:
        raise ValueError(f"trainable takes a tree of tensors; params{bad[0]} is not a tensor")
    return [leaf for path, leaf in leaves if not _is_frozen(path)]


def set_grads(params, grads) -> None:
    """``p.grad = g`` for each leaf `trainable` gives and its gradient in ``grads``, matched by
    their place in the trees (their key paths, so a dict's order does not matter); a frozen
    leaf (``router_bias``) gets ``p.grad = None``, so no optimizer step moves it.

    The gradients go to the tensors of ``params`` themselves, the ones an optimizer built
    over ``trainable(params)`` holds. For an optimizer over ``model.parameters()`` of a
    `psf.from_hf_model` model (other tensor objects over the same memory), hand them over by
    name instead: ``p.grad = psf.to_hf_state_dict(grads, model)[name]``.

    Args:
        params: the tree the optimizer was built over (`trainable` ``(params)``).
        grads: a tree with the same key paths, e.g. ``res.grads`` of `psf.run_step`, or
            `psf.run_micro_batches`' accumulated ones; each gradient of its parameter's shape,
            dtype and device. The tensors are handed over, not copied.

    Raises:
        ValueError: where the two trees' key paths differ (naming one), a gradient is missing
            (``None``) or has another shape, dtype or device than its parameter, or one tensor
            sits at two places of ``params`` (its gradients would overwrite each other).
            Nothing is assigned then.
    """
    mine = pytree.tree_flatten_with_path(params)[0]
    theirs = {pytree.keystr(p): g for p, g in pytree.tree_flatten_with_path(grads)[0]}
    where = {pytree.keystr(p) for p, _ in mine}
    extra, missing = sorted(set(theirs) - where), sorted(where - set(theirs))
    if extra or missing:
        raise ValueError(f"grads are not shaped like params: params{(missing or ['?'])[0]} has "
                         f"no gradient there" if missing else
                         f"grads are not shaped like params: grads{extra[0]} has no parameter "
                         f"there (pass the gradients of these params, e.g. res.grads of "
                         f"run_step on them)")
    seen, pairs = {}, []
    for path, p in mine:
        key = pytree.keystr(path)
        if id(p) in seen:
            raise ValueError(f"params{key} is the same tensor as params{seen[id(p)]}: a tensor "
                             f"at two places would get only one of its gradients")
        seen[id(p)] = key
        if _is_frozen(path):
            pairs.append((p, None))
            continue
        g = theirs[key]
        if not isinstance(g, torch.Tensor):
            what = "None (no gradient)" if g is None else f"a {type(g).__name__}"
            raise ValueError(f"grads{key} is {what}: each parameter needs a gradient tensor")
        if (g.shape, g.dtype, g.device) != (p.shape, p.dtype, p.device):
            raise ValueError(f"grads{key} is {g.dtype} {list(g.shape)} on {g.device}; its "
                             f"parameter is {p.dtype} {list(p.shape)} on {p.device}")
        pairs.append((p, g))
    for p, g in pairs:
        p.grad = g
