"""Router, padding ids and capacity: the integer side of an MoE layer.

Ids live in ``[-1, E]``; ``-1`` and ``E`` both mean padding (a masked token, or a pair owned by
another expert-parallel rank). Internally every padding id becomes ``E``: one extra expert slot
that no rank owns, so padding falls out of the sort-and-count dispatch with no masking pass.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._config import StashConfig
from ._router import Router, route_with

GEMM_ALIGN = 16   # rows: budgets are rounded up to this so grouped GEMM tiles stay whole


def route(weight: torch.Tensor, x: torch.Tensor, top_k: int, norm_topk_prob: bool = True, *,
          router: Router | None = None,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``x`` with the router weight ``weight``.

    Args:
        weight: ``[E, H]`` router weight (``params["router"]``).
        x: ``[T, H]`` tokens, on ``weight``'s device.
        top_k: experts chosen per token, ``k``.
        norm_topk_prob: renormalise the ``k`` kept weights to sum to one; used only without
            ``router`` (say it there otherwise, ``Router(normalize=False)``).
        router: a `Router` (default: ``Router(normalize=norm_topk_prob)``, which is Mixtral's
            and Qwen3-MoE's routing: an fp32 softmax over all ``E``, top-k, renormalised if
            ``norm_topk_prob``).
        bias: ``[E]`` score-correction bias (``params["router_bias"]``), added to choose only.

    Returns:
        ``(ids, weights)``: ``ids`` ``[T, k]`` int64 and ``weights`` ``[T, k]`` in fp32 (fp64
            for fp64 inputs).

    Raises:
        TypeError: ``router`` is not a `Router`.
        ValueError: ``norm_topk_prob=False`` is given beside a ``router``, or the router
            cannot pick ``top_k`` of the ``E`` experts.
    """
    router = resolve_router(router, norm_topk_prob)
    ids, weights, _ = route_with(weight, x, top_k, router, bias)
    return ids, weights


def resolve_router(router, norm_topk_prob=True) -> Router:
    """The `Router` of a call: ``router`` itself, or ``Router(normalize=norm_topk_prob)``;
    `ValueError` when both say something (``norm_topk_prob=False`` beside a ``router``)."""
    if router is None:
        return Router(normalize=bool(norm_topk_prob))
    if not isinstance(router, Router):
        raise TypeError(f"router must be a psf.Router, got {type(router).__name__}")
    if norm_topk_prob is not True:
        raise ValueError("pass norm_topk_prob or router, not both: say it in the router, "
                         "psf.Router(normalize=False)")
    return router


def canonical_ids(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Map padding (``-1`` or ``E``) to ``E``; out-of-range ids become padding too.

    Returns ``(ids [T, k] int64 in [0, E], bad)`` where ``bad`` is a 0-d bool tensor on the
    device saying whether any id was outside ``[-1, E]`` (no host read here).
    """
    ids = ids.to(torch.int64)
    bad = ((ids < -1) | (ids > num_experts)).any()
    return torch.where((ids < 0) | (ids > num_experts), num_experts, ids), bad


def check_ids(ids: torch.Tensor, num_experts: int) -> None:
    """Raise `ValueError` naming the first id outside ``[-1, E]`` (reads the ids on the host)."""
    bad = (ids < -1) | (ids > num_experts)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"routing id {int(ids[where])} at position {where} is outside [-1, {num_experts}]: "
            f"ids are expert indices 0..{num_experts - 1}, with -1 or {num_experts} for padding")


class Capacity(NamedTuple):
    """Rows of the capacity path: each expert rank's ``budget`` and the buffer's ``rows``.

    Attributes:
        budget: rows each expert rank may receive (a multiple of 16).
        rows: rows of the capacity buffer the kept pairs are packed into.
    """

    budget: int
    rows: int


def capacity_rows(tokens: int, top_k: int, cfg: StashConfig, group_size: int = 1,
                  layer: str | None = None) -> Capacity:
    """The budget per expert rank and the buffer rows of one capacity-path layer.

    The one place budgets and buffer rows are computed (docs: concepts/capacity.md).

    Virtual ranks (``group_size`` 1, ``R = cfg.expert_ranks``): ``budget = align(ceil(cf * T *
    k / R))``, at most ``align(T * k)`` (no rank can receive more); kept rows are packed into
    one buffer of ``min(R * budget, align(T * k))`` rows.

    Real ranks (``group_size`` ``R > 1``, ``T`` tokens on every rank): each destination rank
    takes ``budget = align(ceil(cf * T * k))`` rows, at most ``align(R * T * k)`` (all it could
    receive), into a buffer of ``budget`` rows. Not divided by ``R``: under even routing every
    rank receives ``T * k`` rows.

    Args:
        tokens: ``T``, the tokens the layer routes (on every rank, across real ranks).
        top_k: experts chosen per token, ``k``.
        cfg: the `StashConfig` whose capacity factor and ``expert_ranks`` apply.
        group_size: ranks of the process group the experts are spread over (1: one device,
            ``cfg.expert_ranks`` virtual ranks).
        layer: the layer's name; ``cf`` is the factor of the layer named ``layer``
            (`StashConfig.factor_for`).

    Returns:
        A `Capacity`: ``budget`` rows per expert rank and the buffer's ``rows``.
    """
    pairs = tokens * top_k
    cf = cfg.factor_for(layer)
    if group_size > 1:
        budget = align_rows(min(math.ceil(cf * pairs), group_size * pairs))
        return Capacity(budget, budget)
    want = math.ceil(cf * pairs / cfg.expert_ranks)
    budget = align_rows(min(want, pairs))
    return Capacity(budget, min(cfg.expert_ranks * budget, align_rows(pairs)))


def align_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of `GEMM_ALIGN`."""
    return -(-rows // GEMM_ALIGN) * GEMM_ALIGN
