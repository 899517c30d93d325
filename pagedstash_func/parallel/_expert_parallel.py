"""Expert parallelism: sharded parameters, the routes of a call across ranks, replicated
gradients, and errors decided on every rank together.

``params = psf.shard_experts(full, group)`` keeps the router whole and this rank's ``E/R``
experts; ``psf.moe(params, x, top_k=k, group=group)`` then runs with ``x`` this rank's tokens.
The exchanges themselves are in `_comm`.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ..experts._experts import Routed
from . import _symmetric
from ._comm import ExactSplits, ExchangeCounts, ExchangePlan, ExchangeRoute, PlanStatic, \
    capacity_transport
from ._mesh import check_experts_split, ep_position
from ._placement import (
    ExpertShard, agree, agree_on_tree, all_reduce_flat, gather_rows, placements, split,
)


def shard_experts(params, group=None) -> ExpertShard:
    """This rank's share of one MoE layer's parameters (copies; the full ones can go).

    Rank ``r`` of ``group`` (``R`` ranks) keeps experts ``[r E/R, (r+1) E/R)``; every rank must
    pass the same full parameters (same seed).

    Args:
        params: the full layer's dict (`moe_init`): ``router [E, H]``, ``w_gate_up
            [E, H, 2F]``, ``w_down [E, F, H]`` and any optional entries.
        group: the process group to shard over, or a ``("dp", "ep")`` ``DeviceMesh``: the
            experts are then sharded over its ``ep`` dim. ``None``: the default group.

    Returns:
        An `ExpertShard`: the other entries as given, ``w_gate_up [E/R, H, 2F]`` and
            ``w_down [E/R, F, H]`` copied.

    Raises:
        ValueError: the experts do not split evenly over the group's ranks, or a mesh whose
            dims are not ``("dp", "ep")``.

    Example::

        params = psf.shard_experts(psf.moe_init(E, H, F, generator=g), group)
    """
    me, ranks = ep_position(group)
    experts = params["w_gate_up"].shape[0]
    check_experts_split(experts, ranks)
    per = experts // ranks
    shard = ExpertShard(params)
    for name in ExpertShard.SHARDED:
        shard[name] = params[name][me * per:(me + 1) * per].clone()
    return shard


def all_reduce_replicated(grads, group=None):
    """Sum the gradients of every replicated parameter over ``group``, in place.

    Expert shards are left alone: their gradients already are those of the sum of the ranks'
    losses. A shard is what the tree records as one (`psf.placements`): the ``w_gate_up``/
    ``w_down`` of an `ExpertShard`, the expert entries of an `HFStateDict`. Everything else
    (routers, embeddings, heads) gets the sum over ranks, so data-parallel replicas stay
    equal. One all-reduce per dtype, over a flat copy.

    Args:
        grads: a gradient tree shaped like the params.
        group: the process group to sum over (``None``: the default group).

    Returns:
        ``grads`` itself, its replicated tensors summed.

    Raises:
        ValueError: a plain dict holds an expert shard without its record (`psf.placements`).
    """
    ranks = dist.get_world_size(group)
    replicated = split(grads, ranks)[1]
    agree_on_tree(placements(grads), [group if group is not None else dist.group.WORLD])
    all_reduce_flat(replicated, group)
    return grads


AGREED = ("tokens", "top_k", "num_experts", "hidden", "ffn", "budget", "capacity")


def agree_on_layers(group, layers, paged_stash: bool) -> None:
    """`ValueError` on every rank unless all ranks built the same expert-parallel layers: their
    number, then per layer the fields in `AGREED` and whether they stash (fixed slots, symmetric
    buffers and budgets need equal shapes everywhere; a mismatch would make the exchanges
    disagree). The transport is agreed before, by `prepare_transport`."""
    count = gather_rows(group, [len(layers)])
    if any(row != count[0] for row in count):
        raise ValueError(f"the ranks called psf.moe with a group a different number of times "
                         f"({[row[0] for row in count]}, one per rank): every rank must run the "
                         f"same layers")
    mine = [int(paged_stash)] + [getattr(info, f) for info in layers for f in AGREED]
    rows = gather_rows(group, mine)
    if any(row != rows[0] for row in rows):
        diff = sorted({f for row in rows for i, f in enumerate(
            ["paged_stash"] + [f for _ in layers for f in AGREED]) if row[i] != rows[0][i]})
        raise ValueError(f"the ranks built their expert-parallel layers differently ({diff} "
                         f"differ): every rank must pass the same batch shape and config (pad "
                         f"each rank's batch to a fixed size, as the demo does)")


SIGNATURE = ("hidden", "ffn", "experts", "top_k", "expert dtype", "token dtype")
DTYPE_CODES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def exchange_signature(hidden, ffn, num_experts, top_k, expert_dtype, x_dtype) -> tuple:
    """The fields of `SIGNATURE` as ints: what every rank of an exchange must agree on."""
    def code(dtype):                 # the known ones by index, any other by its name
        if dtype in DTYPE_CODES:
            return DTYPE_CODES.index(dtype)
        return 100 + int.from_bytes(hashlib.sha256(str(dtype).encode()).digest()[:4], "big")
    return (hidden, ffn, num_experts, top_k, code(expert_dtype), code(x_dtype))


def route_exact(ids, num_experts: int, group, signature: tuple = ()) -> Routed:
    """The exact exchange: counts read on the host, exactly the routed rows sent. The ranks'
    ``signature`` (`exchange_signature`) travels with the counts: ranks that disagree on what
    sizes or types the rows all raise the same `ValueError` before any row moves."""
    sent, received, theirs = ExchangeCounts.apply(ids, PlanStatic(num_experts, group),
                                                  signature)
    if signature:
        _check_signatures(theirs.tolist(), signature)
    splits = (tuple(sent.tolist()), tuple(received.tolist()))
    static = PlanStatic(num_experts, group, splits=splits)
    *route, offs, n_valid, over, load = ExchangePlan.apply(ids, static)
    return Routed(ExchangeRoute, tuple(route), (ExactSplits(group, *splits),), offs, n_valid,
                  sum(splits[1]), over, load)


def _check_signatures(rows, signature) -> None:
    """`ValueError` (on every rank: each holds every rank's row) naming the first field the
    ranks disagree on."""
    for i, name in enumerate(SIGNATURE[:len(signature)]):
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            if "dtype" in name:
                values = [str(DTYPE_CODES[v]).removeprefix("torch.") if v < len(DTYPE_CODES)
                          else f"other ({v})" for v in values]
            raise ValueError(f"the ranks of this expert-parallel psf.moe call disagree on its "
                             f"{name} ({values}, one per rank): every rank must call it with "
                             f"the same shapes and dtypes (params from one psf.moe_init, cast "
                             f"alike), since its rows are exchanged between them")


def route_capacity(ids, num_experts: int, group, budget: int, transport: str = "fixed",
                   row_bytes: int = 0) -> Routed:
    """The sync-free exchange: shares of each destination's ``budget`` decided on the device,
    rows moved by ``transport`` (``"fixed"`` slots or ``"nvshmem"``, see `_symmetric`);
    ``row_bytes`` (one activation row) sizes the NVSHMEM workspace."""
    if transport == "nvshmem":
        reserve_workspace(group, ids.numel(), budget, row_bytes)
    static = PlanStatic(num_experts, group, budget=budget, transport=transport)
    *route, offs, n_valid, over, load = ExchangePlan.apply(ids, static)
    move = capacity_transport(group, transport, ids.numel(), budget)
    return Routed(ExchangeRoute, tuple(route), (move,), offs, n_valid, budget, over, load)


def transport_for(cfg, group) -> str:
    """The capacity path's transport over ``group``: ``"fixed"`` or ``"nvshmem"``
    (`_symmetric.resolve`), decided from ``cfg.transport`` and ``$PAGEDSTASH_TRANSPORT``."""
    return _symmetric.resolve(cfg.transport, group)


def prepare_transport(group, cfg) -> str:
    """At ``step.init``: the capacity path's transport, the same on every rank, or a
    `ValueError` on every rank (a rank that cannot use the one it was asked for, or ranks that
    resolved different ones, say with ``$PAGEDSTASH_TRANSPORT`` set on some ranks only)."""
    transport, error = "fixed", None
    if cfg.uses_capacity:
        try:
            transport = transport_for(cfg, group)
        except ValueError as err:
            error = err
    agree(group, error, "its transport")
    chosen = [row[0] for row in gather_rows(group, [_symmetric.TRANSPORTS.index(transport)])]
    if len(set(chosen)) > 1:
        names = [_symmetric.TRANSPORTS[i] for i in chosen]
        raise ValueError(f"the ranks resolved different transports ({names}, one per rank): "
                         f"set the same ${_symmetric.ENV} on every rank (or none), or pass "
                         f"StashConfig(transport='fixed')")
    return transport


def reserve_layers(group, layers) -> None:
    """Grow the NVSHMEM workspace once, for the largest of ``layers`` (after the ranks agreed
    on them: the allocation is collective and must be the same size everywhere)."""
    if layers:
        _symmetric.workspace(group).reserve(max(
            _symmetric.bytes_for(max(i.tokens * i.top_k, i.budget), i.hidden, i.dtype)
            for i in layers))


def reserve_workspace(group, pairs: int, budget: int, row_bytes: int) -> None:
    """Grow this group's NVSHMEM workspace for a layer: a collective call the first time (at
    ``step.init``), a no-op after."""
    rows = max(pairs, budget)
    _symmetric.workspace(group).reserve(
        _symmetric.bytes_for(rows, row_bytes, torch.uint8))
