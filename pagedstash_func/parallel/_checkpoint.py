"""The older sharded checkpoints, superseded by `save_checkpoint` (on
``torch.distributed.checkpoint``): `save_sharded` warns, `load_sharded` reads the files for
this release, and ``python -m pagedstash_func convert-checkpoint STEM PATH`` rewrites them as
a `save_checkpoint` checkpoint.

Each rank writes its experts (and whatever else a tree holds); a load gathers the experts back
whole and shards them for the group it runs in, of any size.

A tree is params, or anything shaped like them (reduced gradients, an optimizer's moments as
a tree of the same structure). Its expert leaves are those `ExpertShard` marks; every other
leaf is replicated and written by every rank (read back from the first file, and refused if
the ranks' copies differ). Files are read with
``torch.load(weights_only=True)``: nothing in them is executed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import warnings

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from ..core._files import save_atomic
from ._mesh import ep_group
from ._placement import EXPERTS, ExpertShard, placements

__all__ = ["load_sharded", "save_sharded"]

FORMAT, VERSION = "pagedstash_func.sharded", 1


def _file(path, rank: int, ranks: int) -> str:
    return f"{path}.rank{rank}-of-{ranks}.pt"


def _leaves(tree):
    """``[(key path, leaf, is an expert shard)]`` in tree order, and the tree's spec."""
    spec = pytree.tree_structure(tree)
    return [(key, leaf, where == EXPERTS) for key, leaf, where in placements(tree)], spec


def save_sharded(path, tree, group=None) -> str:
    """Write this rank's part of ``tree`` to ``{path}.rank{r}-of-{R}.pt`` (superseded by
    `save_checkpoint`, which it warns of).

    Every rank of the group calls it with the same ``path`` (on a file system they all can
    read at load). ``dp`` replicas write the same files: let one replica (``dp`` rank 0) call
    it. Each file is written atomically (a temporary file, synced, renamed over the old one):
    a save killed part-way leaves every earlier file whole, and a checkpoint whose ranks'
    files come from different saves is refused by `load_sharded`.

    Args:
        path: the file stem (not a folder).
        tree: params, or anything shaped like them (reduced gradients, optimizer moments): a
            tree of tensors whose expert leaves `ExpertShard` marks.
        group: a process group or a ``("dp", "ep")`` mesh (its ``ep`` dim); ``R`` is its size.
            ``None``: one process, ``R = 1``.

    Returns:
        The name of the file written.

    Raises:
        ValueError: ``path`` names a folder, a leaf is not a tensor, or the tree holds expert
            shards while several ranks run and no ``group`` is given.
    """
    warnings.warn("psf.save_sharded is superseded by psf.save_checkpoint (DCP, atomic, read on "
                  "any number of ranks); load_sharded reads its files for this release",
                  DeprecationWarning, stacklevel=2)
    if str(path).endswith(("/", os.sep)) or not os.path.basename(str(path)) \
            or os.path.isdir(path):
        raise ValueError(f"save_sharded needs a file stem, not a folder: got {str(path)!r} "
                         f"(pass e.g. {os.path.join(str(path), 'ckpt')!r})")
    group = ep_group(group)
    rank, ranks = (dist.get_rank(group), dist.get_world_size(group)) if group is not None \
        else (0, 1)
    leaves, spec = _leaves(tree)
    bad = [k for k, leaf, _ in leaves if not isinstance(leaf, torch.Tensor)]
    if bad:
        raise ValueError(f"save_sharded writes trees of tensors; {bad[:3]} are not (keep "
                         f"step counters and other values beside the tree)")
    if group is None and any(s for _, _, s in leaves) and dist.is_available() \
            and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("this tree holds expert shards and torch.distributed runs several "
                         "ranks, but no group was given (None means one process, whose file "
                         "every rank would overwrite): pass the group or mesh the experts "
                         "were sharded over")
    save_id = secrets.token_hex(8)             # ties the files of one save together
    if group is not None:
        box = [save_id]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        save_id = box[0]
    payload = {"format": FORMAT, "version": VERSION, "rank": rank, "ranks": ranks,
               "save": save_id,
               "spec": pytree.treespec_dumps(spec), "keys": [k for k, _, _ in leaves],
               "shard": [s for _, _, s in leaves],
               "tensors": [leaf.detach().cpu().clone() for _, leaf, _ in leaves]}
    payload["digest"] = _digest(payload)
    name = _file(path, rank, ranks)
    save_atomic(payload, name)         # a save killed part-way leaves the earlier file whole
    if group is not None:
        dist.barrier(group=group)      # every rank's file of this save is in place
    if rank == 0:                      # an earlier save of another size under this path
        for stale in _files_of_other_sizes(path, ranks):
            with contextlib.suppress(FileNotFoundError):
                os.remove(stale)
    return name


def _files_of_other_sizes(path, ranks: int) -> list[str]:
    """The files an earlier `save_sharded` over another number of ranks left under ``path``
    (they would make the path ambiguous to `load_sharded`)."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    pattern = re.compile(re.escape(os.path.basename(str(path))) +
                         r"\.rank(0|[1-9][0-9]*)-of-([1-9][0-9]*)\.pt")
    return [os.path.join(folder, f) for f in os.listdir(folder)
            if (m := pattern.fullmatch(f)) and int(m.group(2)) != ranks]


def load_sharded(path, group=None, *, device=None):
    """The tree `save_sharded` wrote under ``path``, sharded for ``group``.

    Reads every rank's file (``R`` as written), joins each expert leaf along its first dim
    in rank order, and keeps this rank's share.

    Args:
        path: the stem given to `save_sharded`.
        group: a process group or ``("dp", "ep")`` mesh of any size that divides the experts;
            ``None``: whole, for one process (plain dicts, not `ExpertShard` objects).
        device: where the tensors go (default the CPU).

    Returns:
        The tree, shaped as saved.

    Raises:
        ValueError: a missing, foreign, corrupt or inconsistent file, a leaf saved as
            replicated whose ranks' copies differ (an expert shard without its `ExpertShard`
            mark), or a group size that does not divide the experts.
    """
    folder = os.path.dirname(os.path.abspath(path)) or "."
    stem = os.path.basename(str(path)) + ".rank0-of-"
    pattern = re.compile(re.escape(stem) + r"([1-9][0-9]*)\.pt")
    found = [f for f in os.listdir(folder) if pattern.fullmatch(f)] if os.path.isdir(folder) \
        else []
    if len(found) != 1:
        raise ValueError(f"{path}: expected one {stem}<R>.pt in {folder}, found {found or 'none'}"
                         f": pass the path given to save_sharded (and keep one save a path)")
    ranks = int(pattern.fullmatch(found[0]).group(1))
    parts = [_read(_file(path, r, ranks), r, ranks) for r in range(ranks)]
    first = parts[0]
    for r, part in enumerate(parts[1:], 1):
        if part["keys"] != first["keys"] or part["shard"] != first["shard"] \
                or part["spec"] != first["spec"]:
            raise ValueError(f"{_file(path, r, ranks)} holds another tree than rank 0's file")
        if part.get("save") != first.get("save"):
            raise ValueError(f"{_file(path, r, ranks)} comes from another save than rank 0's "
                             f"file (a save stopped part-way, or a file copied in): save again")
    group = ep_group(group)
    me, size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None \
        else (0, 1)
    out = []
    for i, is_shard in enumerate(first["shard"]):
        if not is_shard:
            _check_replicated(path, parts, i, ranks)
            out.append(first["tensors"][i])
            continue
        whole = torch.cat([p["tensors"][i] for p in parts])
        if whole.shape[0] % size:
            raise ValueError(f"{first['keys'][i]}: {whole.shape[0]} experts do not split over "
                             f"{size} ranks")
        per = whole.shape[0] // size
        out.append(whole[me * per:(me + 1) * per].clone())
    if device is not None:
        out = [t.to(device) for t in out]
    tree = pytree.tree_unflatten(out, pytree.treespec_loads(first["spec"]))
    if group is None:               # whole again: plain dicts, not shards
        tree = pytree.tree_map(lambda n: dict(n) if isinstance(n, ExpertShard) else n, tree,
                               is_leaf=lambda n: isinstance(n, ExpertShard))
    return tree


def _check_replicated(path, parts, i, ranks) -> None:
    """A leaf saved as replicated must be the same bytes in every rank's file: one that
    differs is an expert shard that lost its mark (a flat name dict such as
    `to_hf_state_dict`'s), and reading rank 0's copy back would give every rank rank 0's
    experts."""
    first = parts[0]["tensors"][i]
    for r, part in enumerate(parts[1:], 1):
        other = part["tensors"][i]
        if other.dtype != first.dtype or other.shape != first.shape or not torch.equal(
                _bytes(other), _bytes(first)):
            key = parts[0]["keys"][i]
            raise ValueError(
                f"{_file(path, r, ranks)}: {key} was saved as replicated (no ExpertShard "
                f"mark) but rank {r} holds other values than rank 0, so loading would give "
                f"every rank rank 0's copy. If it is an expert shard, save the tree "
                f"psf.from_hf_model or psf.shard_experts returned (its ExpertShard marks say "
                f"which leaves are shards), not a flat dict such as to_hf_state_dict's")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (NaNs compare equal to themselves)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _read(name, rank, ranks):
    try:
        part = torch.load(name, weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{name} is missing: a checkpoint of {ranks} ranks needs every "
                         f"rank's file") from None
    except Exception as err:
        raise ValueError(f"{name} is not a readable pagedstash_func sharded file "
                         f"({type(err).__name__})") from None
    if not isinstance(part, dict) or part.get("format") != FORMAT \
            or part.get("version") != VERSION:
        raise ValueError(f"{name} is not a pagedstash_func sharded file of version {VERSION}")
    if part.get("digest") != _digest(part):
        raise ValueError(f"{name} is corrupted: its contents do not match their digest")
    if (part.get("rank"), part.get("ranks")) != (rank, ranks):
        raise ValueError(f"{name} says it is rank {part.get('rank')} of {part.get('ranks')}")
    return part


def _digest(payload) -> str:
    h = hashlib.sha256()
    for key in ("format", "version", "rank", "ranks", "save", "spec", "keys", "shard"):
        h.update(repr(payload[key]).encode())
    for t in payload["tensors"]:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(_bytes(t).numpy().tobytes())
    return h.hexdigest()
