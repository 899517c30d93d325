"""Routers as data: `Router` describes how a layer chooses its experts, `route_with` does it.

A router scores every expert of every token from ``logits = x @ router.T``, picks ``top_k``
of them (optionally within the best groups only, and optionally ranked with a correction bias
added), and weights the picks from the unbiased scores. The statistics a load-balancing loss
needs come out as a `RouterStats` when asked (`router_stats`), as tensors that keep their
gradient.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

import torch

SCORES = ("softmax", "sigmoid")
_LOGIT_DTYPES = (None, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class Router:
    """How a layer routes (frozen; ``Router()`` is `psf.moe`'s default router, bit for bit).

    A score-correction bias (``params["router_bias"]`` ``[E]`` fp32, DeepSeek-V3's
    ``e_score_correction_bias``) is added to the scores to choose experts only; the weights
    come from the scores without it. It is not trained: update it with
    `psf.update_expert_bias` between steps.

    Attributes:
        scores: ``"softmax"`` over all ``E`` experts (Mixtral, Qwen-MoE, OLMoE) or
            ``"sigmoid"`` per expert (DeepSeek-V3).
        normalize: renormalise the ``k`` kept weights to sum to one (transformers'
            ``norm_topk_prob``); with sigmoid scores ``1e-20`` is added to the sum, as DeepSeek-V3
            does.
        scale: multiplies the kept weights after renormalising (``routed_scaling_factor``).
        groups: the experts split into this many equal groups (``n_group``); each group is
            scored by the sum of its two best (bias-corrected) scores and only the best
            ``groups_kept`` (``topk_group``) are chosen from. 1: no groups.
        groups_kept: groups chosen from, ``1 <= groups_kept <= groups``.
        logits_dtype: ``None``: the router weight is cast to ``x``'s dtype and the logits
            promoted to fp32 at least (Mixtral, Qwen-MoE); ``torch.float32`` (or fp64): ``x``
            and the router weight are both cast to it first (DeepSeek-V3).

    Raises:
        ValueError: ``scores`` is not one of ``"softmax"``, ``"sigmoid"``; ``scale`` is not a
            finite number > 0; ``groups`` or ``groups_kept`` is not a positive integer, or
            ``groups_kept > groups``; ``logits_dtype`` is not ``None``, fp32 or fp64.
        TypeError: ``normalize`` is not a bool.
    """

    scores: str = "softmax"
    normalize: bool = True
    scale: float = 1.0
    groups: int = 1
    groups_kept: int = 1
    logits_dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.scores not in SCORES:
            raise ValueError(f"Router(scores={self.scores!r}): choose one of {SCORES}")
        if not isinstance(self.normalize, bool):
            raise TypeError(f"Router(normalize=...) must be a bool, got {self.normalize!r}")
        if isinstance(self.scale, bool) or not isinstance(self.scale, numbers.Real) \
                or not math.isfinite(self.scale) or self.scale <= 0:
            raise ValueError(f"Router(scale={self.scale!r}) must be a finite number > 0")
        object.__setattr__(self, "scale", float(self.scale))
        for name in ("groups", "groups_kept"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"Router({name}={value!r}) must be a positive integer")
            object.__setattr__(self, name, int(value))
        if self.groups_kept > self.groups:
            raise ValueError(f"Router(groups_kept={self.groups_kept}) cannot exceed "
                             f"groups={self.groups}")
        if self.logits_dtype not in _LOGIT_DTYPES:
            raise ValueError(f"Router(logits_dtype={self.logits_dtype!r}): None, torch.float32 "
                             f"or torch.float64")

    def check(self, num_experts: int, top_k: int) -> None:
        """Check that this router can pick ``top_k`` of ``num_experts`` experts.

        Args:
            num_experts: ``E``, the router's rows.
            top_k: experts chosen per token.

        Raises:
            ValueError: ``groups`` does not divide ``E`` into equal groups, leaves fewer than 2
                experts a group, or the ``groups_kept`` groups hold fewer than ``top_k`` experts.
        """
        if num_experts % self.groups:
            raise ValueError(f"Router(groups={self.groups}) must divide the {num_experts} "
                             f"experts into equal groups")
        if self.groups > 1 and num_experts // self.groups < 2:
            raise ValueError(f"Router(groups={self.groups}) leaves fewer than 2 experts a "
                             f"group ({num_experts} experts); a group is scored by its two "
                             f"best experts")
        kept = num_experts // self.groups * self.groups_kept
        if top_k > kept:
            raise ValueError(f"top_k={top_k} exceeds the {kept} experts of the "
                             f"groups_kept={self.groups_kept} groups a token chooses from")


class Routed(NamedTuple):
    """``ids [T, k]`` int64, ``weights [T, k]`` fp32 (fp64 for fp64 logits) and the router's
    ``logits [T, E]`` (fp32 at least)."""

    ids: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor


def route_with(router_weight: torch.Tensor, x: torch.Tensor, top_k: int, router: Router,
               bias: torch.Tensor | None = None) -> Routed:
    """Route ``x [T, H]`` with ``router_weight [E, H]`` as ``router`` says (see `Router`);
    `ValueError` where the router cannot pick ``top_k`` of these experts (`Router.check`)."""
    router.check(router_weight.shape[0], top_k)
    if router.logits_dtype is None:
        logits = torch.nn.functional.linear(x, router_weight.to(x.dtype))
        # fp32 at least (as transformers does); fp64 inputs keep fp64, so gradcheck stays exact.
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    else:
        dt = torch.promote_types(router.logits_dtype, x.dtype) \
            if x.dtype == torch.float64 else router.logits_dtype
        logits = torch.nn.functional.linear(x.to(dt), router_weight.to(dt))
    if router.scores == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
    if bias is None and router.groups == 1:
        weights, ids = torch.topk(scores, top_k, dim=-1)
    else:
        choice = scores if bias is None else scores + bias.to(scores.dtype)
        choice = choice.detach()               # choosing carries no gradient
        if router.groups > 1:
            choice = _within_best_groups(choice, router.groups, router.groups_kept)
        ids = torch.topk(choice, top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if router.normalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20 if router.scores == "sigmoid" else total)
    if router.scale != 1.0:
        weights = weights * router.scale
    return Routed(ids, weights, logits)


def _within_best_groups(choice, groups, kept):
    """``choice [T, E]`` with the experts outside each token's ``kept`` best groups at -inf
    (a group's score: the sum of its two best experts' scores)."""
    t, e = choice.shape
    by_group = choice.view(t, groups, e // groups)
    group_scores = by_group.topk(2, dim=-1).values.sum(dim=-1)             # [T, G]
    best = group_scores.topk(kept, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return by_group.masked_fill(~keep[:, :, None], float("-inf")).view(t, e)


class RouterStats(NamedTuple):
    """What a load-balancing loss reads from one layer (see `router_stats`).

    Attributes:
        logits: ``[T, E]`` the router's logits (fp32 at least), with their gradient.
        probs: ``[T, E]`` the router's scores normalised over the experts, with gradient:
            ``softmax(logits)`` for a softmax router, ``sigmoid(logits)`` over its sum for a
            sigmoid one (as Megatron-Core's aux losses read a sigmoid router).
        ids: ``[T, k]`` int64, the experts chosen (padding: ``-1`` or ``E``).
        valid: ``[T]`` bool, the tokens that count (False: padding).
    """

    logits: torch.Tensor
    probs: torch.Tensor
    ids: torch.Tensor
    valid: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.logits.shape[-1]

    def counts(self) -> torch.Tensor:
        """Pairs routed to each expert from the valid tokens.

        A count, with no gradient; computed on the device, nothing read on the host.

        Returns:
            ``[E]`` fp32 on the logits' device.
        """
        keep = self.valid[:, None].expand(self.ids.shape)
        return expert_histogram(self.ids.reshape(-1), self.num_experts, keep.reshape(-1))


def expert_histogram(ids: torch.Tensor, num_experts: int, keep=None) -> torch.Tensor:
    """``[..., E]`` fp32: over the last dim of ``ids [..., n]``, how many ids equal each
    expert (ids outside ``[0, E)`` and those where ``keep`` is False count nowhere). By
    comparison, not ``bincount``: no host read (``bincount`` sizes its output from the
    largest id), no atomics."""
    hits = ids.unsqueeze(-1) == torch.arange(num_experts, device=ids.device)
    if keep is not None:
        hits = hits & keep.unsqueeze(-1)
    return hits.sum(dim=-2, dtype=torch.float32)


def router_stats(logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor | None = None,
                 scores: str = "softmax") -> RouterStats:
    """A `RouterStats` from a layer's logits and chosen ids.

    Args:
        logits: ``[T, E]`` the router's logits (any float dtype; promoted to fp32 at least).
        ids: ``[T, k]`` integer ids of the experts chosen (padding: ``-1`` or ``E``).
        valid: ``[T]`` bool, or 0/1: 0 for padding tokens (default every token counts).
        scores: the router's scores, ``"softmax"`` or ``"sigmoid"``: how ``probs`` is made.

    Returns:
        A `RouterStats` whose ``probs`` keep the gradient of ``logits``; ``ids`` int64 and
            ``valid`` bool.

    Raises:
        ValueError: ``scores`` is neither ``"softmax"`` nor ``"sigmoid"``, ``logits`` and
            ``ids`` are not ``[T, E]`` and ``[T, k]`` with the same ``T``, or ``valid`` has
            another number of entries.
    """
    if scores not in SCORES:
        raise ValueError(f"router_stats(scores={scores!r}): choose one of {SCORES}")
    if logits.dim() != 2 or ids.dim() != 2 or ids.shape[0] != logits.shape[0]:
        raise ValueError(f"router_stats needs logits [T, E] and ids [T, k] with the same T, got "
                         f"{list(logits.shape)} and {list(ids.shape)}")
    if valid is None:
        valid = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    valid = valid.reshape(-1)
    if valid.numel() != logits.shape[0]:
        raise ValueError(f"valid has {valid.numel()} entries for {logits.shape[0]} tokens")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if scores == "softmax":
        probs = torch.softmax(logits, dim=-1)
    else:
        probs = torch.sigmoid(logits)
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    return RouterStats(logits, probs, ids.to(torch.int64), valid.to(torch.bool))
