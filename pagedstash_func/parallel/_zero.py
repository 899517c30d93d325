"""ZeRO-1: an optimizer's fp32 master weights and state sharded over the ranks that replicate
each parameter, with ``torch.optim`` doing the arithmetic.

Each parameter is a flat vector split over the ranks that hold the same copy of it, in
``torch.chunk`` pieces: a replicated tensor over every rank of the mesh (in rank order), an
expert shard over the ``dp`` ranks of its ``ep`` rank. Per bucket (parameters of one kind and
dtype, up to `BUCKET_BYTES`), one ``reduce_scatter`` sums the gradients straight into each
rank's pieces, the optimizer (its own ``step``, ``foreach`` or ``fused``) updates the pieces
of the fp32 master weights it holds, and one ``all_gather`` brings the updated weights back
into the parameters, in place, in their own dtype. The pieces are the local shards of
``Shard(0)`` DTensors for checkpoints (`save_checkpoint` of `ShardedOptimizer.state_tree`), so
a state saved on one mesh loads on another. With ``offload=True`` the masters and the state
live in host memory and are stepped there (`_offload`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.utils._pytree

from ._mesh import check_max_norm, check_mesh, clip_scale, ep_size, is_mesh
from ._offload import HostSteps
from ._placement import (
    EXPERTS, ExpertShard, agree, agree_on_tree, collective_device, placements,
)

__all__ = ["ShardedOptimizer", "sharded_optimizer"]

BUCKET_BYTES = 1 << 28          # fp32 bytes of a bucket's gradients, reduced in one call


class _Bucket:
    """Parameters reduced, updated and gathered together: ``S`` ranks, and per parameter
    ``c = ceil(L / S)`` elements of its flat ``L`` on each (the last pieces short or empty,
    as ``torch.chunk`` cuts them)."""

    def __init__(self, kind, params, keys, group, ranks, me, dmesh, host=False, align=1):
        self.kind, self.params, self.keys = kind, params, keys
        self.group, self.ranks, self.me, self.dmesh = group, ranks, me, dmesh
        self.sizes = [p.numel() for p in params]
        self.pieces, self.width = pieces_of(self.sizes, ranks, align)
        first = params[0]
        # fp32 master weights (fp64 ones for fp64 parameters), on the host when offloaded
        self.dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
        self.master = torch.zeros(self.width, dtype=self.dtype,
                                  device="cpu" if host else first.device)
        self.master.copy_(self._rows([p.detach() for p in params])[self.me])

    def _rows(self, tensors) -> torch.Tensor:
        """``[S, width]`` in the master's dtype on the parameters' device: row ``q`` the
        ``q``-th pieces of every tensor, zero-padded; each written straight from the tensor
        (a converting copy)."""
        out = torch.zeros(self.ranks, self.width, dtype=self.dtype,
                          device=self.params[0].device)
        at = 0
        for t, n, c in zip(tensors, self.sizes, self.pieces):
            if c:
                flat, full = t.reshape(-1), n // c
                block = out[:, at:at + c]
                if full:
                    block[:full].copy_(flat[:full * c].view(full, c))
                if n - full * c:
                    block[full, :n - full * c].copy_(flat[full * c:])
            at += c
        return out

    def reduce(self, grads) -> torch.Tensor:
        """This rank's pieces of the gradients summed over the bucket's ranks (in the
        master's dtype)."""
        rows = self._rows([g.detach() for g in grads])
        if self.group is None or self.ranks == 1:      # nothing to sum over
            return rows[0]
        out = torch.empty(self.width, dtype=self.dtype, device=rows.device)
        dist.reduce_scatter_tensor(out, rows.reshape(-1), op=dist.ReduceOp.SUM,
                                   group=self.group)
        return out

    def gather(self) -> None:
        """Every rank's updated pieces, back into the parameters (their dtype), in place."""
        dtype = self.params[0].dtype
        mine = self.master.to(self.params[0].device, dtype)
        if self.group is None:
            rows = mine.view(1, -1)
        else:
            rows = torch.empty(self.ranks * self.width, dtype=dtype, device=mine.device)
            dist.all_gather_into_tensor(rows, mine, group=self.group)
            rows = rows.view(self.ranks, self.width)
        self.scatter(rows)

    def scatter(self, rows) -> None:
        """``rows`` (``[S, width]``, the parameters' dtype and device: every rank's pieces)
        written into the parameters."""
        at = 0
        with torch.no_grad():
            for p, n, c in zip(self.params, self.sizes, self.pieces):
                if c:
                    whole = p if p.is_contiguous() else torch.empty(p.shape, dtype=p.dtype,
                                                                     device=p.device)
                    flat, full, block = whole.view(-1), n // c, rows[:, at:at + c]
                    if full:
                        flat[:full * c].view(full, c).copy_(block[:full])
                    if n - full * c:
                        flat[full * c:].copy_(block[full, :n - full * c])
                    if whole is not p:
                        p.copy_(whole)
                at += c

    def local(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s real elements in ``flat`` (this rank's piece, padding cut)."""
        at = sum(self.pieces[:i])
        c, n = self.pieces[i], self.sizes[i]
        real = max(0, min(c, n - self.me * c))
        return flat[at:at + real]


class ShardedOptimizer:
    """A ``torch.optim`` optimizer over fp32 master weights sharded over the ranks that
    replicate each parameter (ZeRO-1). Made by `sharded_optimizer`.

    ``opt.step(params, grads)`` takes the full gradients a step returns (`run_step`'s
    ``res.grads``, before any reduction: it sums them itself), reduce-scatters them, clips them
    to a global norm if asked, steps the optimizer on this rank's pieces and writes the
    updated weights into ``params`` in place.

    Args:
        params: the parameter tree (floating-point tensors, expert shards recorded as such),
            the same on every rank but for its experts.
        group: a ``("dp", "ep")`` mesh, a process group (expert parallelism alone: the
            replicated parameters are sharded over it, the experts not), or ``None``: nothing
            sharded, this rank's whole state kept here (reduce the gradients first with
            `psf.reduce_gradients` when several ranks run).
        optimizer: a ``torch.optim.Optimizer`` class (default ``torch.optim.AdamW``).
        max_norm: clip the gradients to this global norm before each step (``None``: no
            clipping).
        offload: keep the master weights and the optimizer's state in host memory and step
            them there, a bucket at a time, overlapped with the copies (`HostSteps`); with
            ``torch.optim.AdamW`` or ``Adam`` and neither ``fused`` nor ``foreach`` given,
            the host's optimizer is the fused one. One process's whole state (``group``
            ``None``).
        **optimizer_kwargs: the optimizer's own (``lr``, ``betas``, ``weight_decay``,
            ``foreach``, ``fused``); one set for every parameter.

    Attributes:
        optimizer: the ``torch.optim`` optimizer over this rank's flat pieces.

    Raises:
        ValueError: a mesh whose dims are not ``("dp", "ep")``, params sharded for another
            ``ep`` size, a leaf that is not a floating-point tensor, a plain dict holding an
            expert shard without its record, ``max_norm`` not a finite number > 0, or
            ``offload`` with a group.
    """

    def __init__(self, params, group=None, optimizer=torch.optim.AdamW, max_norm=None,
                 offload=False, **optimizer_kwargs):
        if max_norm is not None:
            check_max_norm(max_norm)
        if offload and group is not None:
            raise ValueError("offload keeps one process's whole state on its host; with a "
                             "group the state is already sharded over the ranks. Pass "
                             "group=None with offload=True (reduce the gradients first with "
                             "psf.reduce_gradients), or offload=False with the group")
        _check_made_with(group, optimizer)
        if offload and optimizer in (torch.optim.AdamW, torch.optim.Adam) \
                and "fused" not in optimizer_kwargs and "foreach" not in optimizer_kwargs:
            optimizer_kwargs = {**optimizer_kwargs, "fused": True}
        self.max_norm, self.group = max_norm, group
        self._broken = None
        if group is not None:                      # before any collective: every rank alike
            _check_sharded_for(params, group)
        elif max_norm is not None and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() > 1 and any(
                    where == EXPERTS for _, _, where in placements(params)):
            raise ValueError("max_norm without a group, with expert shards on several "
                             "ranks: each rank would clip by the norm of its own experts. Pass "
                             "the mesh or group (or clip with psf.clip_grad_norm(grads, "
                             "max_norm, group) before the step)")
        sharding = _Sharding(group)
        ep_ranks = sharding.ep_ranks
        placed = placements(params, ep_ranks)
        odd = [k for k, t, _ in placed
               if not isinstance(t, torch.Tensor) or not t.is_floating_point()]
        if odd:
            raise ValueError(f"a sharded optimizer steps floating-point tensors; {odd[:3]} are "
                             f"not (keep other values beside the tree)")
        if not placed:
            raise ValueError("params hold no tensor: a sharded optimizer needs the tree of "
                             "parameters it steps")
        self._keys = [k for k, _, _ in placed]
        align = low_bit_block(optimizer, optimizer_kwargs)
        self.buckets = [_Bucket(where, [t for _, t in chunk], [k for k, _ in chunk],
                                *sharding.of(where), host=offload, align=align)
                        for where, chunk in grouped_buckets(placed)]
        self._world = sharding.world
        if self._world is not None:             # the ranks' trees agree, or all refuse
            agree_on_tree(placed, [self._world])
        self.optimizer = optimizer([b.master for b in self.buckets], **optimizer_kwargs)
        self._made_by = (optimizer, optimizer_kwargs)
        self._host = HostSteps(self.buckets, self.buckets[0].params[0].device) \
            if offload and self.buckets else None

    def step(self, params, grads) -> torch.Tensor | None:
        """One optimizer step from the full gradients; ``params`` updated in place.

        Args:
            params: the tree given at construction (the same tensors).
            grads: gradients shaped like ``params``, as a step returns them (unreduced).

        Returns:
            The global gradient norm before clipping (0-d fp32) with ``max_norm``, else None.

        Raises:
            ValueError: ``params`` or ``grads`` are not shaped like the tree given at
                construction, or ``params`` are other tensors.
        """
        if self._broken:
            raise ValueError(f"this optimizer is half-stepped: {self._broken}. Its state and "
                             f"the weights no longer belong to one step: load a checkpoint "
                             f"(load_state_tree) or make a new optimizer")
        error, by_key = None, {}
        try:
            by_key = self._checked_grads(params, grads)
        except ValueError as err:
            error = err
        self._agree(error, "the optimizer's step")
        return self._step_by_bucket(by_key)

    def _checked_grads(self, params, grads) -> dict:
        """``{key: gradient}`` once ``params`` are the tensors this optimizer steps and
        ``grads`` a tensor of each one's shape (`ValueError` naming the first that is not)."""
        mine = placements(params, 1)
        if [k for k, _, _ in mine] != self._keys:
            raise ValueError("params are not the tree this optimizer was made for")
        theirs = placements(grads, 1)
        if [k for k, _, _ in theirs] != self._keys:
            raise ValueError("grads are not shaped like the params this optimizer steps")
        by_key, held = {k: g for k, g, _ in theirs}, {k: t for k, t, _ in mine}
        for b in self.buckets:
            if any(held[k] is not p for k, p in zip(b.keys, b.params)):
                raise ValueError("params are other tensors than the ones this optimizer "
                                 "was made for: it writes the updated weights into those, "
                                 "in place")
        for key, g in by_key.items():
            p = held[key]
            if not isinstance(g, torch.Tensor) or g.shape != p.shape \
                    or not g.is_floating_point():
                raise ValueError(f"grads{key} must be a floating-point tensor of its "
                                 f"parameter's shape {tuple(p.shape)}, got "
                                 f"{getattr(g, 'dtype', type(g).__name__)} "
                                 f"{tuple(getattr(g, 'shape', ()))}")
        return by_key

    def _step_by_bucket(self, by_key) -> torch.Tensor | None:
        """`step` a bucket at a time: each bucket's fp32 gradient piece made (reduce-scattered
        where ranks share it), stepped, gathered and freed in turn (on the host's side when
        offloaded, `HostSteps.run`), so a step holds one or two buckets' pieces, not every
        bucket's. With clipping the norm comes first, from a pass over the same pieces summed
        in bucket order: a piece that ranks reduced is held from that pass to its step (a
        second reduce-scatter would cost the communication again), one that no rank shares
        (an expert bucket where ``dp`` is 1, or one process) is made again from the
        gradients."""
        held: dict = {}

        def piece(i):
            if i in held:
                return held.pop(i)
            b = self.buckets[i]
            return b.reduce([by_key[k] for k in b.keys])

        def for_norm(i):
            p = piece(i)
            if self.buckets[i].ranks > 1:
                held[i] = p
            return p
        norm = scale = None
        if self.max_norm is not None:
            norm, scale = self._clip(for_norm(i) for i in range(len(self.buckets)))
        done = [0]                 # buckets stepped: a failure part way is recorded
        try:
            if self._host is not None:
                self._host.run(self.buckets, piece, self.optimizer, scale, done)
                return norm
            for i, b in enumerate(self.buckets):
                g = piece(i)
                if scale is not None:
                    g.mul_(scale.to(g.dtype))
                b.master.grad = g
                del g                            # one bucket's piece alive at a time
                try:
                    self.optimizer.step()        # only this bucket's master has a gradient
                finally:
                    b.master.grad = None
                done[0] += 1
                b.gather()
        except BaseException as err:
            if done[0]:
                self._broken = (f"a step failed after {done[0]} of {len(self.buckets)} "
                                f"buckets had been stepped ({type(err).__name__}: {err})")
            raise
        return norm

    def _clip(self, pieces) -> tuple[torch.Tensor, torch.Tensor]:
        """``(global norm, clipping scale)`` from this rank's gradient ``pieces`` (summed
        in fp32, in bucket order, over the ranks that share the state)."""
        first = self.buckets[0].params[0]
        sq = sum((p.float().square().sum() for p in pieces),
                 torch.zeros((), dtype=torch.float32, device=first.device))
        if self._world is not None:
            dist.all_reduce(sq, group=self._world)
        norm = sq.sqrt()
        return norm, clip_scale(norm, self.max_norm)

    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory this optimizer holds (the offloaded copies' slots;
        0 without offload or on a CPU device)."""
        return self._host.pinned_bytes() if self._host is not None else 0

    @property
    def offloaded(self) -> bool:
        """Whether the masters and the state live in host memory (``offload=True``)."""
        return self._host is not None

    def offload_times(self) -> dict[str, float]:
        """Where the last finished offloaded step's time went, in seconds
        (`HostSteps.last_times`): ``wall``, ``gradients`` (waiting for the device's
        backward), ``optimizer``, ``cast`` and ``wait`` on the host's clock, ``to_host`` and
        ``to_device`` the copies' (on CUDA the side stream's). A diagnostic: on CUDA it blocks
        until that step's last copy is done, so read it between steps, not inside a loop
        that should overlap the copies with the next forward.

        Raises:
            ValueError: the optimizer is not offloaded, or no step of it has finished (none
                ran, or the last one failed part way).
        """
        if self._host is None:
            raise ValueError("offload_times is the offloaded step's breakdown: make the "
                             "optimizer with offload=True")
        times = self._host.last_times()
        if not times:
            raise ValueError("offload_times: no step of this optimizer has finished (none "
                             "ran, or the last one failed part way); call opt.step(params, "
                             "grads) first")
        return times

    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: its fp32 master pieces and the
        optimizer's state tensors over them (in host memory when offloaded)."""
        total = sum(b.master.nbytes for b in self.buckets)
        for state in self.optimizer.state.values():
            total += sum(stored_bytes(v) for v in state.values()
                         if isinstance(v, torch.Tensor) and v.dim())
        return total

    def state_tree(self) -> dict:
        """This rank's state as a tree for `save_checkpoint` and `load_checkpoint` (with the
        optimizer's ``group``): ``{"master": {key: piece}, name: {key: piece}}`` for the
        optimizer's state tensors of the master's shape, and ``{name: {key: value}}`` for
        its 0-d ones (a step count), each parameter's pieces a DTensor of its global flat
        vector where a group shards it. Before the first step the tree has the shapes and
        dtypes the state will have (a ``like`` for `load_checkpoint`; its values are not a
        state to save), the optimizer itself untouched. The pieces are views of the live
        state (no copy of it is made): save them before the next step, or clone the tree
        for a snapshot held in memory."""
        out: dict = {"master": {}}
        self._check_plain_state()
        for b in self.buckets:
            state = self.optimizer.state.get(b.master) or self._made_state(b)
            for name, flat in [("master", b.master)] + [
                    (n, v) for n, v in state.items() if isinstance(v, torch.Tensor)]:
                for i, key in enumerate(b.keys):
                    out.setdefault(name, {})[key] = _as_dtensor(b, flat, i) if flat.dim() \
                        else flat.detach().clone()
        return out

    def load_state_tree(self, tree) -> None:
        """Set this rank's state from a tree shaped like `state_tree`'s (as `load_checkpoint`
        returns it), and write the master weights into the parameters."""
        self._check_plain_state()
        made_on = {self.buckets[0].master.device: self._made_state(self.buckets[0])}
        self._check_tree(tree, made_on[self.buckets[0].master.device])
        names = [n for n in tree if n != "master"]
        for b in self.buckets:
            state = {}
            for name in names:
                first = tree[name][b.keys[0]]
                if first.dim():                  # pieces: this rank's flat state tensor
                    flat = torch.zeros_like(b.master)
                    for i, key in enumerate(b.keys):
                        b.local(flat, i).copy_(_local(tree[name][key]))
                    state[name] = flat
                else:      # 0-d (a step count), on the device the optimizer keeps it on
                    if b.master.device not in made_on:
                        made_on[b.master.device] = self._made_state(b)
                    state[name] = first.detach().clone().to(
                        made_on[b.master.device][name].device)
            with torch.no_grad():
                for i, key in enumerate(b.keys):
                    b.local(b.master, i).copy_(_local(tree["master"][key]))
            self.optimizer.state[b.master] = state
            b.gather()
        self._broken = None

    def _check_tree(self, tree, made) -> None:
        """`ValueError` unless ``tree`` holds the master and every state tensor this
        optimizer makes (``made``, `_made_state`'s), each with an entry per parameter,
        pieces of this rank's sizes."""
        want = {"master"} | {n for n, v in made.items() if isinstance(v, torch.Tensor)}
        got = set(tree) if isinstance(tree, dict) else set()
        if got != want:
            raise ValueError(f"a state tree for {self._made_by[0].__name__} holds "
                             f"{sorted(want)}; this one holds {sorted(got)}: load the tree "
                             f"this optimizer's state_tree() saved (same optimizer class)")
        for name in want:
            missing = [k for k in self._keys if k not in tree[name]]
            if missing:
                raise ValueError(f"the state tree's {name!r} lacks {missing[:3]}: it was "
                                 f"saved for other params")
        for b in self.buckets:
            for i, key in enumerate(b.keys):
                for name in want:
                    piece = tree[name][key]
                    if piece.dim() and _local(piece).numel() != b.local(b.master, i).numel():
                        raise ValueError(f"the state tree's {name}{key} holds "
                                         f"{_local(piece).numel()} elements here, this rank's "
                                         f"piece {b.local(b.master, i).numel()}: load it with "
                                         f"the group it was saved for (load_checkpoint "
                                         f"reshards)")

    def _check_plain_state(self) -> None:
        if low_bit_block(*self._made_by) > 1:
            raise ValueError(f"a state tree holds plain tensors; {self._made_by[0].__name__}'s "
                             f"quantized state is not one. Checkpoint with "
                             f"torch.optim.AdamW (the default), or save opt.optimizer's "
                             f"state_dict yourself")

    def _made_state(self, bucket) -> dict:
        """The state the optimizer makes for ``bucket`` at its first step: made by a copy
        of it over a copy of the master, from a zero gradient (the optimizer itself and its
        state untouched)."""
        probe = bucket.master.detach().clone()
        probe.grad = torch.zeros_like(probe)
        other = self._made_by[0]([probe], **self._made_by[1])
        other.step()
        return {n: (torch.zeros_like(v) if v.dim() else v) if isinstance(v, torch.Tensor)
                else v for n, v in other.state[probe].items()}

    def _agree(self, error, what) -> None:
        """``error`` raised on every rank if any rank has one (none left in a collective)."""
        if self._world is None:
            if error is not None:
                raise error
            return
        agree(self._world, error, what)


def _check_made_with(group, optimizer) -> None:
    """`ValueError` for a ``group`` that is not a mesh, a process group or None (an
    optimizer class passed in its place), or an ``optimizer`` that is not a class."""
    groups = getattr(dist, "ProcessGroup", ())           # absent where dist is not built
    if isinstance(group, type) or (group is not None and not is_mesh(group)
                                   and not isinstance(group, groups)):
        raise ValueError(f"group must be a ('dp', 'ep') mesh, a process group or None, got "
                         f"{getattr(group, '__name__', type(group).__name__)}: pass the "
                         f"optimizer class as optimizer=...")
    if optimizer is torch.optim.LBFGS:
        raise ValueError("LBFGS steps with a closure that re-evaluates the loss, which a "
                         "sharded optimizer (given gradients) cannot call: use a first-order "
                         "optimizer such as torch.optim.AdamW")
    if not isinstance(optimizer, type) or not issubclass(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer class (e.g. "
                         f"torch.optim.AdamW), got {optimizer!r}: the sharded optimizer makes "
                         f"it over its own flat pieces")


def pieces_of(sizes, ranks: int, align: int = 1) -> tuple[list[int], int]:
    """``(pieces, width)`` of a bucket of parameters of ``sizes`` elements split over
    ``ranks``: ``ceil(n / ranks)`` elements of each on every rank, and the bucket's flat
    width, their sum rounded up to ``align`` (a low-bit optimizer's block)."""
    pieces = [math.ceil(n / ranks) if n else 0 for n in sizes]
    return pieces, -(-sum(pieces) // align) * align


def low_bit_block(optimizer, kwargs) -> int:
    """The block a torchao low-bit optimizer quantizes its state in (its ``block_size``,
    default 256), so each bucket is a whole number of blocks; 1 for any other optimizer."""
    import inspect
    if not getattr(optimizer, "__module__", "").startswith("torchao"):
        return 1
    try:
        block = inspect.signature(optimizer).parameters.get("block_size")
    except (TypeError, ValueError):
        return 1
    return 1 if block is None else int(kwargs.get("block_size", block.default))


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor stores: a wrapper subclass's inner tensors (torchao's 8-bit state
    reports its logical fp32 size as ``nbytes``)."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        return sum(stored_bytes(getattr(t, n)) for n in t.__tensor_flatten__()[0])
    return t.nbytes


def grouped_buckets(placed):
    """``(placement, [(key, tensor), ...])`` of each bucket a sharded optimizer makes:
    ``placed`` (`placements`) grouped by placement, dtype and device, each group cut by
    `_bucketed`."""
    groups: dict = {}
    for key, t, where in placed:
        groups.setdefault((where, t.dtype, t.device), []).append((key, t))
    for (where, _, _), members in groups.items():
        for chunk in _bucketed(members):
            yield where, chunk


def _bucketed(members):
    """``members`` (``(key, tensor)`` pairs) in runs of at most `BUCKET_BYTES` of fp32 (a
    tensor larger than that alone)."""
    chunk, size = [], 0
    for key, t in members:
        if chunk and size + 4 * t.numel() > BUCKET_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append((key, t))
        size += 4 * t.numel()
    yield chunk


def _local(piece):
    """The local tensor of a piece (a DTensor where a group shards it)."""
    return piece.to_local() if hasattr(piece, "to_local") else piece


def _check_sharded_for(params, group) -> None:
    """`ValueError` unless each `ExpertShard` of ``params`` holds its router's experts over
    ``group``'s ``ep`` ranks (a tree sharded for another mesh would be stepped as if it were
    this one's)."""
    ranks = ep_size(group)
    nodes = torch.utils._pytree.tree_flatten_with_path(
        params, is_leaf=lambda n: isinstance(n, ExpertShard))[0]
    for path, node in nodes:
        if isinstance(node, ExpertShard) and "router" in node and "w_gate_up" in node:
            experts, local = node["router"].shape[0], node["w_gate_up"].shape[0]
            if local * ranks != experts:
                raise ValueError(
                    f"params{torch.utils._pytree.keystr(path)} holds {local} of {experts} "
                    f"experts, but the group's ep size is {ranks}: pass the mesh or group the "
                    f"params were sharded for")


def _as_dtensor(bucket, flat, i):
    """Parameter ``i``'s piece of ``flat`` as the local shard of its global flat vector."""
    from torch.distributed.tensor import DTensor, Shard
    piece = bucket.local(flat, i)
    if bucket.dmesh is None:
        return piece
    n = bucket.sizes[i]
    shape = (n * bucket.dmesh.size() // bucket.ranks,) if bucket.kind == EXPERTS else (n,)
    placements = [Shard(0)] * bucket.dmesh.ndim
    return DTensor.from_local(piece, bucket.dmesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=(1,))


class _Sharding:
    """Which ranks hold the same copy of a parameter, by its placement."""

    def __init__(self, group):
        self.group = group
        if group is None:
            self.ep_ranks, self.world = 1, None
            return
        from torch.distributed.device_mesh import DeviceMesh
        if is_mesh(group):
            check_mesh(group)
            grid = group.mesh                                  # [dp, ep] global ranks
            self.ep_ranks = grid.shape[1]
            device = group.device_type
            # experts: ep outer, dp inner (a rank's experts are split over its dp replicas)
            self._experts = DeviceMesh(device, grid.t().contiguous(),
                                       mesh_dim_names=("ep", "dp"))
            # replicated: every rank in rank order (a process group orders its ranks so,
            # and a DTensor's piece index must be the rank's place in the group)
            self._replicated = DeviceMesh(device, grid.reshape(-1).sort().values)
            self._dp = group.get_group("dp")
            self.world = None if grid.numel() == 1 else self._replicated.get_group()
        else:
            self.ep_ranks = dist.get_world_size(group)
            self.world = group
            self._replicated = DeviceMesh.from_group(group, collective_device(group).type)
            self._experts = self._replicated          # each rank's own experts, whole
            self._dp = None

    def of(self, where):
        """``(process group, ranks, this rank's index, DTensor mesh)`` a parameter of
        placement ``where`` is split over."""
        if self.group is None:
            return None, 1, 0, None
        if where == EXPERTS:
            if self._dp is None:              # expert parallelism alone: nothing replicates
                return None, 1, 0, self._experts
            return (self._dp, dist.get_world_size(self._dp), dist.get_rank(self._dp),
                    self._experts)
        g = self._replicated.get_group()
        return g, dist.get_world_size(g), dist.get_rank(g), self._replicated


def sharded_optimizer(params, group=None, optimizer=torch.optim.AdamW, *, max_norm=None,
                      offload=False, **optimizer_kwargs) -> ShardedOptimizer:
    """A `ShardedOptimizer`: ``optimizer`` over fp32 master weights sharded (ZeRO-1) over
    the ranks that replicate each parameter of ``params``.

    Args:
        params: the parameter tree (expert shards recorded as such: `psf.placements`).
        group: a ``("dp", "ep")`` mesh, a process group (expert parallelism alone), or
            ``None`` (one process).
        optimizer: a ``torch.optim.Optimizer`` class (default ``torch.optim.AdamW``).
        max_norm: clip to this global gradient norm each step (``None``: no clipping).
        offload: master weights and state in host memory, stepped there (one process,
            ``group`` ``None``): what fits a model whose state the device cannot hold.
        **optimizer_kwargs: the optimizer's own arguments (``lr``, ...).

    Returns:
        A `ShardedOptimizer`; ``opt.step(params, res.grads)`` each step.

    Raises:
        ValueError: as `ShardedOptimizer` raises it.

    Example::

        opt = psf.sharded_optimizer(params, mesh, torch.optim.AdamW, lr=3e-4, max_norm=1.0)
        for batch in batches:
            res = psf.run_step(step, params, batch, state)
            state = res.state
            opt.step(params, res.grads)        # reduce-scatter, clip, AdamW, all-gather
    """
    return ShardedOptimizer(params, group, optimizer, max_norm, offload, **optimizer_kwargs)
