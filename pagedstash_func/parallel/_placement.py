"""Placement as data: which leaves of a tree are a rank's expert shard, recorded where the tree
is made and read wherever it is reduced, clipped or saved, never guessed from shapes.

Two containers carry the record, and both stay what they are through ``tree_map`` (they are
pytree nodes that rebuild themselves): `ExpertShard`, one MoE layer in psf's layout, whose
``w_gate_up``/``w_down`` are shards; and `HFStateDict`, `to_hf_state_dict`'s flat name dict,
which names its expert entries. Every other leaf is replicated. A dict that still looks like a
shard (a router with more rows than its experts) but carries no mark is refused, naming the
leaf: it lost its record on the way (a dict comprehension rebuilds a plain dict).

Also here, so that every part of `parallel` imports them from one place: the collectives
that check and sum across ranks (`all_reduce_flat`, `agree`, `agree_on_tree`,
`gather_rows`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from ._comm import all_gather_into

__all__ = ["EXPERTS", "REPLICATED", "ExpertShard", "HFStateDict", "placements"]

EXPERTS, REPLICATED = "experts", "replicated"


class ExpertShard(dict):
    """Parameters of one MoE layer on one expert-parallel rank.

    ``router [E, H]`` whole (it is replicated), ``w_gate_up [E/R, H, 2F]`` and
    ``w_down [E/R, F, H]`` of this rank's experts. A dict (and a pytree like one, kept by
    ``tree_map``) that records which leaves are shards, so that gradient reduction, clipping
    and checkpoints treat them as such. Made by `shard_experts` (or `from_hf_model` with a
    ``group``).

    Attributes:
        SHARDED: the entries that are shards: ``("w_gate_up", "w_down")``.
    """

    SHARDED = ("w_gate_up", "w_down")


class HFStateDict(dict):
    """``{name: tensor}`` under transformers' names (`to_hf_state_dict`), recording which
    entries are this rank's expert shard (dim 0, the experts).

    A dict, and a pytree like one that ``tree_map`` keeps with its record.

    Args:
        items: the ``{name: tensor}`` entries (a mapping or pairs).
        experts: the names among them that are expert shards.

    Attributes:
        experts: the names whose tensors are expert shards (empty when nothing is sharded).
    """

    def __init__(self, items=(), experts=()):
        super().__init__(items)
        if isinstance(experts, str):
            raise ValueError("HFStateDict(experts=...) takes a collection of names, got one "
                             "string: wrap it in a list")
        self.experts = frozenset(experts)
        unknown = sorted(self.experts - set(self))
        if unknown:
            raise ValueError(f"HFStateDict: experts names {unknown[:3]}, which are not among "
                             f"its keys")

    def __reduce__(self):
        return HFStateDict, (dict(self), tuple(sorted(self.experts)))


pytree.register_pytree_node(
    ExpertShard,
    lambda d: (list(d.values()), list(d.keys())),
    lambda values, keys: ExpertShard(zip(keys, values)),
    serialized_type_name="pagedstash_func.ExpertShard",
    flatten_with_keys_fn=lambda d: ([(pytree.MappingKey(k), v) for k, v in d.items()],
                                    list(d.keys())))

pytree.register_pytree_node(
    HFStateDict,
    lambda d: (list(d.values()), (list(d.keys()), tuple(sorted(d.experts)))),
    lambda values, ctx: HFStateDict(zip(ctx[0], values), ctx[1]),
    serialized_type_name="pagedstash_func.HFStateDict",
    flatten_with_keys_fn=lambda d: ([(pytree.MappingKey(k), v) for k, v in d.items()],
                                    (list(d.keys()), tuple(sorted(d.experts)))))


def _marked(node) -> bool:
    return isinstance(node, (ExpertShard, HFStateDict))


def _lost_marks(path, node, ep_ranks=1) -> str | None:
    """Why ``node`` (a plain dict, or an `HFStateDict`'s names it does not list) must be a
    shard that lost its record, or None. With the experts split over ``ep_ranks > 1``, a
    plain dict of ``w_gate_up``/``w_down`` without a router (optimizer moments) cannot be
    told from a replicated one: refused too."""
    if isinstance(node, HFStateDict):
        unlisted = {k: v for k, v in node.items() if k not in node.experts}
        return _lost_marks(path, unlisted, ep_ranks)
    if isinstance(node, dict) and not isinstance(node, ExpertShard):
        if ep_ranks > 1 and "router" not in node and all(
                isinstance(node.get(n), torch.Tensor) and node[n].dim() == 3
                for n in ExpertShard.SHARDED):
            return (f"tree{pytree.keystr(path)} holds w_gate_up and w_down with no router, "
                    f"with the experts split over {ep_ranks} ranks")
        router, up = node.get("router"), node.get("w_gate_up")
        if isinstance(router, torch.Tensor) and isinstance(up, torch.Tensor) \
                and router.dim() == 2 and up.dim() == 3 and router.shape[0] != up.shape[0]:
            return (f"tree{pytree.keystr(path)} holds {up.shape[0]} experts of its router's "
                    f"{router.shape[0]}")
        for name, value in node.items():
            if isinstance(name, str) and name.endswith(".experts.gate_up_proj"):
                gate = node.get(name[:-len(".experts.gate_up_proj")] + ".gate.weight")
                if isinstance(gate, torch.Tensor) and isinstance(value, torch.Tensor) \
                        and value.dim() == 3 and gate.shape[0] != value.shape[0]:
                    return (f"tree{pytree.keystr(path)}[{name!r}] holds {value.shape[0]} "
                            f"experts of its router's {gate.shape[0]}")
    return None


def placements(tree, ep_ranks: int = 1) -> list[tuple[str, object, str]]:
    """Every leaf of ``tree`` with its placement, in ``tree_leaves`` order.

    Args:
        tree: params, or a tree shaped like them (gradients, optimizer moments, a
            `to_hf_state_dict`).
        ep_ranks: the ranks the experts are split over: above 1, a plain dict of
            ``w_gate_up``/``w_down`` (a layer's moments, say) is refused as well, since it
            could be a shard.

    Returns:
        ``[(key, leaf, placement)]``: ``key`` the leaf's path (``pytree.keystr``),
            ``placement`` `EXPERTS` for an expert shard's tensor (split over the ``ep`` ranks
            along dim 0) and `REPLICATED` for every other leaf.

    Raises:
        ValueError: a plain dict (or an `HFStateDict`, for a name it does not list) holds
            experts that are a shard of its router's (a shard that lost its `ExpertShard` or
            `HFStateDict` record), naming the leaf.
    """
    def stop(node):
        return _marked(node) or (isinstance(node, dict) and
                                 _lost_marks((), node, ep_ranks) is not None)

    out = []
    for path, node in pytree.tree_flatten_with_path(tree, is_leaf=stop)[0]:
        why = _lost_marks(path, node, ep_ranks) if isinstance(node, dict) else None
        if why is not None:
            raise ValueError(
                f"{why}: an expert shard without its placement record (a plain dict, such as "
                f"a dict comprehension or a tree copied by hand makes). Keep the ExpertShard "
                f"(torch.utils._pytree.tree_map keeps it), or rebuild it with "
                f"psf.ExpertShard(d); a flat name dict comes marked from psf.to_hf_state_dict")
        if not _marked(node):
            out.append((pytree.keystr(path), node, REPLICATED))
            continue
        sharded = ExpertShard.SHARDED if isinstance(node, ExpertShard) else node.experts
        for sub, leaf in pytree.tree_flatten_with_path(node)[0]:
            name = sub[0].key
            out.append((pytree.keystr(path + sub), leaf,
                        EXPERTS if name in sharded else REPLICATED))
    return out


def split(tree, ep_ranks: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(expert shard tensors, replicated tensors)`` of ``tree`` (other leaves left out),
    each tensor once: a tensor under two names (tied weights, ``to_hf_state_dict``'s tied
    names) is summed, scaled and counted once."""
    experts, replicated, seen = [], [], set()
    for _, leaf, where in placements(tree, ep_ranks):
        if isinstance(leaf, torch.Tensor):
            key = (leaf.untyped_storage().data_ptr(), leaf.storage_offset(),
                   tuple(leaf.shape), leaf.stride(), leaf.dtype) if leaf.numel() else id(leaf)
            if key in seen:
                continue
            seen.add(key)
            (experts if where == EXPERTS else replicated).append(leaf)
    return experts, replicated


def agree_on_tree(placed, groups) -> None:
    """`ValueError` on every rank of each of ``groups`` unless all its ranks pass the same
    tree: the same names, in the same order, with the same shapes and dtypes. Flat
    collectives pair tensors by position, so two ranks whose dicts list the same keys in
    another order would sum one name into another."""
    import hashlib
    text = repr([(k, tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else (k,)
                 for k, t, _ in placed])
    mine = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
    for group in groups:
        device = collective_device(group)
        every = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(every, torch.tensor([mine], device=device), group=group)
        if len(set(every.tolist())) > 1:
            raise ValueError("the ranks passed different trees (names, their order, shapes or "
                             "dtypes differ): the gradients would be summed name into name; "
                             "build every rank's tree the same way")


def collective_device(group) -> torch.device:
    """Where a small tensor must live for ``group``'s backend (CUDA for NCCL)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_flat(tensors, group) -> None:
    """Sum ``tensors`` over ``group`` in place: one all-reduce per dtype, over a flat copy."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        at = 0
        for t in same:
            t.copy_(flat[at:at + t.numel()].view_as(t))
            at += t.numel()


def agree(group, error: Exception | None, what: str) -> None:
    """Every rank learns whether any rank's ``error`` is set; then all raise or none does.

    For the paths that may read the host (the exact path, ``step.init``): a rank that found a
    bad input would otherwise raise alone and leave the others waiting in a collective.
    """
    failed = [r for r, (bad,) in enumerate(gather_rows(group, [int(error is not None)]))
              if bad]
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"rank {failed[0]} refused {what} (its own error says why); every "
                         f"rank stops here so that none is left waiting in a collective")


def gather_rows(group, values) -> list[list[int]]:
    """Every rank's ``values`` (ints), one row a rank in rank order."""
    mine = torch.tensor(values, dtype=torch.int64, device=collective_device(group))
    every = mine.new_empty(dist.get_world_size(group) * mine.numel())
    all_gather_into(every, mine, group=group)
    return every.view(-1, mine.numel()).tolist()
