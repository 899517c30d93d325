"""Load-balancing losses and aux-loss-free balancing, as pure functions of `RouterStats`.

Each loss reads the statistics `psf.moe(..., return_stats=True)` returns (or `psf.router_stats`
builds), excludes padding, and keeps the gradient of the router's probabilities; the pair
fractions are counts (no gradient), read on the device (nothing on the host).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..core import _frame
from ..core._router import RouterStats, expert_histogram
from ..parallel._mesh import groups_of

__all__ = ["global_counts", "load_balancing_loss", "switch_loss", "update_expert_bias",
           "z_loss"]


def _check(stats) -> RouterStats:
    if not isinstance(stats, RouterStats):
        raise TypeError(f"expected the psf.RouterStats of a layer (psf.moe(..., "
                        f"return_stats=True)), got {type(stats).__name__}")
    return stats


def _probs_and_counts(stats: RouterStats, seq_len):
    """``(P [B, E], f [B, E], has [B])`` per sequence (``B = 1`` without ``seq_len``): the
    mean of the router's normalised scores over the valid tokens, the fraction of their pairs
    routed to each expert (sums to 1; ids of padding count nowhere), and whether the sequence
    has any valid pair."""
    t, e = stats.logits.shape
    k = stats.ids.shape[1]
    if seq_len is None:
        seq_len = max(t, 1)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1 or t % seq_len:
        raise ValueError(f"seq_len={seq_len!r} must divide the {t} tokens (B sequences of "
                         f"seq_len, flattened row-major)")
    b = t // seq_len
    valid = stats.valid.view(b, seq_len).to(stats.probs.dtype)
    n = valid.sum(dim=1).clamp_min(1)                                          # [B]
    probs = (stats.probs.view(b, seq_len, e) * valid[..., None]).sum(dim=1) / n[:, None]
    keep = stats.valid[:, None].expand(t, k).reshape(b, seq_len * k)
    counts = expert_histogram(stats.ids.reshape(b, seq_len * k), e, keep)      # [B, E]
    pairs = counts.sum(dim=1)
    frac = counts.to(probs.dtype) / pairs.clamp_min(1)[:, None].to(probs.dtype)
    return probs, frac, pairs > 0


def switch_loss(stats: RouterStats, *, seq_len: int | None = None,
                counts=None) -> torch.Tensor:
    """Switch Transformer's load-balancing loss as Megatron-Core computes it.

    ``E * sum_e f_e * P_e``, ``f_e`` the fraction of the valid tokens' pairs routed to expert
    ``e`` (sums to 1) and ``P_e`` their mean normalised router score for ``e`` (softmax, or
    sigmoid over its sum for a sigmoid router; carries the gradient). Even routing gives 1;
    no valid pair gives 0.

    Args:
        stats: the layer's `RouterStats` (``psf.moe(..., return_stats=True)``).
        seq_len: per sequence (the tokens are ``B`` sequences of ``seq_len``, flattened
            row-major), averaged over the sequences that hold a valid pair; must divide ``T``.
        counts: ``[E]`` pair counts to use for ``f`` instead of this call's (`global_counts`
            sums them over micro-batches or ranks: with ``f`` global and ``P`` local, the
            gradient averaged over equal-sized data-parallel replicas is the global loss's).

    Returns:
        A 0-d fp32 tensor (fp64 for fp64 logits) with the gradient of ``stats.probs``.

    Raises:
        TypeError: ``stats`` is not a `RouterStats`.
        ValueError: ``seq_len`` does not divide the tokens, ``counts`` is given with
            ``seq_len``, or ``counts`` does not hold one entry per expert.
    """
    stats = _check(stats)
    probs, frac, has = _probs_and_counts(stats, seq_len)
    if counts is not None:
        if seq_len is not None:
            raise ValueError("counts= gives one global f; it does not combine with seq_len")
        counts = torch.as_tensor(counts, device=probs.device).to(probs.dtype).reshape(1, -1)
        if counts.shape[1] != stats.num_experts:
            raise ValueError(f"counts has {counts.shape[1]} entries for {stats.num_experts} "
                             f"experts")
        frac = counts / counts.sum().clamp_min(1)
    per = stats.num_experts * (frac * probs).sum(dim=1)                            # [B]
    return (per * has).sum() / has.sum().clamp_min(1)


def load_balancing_loss(layers: Sequence[RouterStats]) -> torch.Tensor:
    """transformers' router aux loss (``load_balancing_loss_func``, Mixtral, Qwen-MoE, OLMoE).

    Over the layers of one batch, ``E * sum_e (C_e / N) (S_e / N)`` with ``C_e`` the pairs
    routed to ``e`` and ``S_e`` the summed softmax probability of ``e`` over every layer's
    valid tokens, ``N`` the valid tokens times the layers. Its ``C_e / N`` sums to ``k``, so
    even routing gives ``k``; multiply by ``config.router_aux_loss_coef``. The probabilities
    are the softmax of the logits, as transformers takes them; no valid token gives 0 (where
    transformers gives NaN).

    Args:
        layers: the `RouterStats` of each layer of the batch, all routing to the same number
            of experts.

    Returns:
        A 0-d fp32 tensor (fp64 for fp64 logits) with the gradient of the logits.

    Raises:
        TypeError: an entry is not a `RouterStats`.
        ValueError: ``layers`` is empty, or its layers route to different numbers of experts.
    """
    layers = [_check(s) for s in layers]
    if not layers:
        raise ValueError("load_balancing_loss needs the RouterStats of at least one layer")
    e = layers[0].num_experts
    if any(s.num_experts != e for s in layers):
        raise ValueError(f"the layers route to different numbers of experts "
                         f"({sorted({s.num_experts for s in layers})})")
    tokens = sum(s.counts() for s in layers)
    # transformers' formula: the softmax of the logits, whatever the router's scores
    prob = sum((torch.softmax(s.logits, dim=-1) * s.valid[:, None].to(s.logits.dtype))
               .sum(dim=0) for s in layers)
    rows = sum(s.valid.sum() for s in layers).to(prob.dtype).clamp_min(1)
    return e * ((tokens / rows) * (prob / rows)).sum()


def z_loss(stats: RouterStats) -> torch.Tensor:
    """Router z-loss (ST-MoE): ``mean over valid tokens of logsumexp(logits)^2``.

    Args:
        stats: the layer's `RouterStats`.

    Returns:
        A 0-d fp32 tensor (fp64 for fp64 logits) with the gradient of the logits.

    Raises:
        TypeError: ``stats`` is not a `RouterStats`.
    """
    stats = _check(stats)
    valid = stats.valid.to(stats.logits.dtype)
    lse = torch.logsumexp(stats.logits, dim=-1)
    return (lse.square() * valid).sum() / valid.sum().clamp_min(1)


def global_counts(layers_or_counts, group=None) -> torch.Tensor:
    """Pair counts per expert summed over several layers or micro-batches, and over ranks.

    No gradient. Inside a step, a group named here joins the ranks `run_step` reduces its flags
    over, so the ranks that meet in this all-reduce always take the same branch (a lone rerun
    would leave the others waiting).

    Args:
        layers_or_counts: a list of `RouterStats` (micro-batches, or the layers one ``f`` is
            shared by) or of ``[E]`` count tensors.
        group: sum over the ranks of this process group as well (an all-reduce); a ``("dp",
            "ep")`` mesh: over all its ranks; ``None``: this rank only.

    Returns:
        ``[E]`` fp32 pair counts, on the device of the statistics.

    Raises:
        ValueError: ``layers_or_counts`` is empty.
    """
    items = list(layers_or_counts)
    if not items:
        raise ValueError("global_counts needs at least one RouterStats or count tensor")
    total = sum(s.counts() if isinstance(s, RouterStats) else s.detach().to(torch.float32)
                for s in items)
    if group is not None:
        groups = groups_of(group, ("dp", "ep"))
        frame = _frame.current()
        if frame is not None and frame.mode == "capacity":
            for g in groups:
                frame.groups[f"global_counts:{len(frame.groups)}"] = g
        total = total.clone()
        for g in groups:
            dist.all_reduce(total, group=g)
    return total


def update_expert_bias(bias: torch.Tensor, counts, *, rate: float = 1e-3,
                       group=None) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free balancing: ``bias + rate * sign(mean(counts) - counts)``.

    ``bias`` is not changed. Call it between steps on ``params[layer]["router_bias"]``; the
    bias is chosen with, never trained.

    Args:
        bias: ``[E]`` fp32 (or fp64) score-correction bias.
        counts: ``[E]``, the pairs each expert received over the step (a tensor, a list, or a
            `psf.LayerReport`'s ``expert_load``).
        rate: the step size, a finite number > 0.
        group: sum ``counts`` over this group's ranks first (the ranks that see the same
            experts' traffic under data parallelism; an expert-parallel layer's report is
            already summed over its group, so with a ``("dp", "ep")`` mesh the counts are
            summed over ``dp`` only).

    Returns:
        A new ``[E]`` tensor in ``bias``'s dtype, on its device, without gradient.

    Raises:
        ValueError: ``rate`` is not a finite number > 0, ``bias`` is not a 1-d fp32 or fp64
            tensor, or ``counts`` is not shaped like ``bias``.
    """
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
        raise ValueError(f"rate must be a finite number > 0, got {rate!r}")
    if not isinstance(bias, torch.Tensor) or bias.dim() != 1:
        raise ValueError(f"bias must be a tensor [E], got {getattr(bias, 'shape', type(bias))}")
    if bias.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"bias is {bias.dtype}: keep the router bias in fp32, where steps of "
                         f"{rate} are not rounded away (model.to(torch.bfloat16) casts it; "
                         f"pass bias.float(), and store the result back as fp32)")
    counts = torch.as_tensor(counts, dtype=torch.float32, device=bias.device).detach()
    if counts.shape != bias.shape:
        raise ValueError(f"counts has shape {list(counts.shape)} for a bias of "
                         f"{list(bias.shape)}: pass one count per expert")
    if group is not None:
        counts = counts.clone()
        for g in groups_of(group, ("dp",)):
            dist.all_reduce(counts, group=g)
    step = torch.sign(counts.mean() - counts).to(bias.dtype)
    return bias.detach() + rate * step
