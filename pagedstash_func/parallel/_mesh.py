"""Expert parallelism inside data parallelism: a 2-D ``DeviceMesh`` with dims ``("dp", "ep")``.

Experts are sharded over ``ep`` and replicated over ``dp``; everything else is replicated over
both. Which tensor is which comes from the tree's placement record (`psf.placements`: an
`ExpertShard` from `shard_experts`, an `HFStateDict` from `to_hf_state_dict`), never from
shapes. `reduce_gradients` sums each gradient over the ranks that hold a copy of its
tensor; `clip_grad_norm` takes the global norm counting every tensor once.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ._placement import agree_on_tree, all_reduce_flat, placements, split

__all__ = ["clip_grad_norm", "ep_group", "groups_of", "reduce_gradients"]

DIMS = ("dp", "ep")


def is_mesh(group) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:                       # pragma: no cover - torch >= 2.11 has it
        return False
    return isinstance(group, DeviceMesh)


def check_mesh(mesh) -> None:
    if tuple(mesh.mesh_dim_names or ()) != DIMS:
        raise ValueError(f"a mesh for psf must have the dims {DIMS} (experts sharded over "
                         f"'ep', replicated over 'dp'), got {mesh.mesh_dim_names}: build it with "
                         f"init_device_mesh(device, (dp, ep), mesh_dim_names=('dp', 'ep'))")


def ep_group(group):
    """The process group the experts are sharded over: ``group`` itself, or a ``("dp",
    "ep")`` mesh's ``ep`` group."""
    if is_mesh(group):
        check_mesh(group)
        return group.get_group("ep")
    return group


def ep_size(group) -> int:
    """The ranks the experts are split over for ``group`` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(ep_group(group))


def ep_position(group) -> tuple[int, int]:
    """``(rank, ranks)``: this process's place among the ranks the experts are split over for
    ``group`` (``(0, 1)`` for ``None``)."""
    ep = ep_group(group)
    return (0, 1) if ep is None else (dist.get_rank(ep), dist.get_world_size(ep))


def check_experts_split(experts: int, ranks: int) -> None:
    """`ValueError` unless ``experts`` split evenly over ``ranks``."""
    if experts % ranks:
        raise ValueError(f"{experts} experts do not split over {ranks} ranks: pass a group "
                         f"whose size divides the experts")


def groups_of(group, dims) -> list:
    """The process groups to reduce over: ``[group]``, or the ``dims`` of a ``("dp", "ep")``
    mesh, in that order."""
    if is_mesh(group):
        check_mesh(group)
        return [group.get_group(d) for d in dims]
    return [group]


def reduce_gradients(grads, group):
    """Sum every gradient over the ranks that hold a copy of its tensor, in place.

    No tensor is reduced twice and none is left out. Sums: if each rank's loss is its share of
    the global batch's (its mean times its share of the tokens), the result is the global
    loss's gradient; for the mean of the ranks' means, divide by the world size.

    Args:
        grads: a gradient tree shaped like the params (its expert shards recorded as such:
            `psf.placements`).
        group: a process group (expert parallelism alone): the replicated tensors are summed
            over it, the expert shards left alone (as `all_reduce_replicated`). A ``("dp",
            "ep")`` mesh: the expert shards are summed over ``dp``, every other tensor over
            ``dp`` and ``ep``.

    Returns:
        ``grads`` itself, reduced.

    Raises:
        ValueError: a mesh whose dims are not ``("dp", "ep")``, or a plain dict holding an
            expert shard without its record.
    """
    shards, replicated = split(grads, ep_size(group))
    groups = [group.get_group("dp"), group.get_group("ep")] if is_mesh(group) else [group]
    agree_on_tree(placements(grads), groups)
    if is_mesh(group):
        all_reduce_flat(shards + replicated, groups[0])
        all_reduce_flat(replicated, groups[1])
    else:
        all_reduce_flat(replicated, group)
    return grads


def clip_grad_norm(grads, max_norm: float, group=None) -> torch.Tensor:
    """Scale reduced ``grads`` in place so that their global norm is at most ``max_norm``.

    Call after `reduce_gradients`: every replicated tensor is then the same on every rank
    (counted once), and each expert shard the same across ``dp`` and distinct across ``ep``
    (summed over ``ep``, once each).

    Args:
        grads: the reduced gradient tree.
        max_norm: the largest global norm, a finite number > 0.
        group: as `reduce_gradients` took it (``None``: one process).

    Returns:
        The global norm before scaling, 0-d fp32 (fp64 for fp64 gradients), on the gradients'
            device.

    Raises:
        ValueError: ``max_norm`` is not a finite number > 0, ``grads`` holds no tensor, or a
            plain dict holds an expert shard without its record.
    """
    check_max_norm(max_norm)
    if group is None and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1 and split(grads)[0]:
        raise ValueError("these gradients hold expert shards and torch.distributed runs "
                         "several ranks, but no group was given: each rank would take the norm "
                         "of its own experts alone and scale its replicas differently. Pass "
                         "the group or mesh the experts are sharded over")
    shards, replicated = split(grads, ep_size(group))
    every = shards + replicated
    if not every:
        raise ValueError("clip_grad_norm found no gradient tensors")
    device = every[0].device
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in every) else torch.float32
    sq = lambda ts: sum((t.to(dtype).square().sum() for t in ts),   # noqa: E731
                        torch.zeros((), dtype=dtype, device=device))
    shard_sq = sq(shards)
    if group is not None and shards:
        shard_sq = shard_sq.clone()
        dist.all_reduce(shard_sq, group=ep_group(group))
    norm = (shard_sq + sq(replicated)).sqrt()
    scale = clip_scale(norm, max_norm)
    with torch.no_grad():
        for t in every:
            t.mul_(scale.to(t.dtype))
    return norm


def check_max_norm(max_norm) -> None:
    """`ValueError` unless ``max_norm`` is a finite number > 0."""
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) \
            or not 0 < max_norm < math.inf:
        raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}")


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What gradients of global norm ``norm`` are multiplied by to be at most ``max_norm``
    (1 when they are already)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)
