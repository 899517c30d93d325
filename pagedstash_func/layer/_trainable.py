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
    """Hand gradients to an optimizer: ``p.grad = g`` for each leaf `trainable` gives.

    Each leaf is matched with its gradient in ``grads`` by their place in the trees (not by
    order alone); a frozen leaf (``router_bias``) gets ``p.grad = None``, so no optimizer step
    moves it.

    Args:
        params: the tree the optimizer was built over (`trainable` ``(params)``).
        grads: a tree of the same structure, e.g. ``res.grads`` of `psf.run_step`, or
            `psf.run_micro_batches`' accumulated ones; each gradient of its parameter's shape.
            The tensors are handed over, not copied.

    Raises:
        ValueError: where the two trees differ in structure (naming the first place) or a
            gradient's shape is not its parameter's.
    """
    mine = pytree.tree_flatten_with_path(params)[0]
    theirs = pytree.tree_flatten_with_path(grads)[0]
    where = [pytree.keystr(p) for p, _ in mine]
    got = [pytree.keystr(p) for p, _ in theirs]
    if where != got:
        first = next((a, b) for a, b in zip(where + [None], got + [None]) if a != b)
        raise ValueError(f"grads are not shaped like params: params{first[0]} meets "
                         f"grads{first[1]} (pass the gradients of these params, e.g. "
                         f"res.grads of run_step on them)")
    for (path, p), (_, g) in zip(mine, theirs):
        if _is_frozen(path):
            p.grad = None
            continue
        if not isinstance(g, torch.Tensor) or g.shape != p.shape:
            raise ValueError(f"grads{pytree.keystr(path)} has shape "
                             f"{list(getattr(g, 'shape', []))}, its parameter "
                             f"{list(p.shape)}")
        p.grad = g
