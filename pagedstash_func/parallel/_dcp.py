"""Checkpoints on ``torch.distributed.checkpoint`` (DCP), their placement told to DCP.

A tree's expert shards go to DCP as ``DTensor``s sharded along dim 0 over the ``ep`` ranks, so
that DCP writes each rank's experts under one global tensor and a load on another number of
ranks (or one process) reads the rows it needs; replicated leaves go as plain tensors, which
DCP writes once. Given a plain per-rank tensor instead, DCP keeps one rank's copy: the silent
loss the placement record exists to prevent.

A save is atomic: DCP writes into a fresh folder beside the checkpoint, rank 0 adds a manifest
(``psf.json``: keys, global shapes, dtypes, placements, the digest of DCP's metadata), renames
the folder into place, and swaps the checkpoint's name (a symbolic link) to it in one
``os.replace``. A save killed at any point leaves the name on the previous, complete save.
A load reads the manifest (JSON) first and refuses another model's or a damaged checkpoint on
every rank together; DCP's own metadata (a pickle) is read with an unpickler that builds
DCP's metadata classes and nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import re
import secrets
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from ..core._files import sync_folder
from ._mesh import ep_group, is_mesh
from ._placement import EXPERTS, agree, placements

__all__ = ["load_checkpoint", "save_checkpoint"]

FORMAT, VERSION, MANIFEST = "pagedstash_func.checkpoint", 1, "psf.json"


def save_checkpoint(path, tree, group=None) -> str:
    """Save ``tree`` as a DCP checkpoint at ``path``, each rank writing its own experts.

    Every rank of ``group`` calls it with the same ``path``, on a file system they all see.
    ``path`` becomes a symbolic link to the folder of this save (``{path}.{id}``); the folder
    of the save it replaces is removed once the link points to the new one.

    Args:
        path: the checkpoint's name (a link the save creates or replaces; not an existing
            folder or file).
        tree: params, or a tree shaped like them (gradients, optimizer moments), of tensors;
            its expert shards recorded as such (`psf.placements`).
        group: the ``("dp", "ep")`` ``DeviceMesh`` the experts are sharded over (every rank
            of the mesh calls it), or the process group they are sharded over (the ranks of
            one such group call it, dp rank 0's replica: the others hold the same tensors),
            or ``None``: this process alone writes (call it on one rank).

    Returns:
        The folder the save wrote.

    Raises:
        ValueError: on every rank, for a leaf that is not a tensor, a plain dict holding an
            expert shard without its record, ``path`` naming anything but a link an earlier
            save made, or expert shards with several ranks running and no ``group``.
        OSError: on every rank, when rank 0 cannot make or rename the folders.
    """
    import torch.distributed.checkpoint as dcp
    ctx = _Context(group)
    target = os.path.abspath(str(path))
    error = None
    try:
        ctx.take(tree)
        if ctx.rank == 0:
            _check_target(path, target)
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    except (ValueError, OSError) as err:
        error = err
    ctx.agree(error, "the checkpoint or its path")
    save_id = ctx.broadcast(secrets.token_hex(6))
    folder = f"{target}.{save_id}"
    staging = folder + ".tmp"
    ctx.on_rank_zero(lambda: (_remove_stale(target), os.makedirs(staging)), "the staging folder")
    with ctx.quiet():
        dcp.save(ctx.state_dict(tree), storage_writer=dcp.FileSystemWriter(staging),
                 process_group=ctx.pg, no_dist=ctx.ep is None)
    ctx.on_rank_zero(lambda: _publish(ctx, tree, target, staging, folder),
                     "the checkpoint's rename")
    return folder


def _publish(ctx, tree, target, staging, folder) -> None:
    """Rank 0, once every rank's data is written: the manifest, the folder renamed into
    place, the name moved to it in one step, the save it replaced removed."""
    manifest = ctx.manifest(tree)
    manifest["metadata"] = _digest_file(os.path.join(staging, ".metadata"))
    manifest["files"] = {name: [os.path.getsize(os.path.join(staging, name)),
                                _digest_file(os.path.join(staging, name))]
                         for name in sorted(os.listdir(staging)) if name.endswith(".distcp")}
    _write_json(os.path.join(staging, MANIFEST), manifest)
    os.rename(staging, folder)
    link = folder + ".link"
    os.symlink(os.path.basename(folder), link)
    os.replace(link, target)                 # the one step that moves the name
    sync_folder(os.path.dirname(target) or ".")
    _remove_stale(target)                    # the save it replaced, and any left by a kill


def load_checkpoint(path, like, group=None, *, device=None):
    """The tree saved at ``path``, read for this rank's place in ``group``.

    The ranks may differ in number (and the mesh in shape) from those that saved: each reads
    the experts its ``ep`` rank holds now. ``like`` gives the tree's structure, this rank's
    shapes, dtypes and placements (the params `from_hf_model` or `shard_experts` made for
    this group, or a copy on the meta device); its tensors are not read or written.

    Args:
        path: the checkpoint's name, as given to `save_checkpoint`.
        like: a tree shaped as the one to load, sharded for ``group``.
        group: the ``("dp", "ep")`` mesh or process group to load for, or ``None``: one
            process, every tensor whole.
        device: where leaves of ``like`` on the meta device are made (default the CPU);
            the others are made where ``like``'s are.

    Returns:
        A new tree shaped like ``like``, holding the checkpoint's values.

    Raises:
        ValueError: on every rank, for a path that is not a checkpoint, a damaged or foreign
            one, one of another tree (keys, global shapes or dtypes differ, named), or experts
            that do not split over ``group``'s ``ep`` ranks. A leaf saved whole and loaded as
            an expert shard (or the other way) is read as the rows it holds.
    """
    import torch.distributed.checkpoint as dcp
    ctx = _Context(group)
    error, folder = None, None
    try:
        ctx.take(like)
        if ctx.rank == 0:          # one rank resolves the link: every rank reads one save
            folder = os.path.realpath(str(path))
    except ValueError as err:
        error = err
    ctx.agree(error, "the tree to load")
    folder = ctx.broadcast(folder)
    try:
        ctx.check(_read_manifest(path, folder, digests=ctx.rank == 0), like)
    except ValueError as err:
        error = err
    ctx.agree(error, "the checkpoint")
    out = pytree.tree_map(lambda t: _empty_like(t, device), like)
    with ctx.quiet():
        dcp.load(ctx.state_dict(out), storage_reader=_SafeReader(folder),
                 process_group=ctx.pg, no_dist=ctx.ep is None)
    return out


class _Context:
    """A save's or load's ranks: the process group DCP runs over, the ``ep`` ranks the
    experts are split over, and how a tree becomes DCP's flat state dict."""

    def __init__(self, group):
        if group is None:
            self.pg, self.ep, self.ranks, self.rank = None, None, 1, 0
        else:
            self.pg = None if is_mesh(group) else group     # a mesh: every rank of the world
            self.ep = ep_group(group)
            self.ranks = dist.get_world_size(self.ep)
            self.rank = dist.get_rank(self.pg)
        self._mesh = None

    def take(self, tree) -> None:
        """The tree's leaves, placements and DCP keys (refused: anything but tensors, a
        shard without its record, expert shards with several ranks and no group)."""
        self.leaves = placements(tree, self.ranks)
        bad = [k for k, leaf, _ in self.leaves if not isinstance(leaf, torch.Tensor)]
        if bad:
            raise ValueError(f"checkpoints hold trees of tensors; {bad[:3]} are not (keep step "
                             f"counters and other values beside the tree)")
        experts = any(where == EXPERTS for _, _, where in self.leaves)
        if self.ep is None and experts and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() > 1:
            raise ValueError("this tree holds expert shards and torch.distributed runs "
                             "several ranks, but no group was given (None means one "
                             "process): pass the mesh or group the experts are sharded "
                             "over")
        self.names = [_name(path) for path, _ in pytree.tree_flatten_with_path(tree)[0]]
        if len(set(self.names)) != len(self.names):
            raise ValueError("two leaves of the tree flatten to the same checkpoint key; give "
                             "them distinct names")

    def on_rank_zero(self, work, what) -> None:
        """``work()`` on rank 0, its failure raised on every rank (none left waiting)."""
        error = None
        if self.rank == 0:
            try:
                work()
            except OSError as err:
                error = err
        self.agree(error, what)

    def state_dict(self, tree) -> dict:
        out = {}
        for name, (_, leaf, where), (_, now, _) in zip(self.names, self.leaves,
                                                       placements(tree)):
            if _is_dtensor(now):                 # placed by its maker (a sharded optimizer)
                pass
            elif where == EXPERTS and self.ep is not None:
                from torch.distributed.tensor import DTensor, Shard
                shape = (now.shape[0] * self.ranks, *now.shape[1:])
                now = DTensor.from_local(now, self._ep_mesh(now.device.type), [Shard(0)],
                                         run_check=False, shape=torch.Size(shape),
                                         stride=_contiguous_strides(shape))
            out[name] = now
        return out

    def _ep_mesh(self, device_type):
        if self._mesh is None or self._mesh.device_type != device_type:
            from torch.distributed.device_mesh import DeviceMesh
            self._mesh = DeviceMesh.from_group(self.ep, device_type)
        return self._mesh

    def manifest(self, tree) -> dict:
        return {"format": FORMAT, "version": VERSION, "ranks": self.ranks,
                "leaves": [{"key": n, "shape": self._global(leaf, where), "dtype": str(leaf.dtype),
                            "placement": where}
                           for n, (_, leaf, where) in zip(self.names, self.leaves)]}

    def _global(self, leaf, where) -> list[int]:
        shape = list(leaf.shape)                 # a DTensor's is global already
        if where == EXPERTS and shape and not _is_dtensor(leaf):
            shape[0] *= self.ranks
        return shape

    def check(self, manifest, like) -> None:
        saved = {e["key"]: e for e in manifest["leaves"]}
        missing = [n for n in self.names if n not in saved]
        extra = [n for n in saved if n not in set(self.names)]
        if missing or extra:
            said = [f"lacks {missing[:3]}"] * bool(missing) + \
                [f"holds {extra[:3]} beyond this tree's"] * bool(extra)
            raise ValueError(f"the checkpoint holds another tree: it {' and '.join(said)} "
                             f"(another model's checkpoint, or another part of the state?)")
        for name, (_, leaf, where) in zip(self.names, self.leaves):
            entry = saved[name]
            if entry["dtype"] != str(leaf.dtype):
                raise ValueError(f"{name} was saved as {entry['dtype']}, and is "
                                 f"{leaf.dtype} here")
            if where == EXPERTS and entry["shape"] and self.ranks \
                    and entry["shape"][0] % self.ranks:
                raise ValueError(f"{name}: {entry['shape'][0]} experts do not split over "
                                 f"{self.ranks} ranks")
            if entry["shape"] != self._global(leaf, where):
                raise ValueError(f"{name} has shape {entry['shape']} in the checkpoint and "
                                 f"{self._global(leaf, where)} here (another model's "
                                 f"checkpoint, or a tree sharded for another group?)")

    def agree(self, error, what) -> None:
        if self.pg is None and self.ep is None:
            if error is not None:
                raise error
            return
        agree(self.pg, error, what)

    def broadcast(self, value):
        if self.ep is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, 0)
                                   if self.pg is not None else 0, group=self.pg)
        return box[0]

    @contextlib.contextmanager
    def quiet(self):
        """One process: DCP's warning that it assumes one process is what was asked for."""
        with warnings.catch_warnings():
            if self.ep is None:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield


def _name(path) -> str:
    """A DCP key from a pytree key path: ``{"a": {"b": [x]}}`` -> ``"a/b/#0"`` (a list's
    index marked, so that a list never loads as a dict)."""
    parts = []
    for key in path:
        if isinstance(key, pytree.SequenceKey):
            parts.append(f"#{key.idx}")
        elif isinstance(key, pytree.MappingKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return "/".join(parts) if parts else "."


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _empty_like(t, device):
    """A tensor to load into, shaped as ``t`` (a DTensor: its local shard, placed alike)."""
    if not isinstance(t, torch.Tensor):
        return t
    if _is_dtensor(t):
        from torch.distributed.tensor import DTensor
        local = t.to_local()
        return DTensor.from_local(torch.empty(local.shape, dtype=local.dtype,
                                              device=local.device),
                                  t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return torch.empty(t.shape, dtype=t.dtype,
                       device=device if t.device.type == "meta" else t.device)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _check_target(path, target) -> None:
    """``path`` is free, or a link this function's saves made: ``{name}.{12 hex}`` beside
    it, holding a manifest (anything else is the user's, never replaced or removed)."""
    if not os.path.lexists(target):
        return
    pointed = os.readlink(target) if os.path.islink(target) else None
    if pointed is None or not _made_by_save(os.path.basename(target), pointed) or \
            os.path.dirname(pointed) or not os.path.isfile(
                os.path.join(os.path.dirname(target), pointed, MANIFEST)):
        raise ValueError(f"{path} exists and is not a checkpoint link save_checkpoint made: "
                         f"pick another path (a save replaces only its own checkpoints)")


def _made_by_save(base, name, suffix="") -> bool:
    """Whether ``name`` is one a save of ``base`` makes beside it: ``{base}.{12 hex}`` (a
    save), with ``.tmp`` (one being written) or ``.link`` (its link, before it moves the
    name)."""
    return re.fullmatch(re.escape(base) + r"\.[0-9a-f]{12}" + suffix, name) is not None


def _remove_stale(target) -> None:
    """What saves of ``target`` left beside it: staging folders and links of saves that
    stopped part-way, and complete saves the name no longer points to."""
    folder, base = os.path.split(target)
    current = os.path.realpath(target) if os.path.islink(target) else None
    for name in os.listdir(folder or "."):
        there = os.path.join(folder, name)
        if _made_by_save(base, name, r"\.link") and os.path.islink(there):
            os.remove(there)
        elif (_made_by_save(base, name, r"\.tmp") or _made_by_save(base, name)) \
                and os.path.isdir(there) and not os.path.islink(there) \
                and os.path.realpath(there) != current:
            shutil.rmtree(there, ignore_errors=True)


def _write_json(name, payload) -> None:
    with open(name, "w") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())


def _digest_file(name) -> str:
    h = hashlib.sha256()
    with open(name, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_manifest(path, folder, digests: bool = True) -> dict:
    """The manifest of the checkpoint in ``folder``, checked against the files beside it:
    DCP's metadata by its digest, every data file by its size, and with ``digests`` by its
    digest too (one rank reads them all; the others wait for its word)."""
    name = os.path.join(folder, MANIFEST)
    try:
        with open(name) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path} is not a pagedstash_func checkpoint (no {MANIFEST} in "
                         f"{folder}): pass the path given to save_checkpoint; files of the "
                         f"older save_sharded are read by load_sharded") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"{name} is not readable ({type(err).__name__}: {err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or manifest.get("version") != VERSION or not isinstance(manifest.get("leaves"), list):
        raise ValueError(f"{name} is not a pagedstash_func checkpoint manifest of version "
                         f"{VERSION}")
    meta = os.path.join(folder, ".metadata")
    if not os.path.exists(meta) or _digest_file(meta) != manifest.get("metadata"):
        raise ValueError(f"{folder}: DCP's metadata is missing or does not match the "
                         f"checkpoint's manifest (a damaged or altered checkpoint)")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ValueError(f"{name} lists no data files")
    for file, entry in files.items():
        there = os.path.join(folder, str(file))
        if not isinstance(entry, list) or len(entry) != 2 or os.path.basename(there) != file:
            raise ValueError(f"{name} is not a pagedstash_func checkpoint manifest")
        if not os.path.isfile(there) or os.path.getsize(there) != entry[0] or \
                (digests and _digest_file(there) != entry[1]):
            raise ValueError(f"{there} is missing or damaged: it does not match the "
                             f"checkpoint's manifest")
    if any(not isinstance(e, dict) or not {"key", "shape", "dtype", "placement"} <= set(e)
           for e in manifest["leaves"]):
        raise ValueError(f"{name} is not a pagedstash_func checkpoint manifest")
    _read_metadata(folder)           # refused here, on every rank together, not inside DCP
    return manifest


# What DCP's metadata pickle may build: its own metadata classes and the values they hold
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
     ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "PureWindowsPath"), ("builtins", "set"),
     ("builtins", "frozenset")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"DCP metadata names {module}.{name}, which a checkpoint "
                                     f"of tensors never holds")


def _read_metadata(folder):
    """DCP's metadata of the checkpoint in ``folder``, built by `_MetadataUnpickler`; refused
    if it holds entries of pickled objects (DCP would ``torch.load`` them with
    ``weights_only=False``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        try:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
            objects = [k for k, v in metadata.state_dict_metadata.items()
                       if isinstance(v, BytesStorageMetadata)]
        except Exception as err:
            raise ValueError(f"{folder}: DCP's metadata is not that of a checkpoint of "
                             f"tensors ({type(err).__name__}: {err})") from None
    if objects:
        raise ValueError(f"{folder} holds pickled objects ({objects[:3]}), which a "
                         f"pagedstash_func checkpoint never does")
    files = {getattr(info, "relative_path", None)
             for info in (metadata.storage_data or {}).values()}
    outside = [f for f in files if not isinstance(f, str) or not f or "/" in f or "\\" in f
               or f.startswith(".")]
    if outside:
        raise ValueError(f"{folder}: DCP's metadata names data files outside the checkpoint's "
                         f"folder ({outside[:2]})")
    return metadata


def _SafeReader(folder):
    """DCP's file reader, its metadata read by `_read_metadata`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = _read_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata
    return SafeReader(folder)
