"""The MoE layer: `moe_init`, `moe` (exact path) and `moe_capacity` (sync-free path + stash).

``psf.moe(params, x, top_k=k)`` is plain math: router, top-k, SwiGLU experts, weighted sum.
Called inside a `stash_aware` step it is routed through the step's frame (capacity, pages,
flags); called anywhere else it runs the exact, dropless path.
"""

from __future__ import annotations

import math

import torch

from . import _frame
from ._config import StashConfig
from ._dispatch import Combine, Dispatch, make_plan
from ._experts import STASHED, ExpertStatic, GroupedSwiGLU
from ._paging import stash_tensors
from ._routing import align_rows, canonical_ids, check_ids, rank_budget, route
from ._state import StashSpec, StashState

PARAM_NAMES = ("router", "w_gate_up", "w_down")


def moe_init(num_experts: int, hidden: int, ffn: int, *, generator=None,
             dtype=torch.float32, device=None) -> dict[str, torch.Tensor]:
    """Parameters of one MoE layer, as a dict pytree.

    Returns ``router [E, H]``, ``w_gate_up [E, H, 2F]`` (gate in ``[..., :F]``, up in
    ``[..., F:]``) and ``w_down [E, F, H]``, normal with std ``1/sqrt(fan_in)``.

    Example::

        params = psf.moe_init(8, 64, 128, generator=torch.Generator().manual_seed(0))
    """
    for name, value in (("num_experts", num_experts), ("hidden", hidden), ("ffn", ffn)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def normal(*shape, fan_in):
        t = torch.randn(*shape, generator=generator, dtype=torch.float32) / math.sqrt(fan_in)
        return t.to(dtype=dtype, device=device)

    return {"router": normal(num_experts, hidden, fan_in=hidden),
            "w_gate_up": normal(num_experts, hidden, 2 * ffn, fan_in=hidden),
            "w_down": normal(num_experts, ffn, hidden, fan_in=ffn)}


def moe(params, x, *, top_k: int, norm_topk_prob: bool = True, routing=None):
    """One MoE layer: ``x [..., H]`` -> ``[..., H]``.

    Router: fp32 softmax over all ``E`` experts, top-k, renormalised if ``norm_topk_prob``;
    experts ``w_down(silu(x w_gate) * (x w_up))``; output the routing-weighted sum over the k
    experts. ``routing=(ids [T, k], weights [T, k])`` replaces the router; ids lie in
    ``[-1, E]`` where ``-1`` and ``E`` are padding (no expert, no output, zero gradient).

    Inside a `stash_aware` step this call is one layer of the step (capacity, stash and flags
    handled by the transform); elsewhere it runs the exact, dropless path.
    """
    frame = _frame.current()
    if frame is not None:
        return frame.moe(params, x, top_k=top_k, norm_topk_prob=norm_topk_prob,
                         routing=routing)
    return moe_exact(params, x, top_k=top_k, norm_topk_prob=norm_topk_prob, routing=routing)


def moe_exact(params, x, *, top_k: int, norm_topk_prob: bool = True, routing=None):
    """The exact (dropless) path: buffers sized from the routed count (one host read)."""
    x2d, ids, weights, num_experts = _prepare(params, x, top_k, norm_topk_prob, routing)
    check_ids(ids, num_experts)
    ids, _ = canonical_ids(ids, num_experts)
    n_valid = int((ids < num_experts).sum())
    plan = make_plan(ids, num_experts, 1, budget=ids.numel(), capacity=n_valid)
    static = ExpertStatic(flags=False, counts=(), stash=False, page_size=1, backend="auto")
    y = _layer(params, x2d, ids, weights, plan, static, [], num_experts, top_k, None, None)
    return y.reshape(x.shape)


def moe_capacity(params, x, state: StashState | None, *, layer: str, top_k: int,
                 cfg: StashConfig, norm_topk_prob: bool = True, routing=None):
    """The sync-free path: pre-sized buffers, drops over budget, optional paged stash.

    Args:
        state: a live `StashState` (consumed) holding the flags, and for ``cfg.paged_stash``
            the pages of `moe_stash_specs` ``(layer, ...)``. Pairs per expert are added to
            ``state.counts[f"{layer}/expert_load"]`` ``[E]`` and placed rows to
            ``state.counts[f"{layer}/rows"]`` ``[1]`` when those entries exist.
        layer: this call's name in the state.
    Returns:
        ``(y, next_state)``. Over-budget pairs are dropped (see `pagedstash_func._dispatch`)
        and raise the ``over_budget`` flag; ids outside ``[-1, E]`` are treated as padding and
        raise ``bad_id``. Nothing is read on the host.
    """
    if not cfg.uses_capacity:
        raise ValueError("moe_capacity needs cfg.capacity_factor; for the exact path call "
                         "psf.moe outside a step (or psf.moe_exact)")
    x2d, ids, weights, num_experts = _prepare(params, x, top_k, norm_topk_prob, routing)
    if num_experts % cfg.expert_ranks:
        raise ValueError(f"{num_experts} experts do not split into expert_ranks="
                         f"{cfg.expert_ranks} equal groups; pick a divisor of {num_experts}")
    state.check_alive()
    tokens = x2d.shape[0]
    budget, capacity = capacity_rows(tokens, top_k, cfg)
    ids, bad = canonical_ids(ids, num_experts)
    plan = make_plan(ids, num_experts, cfg.expert_ranks, budget, capacity)
    leaves = [state.flags]
    # Statistics kept when the state has room for them: pairs per expert, rows placed.
    delta = torch.cat([plan.expert_load, plan.n_valid.to(torch.int64)])
    slices = {"expert_load": (0, num_experts), "rows": (num_experts, num_experts + 1)}
    counters = []
    for stat, where in slices.items():
        if f"{layer}/{stat}" in state.counts:
            leaves.append(state.counts[f"{layer}/{stat}"])
            counters.append(where)
    if cfg.paged_stash:
        for name in STASHED:
            full = f"{layer}/{name}"
            if full not in state.tables:
                raise ValueError(
                    f"the state has no pages for {full!r}: build it with "
                    f"psf.init_stash_state(psf.moe_stash_specs({layer!r}, params, tokens="
                    f"{tokens}, top_k={top_k}, cfg=cfg), cfg)")
            spec = state.spec(full)
            if spec.capacity != capacity:
                raise ValueError(
                    f"the state's pages for {full!r} were sized for {spec.capacity} rows but "
                    f"this call needs {capacity} ({tokens} tokens, top_k={top_k}); build the "
                    f"state for this batch shape")
            leaves.extend(stash_tensors(state, full)[:5])
    # Pages are handed back by backward; a call that will have no backward stashes nothing.
    stash = cfg.paged_stash and _will_differentiate(params, x, weights)
    if not stash:
        leaves = leaves[:1 + len(counters)]
    static = ExpertStatic(flags=True, counts=tuple(counters), stash=stash,
                          page_size=state.page_size, backend=state.backend)
    zero = torch.zeros((), dtype=torch.int32, device=x.device)
    raised = torch.stack([zero, zero, plan.over_budget.int(), bad.int()])
    state.consume(f"moe_capacity(..., layer={layer!r})")
    y = _layer(params, x2d, ids, weights, plan, static, leaves, num_experts, top_k, raised,
               delta)
    return y.reshape(x.shape), state.successor()


def capacity_rows(tokens: int, top_k: int, cfg: StashConfig) -> tuple[int, int]:
    """``(rank budget, buffer rows)`` of the capacity path for ``tokens`` tokens.

    Kept rows are packed, so the buffer needs ``min(R * budget, align(T * k))`` rows.
    """
    budget = rank_budget(tokens, top_k, cfg.capacity_factor, cfg.expert_ranks)
    return budget, min(cfg.expert_ranks * budget, align_rows(tokens * top_k))


def moe_stash_specs(layer: str, params, *, tokens: int, top_k: int, cfg: StashConfig,
                    dtype=None) -> list[StashSpec]:
    """The four tensors one capacity-path layer stashes (fc1 input, activation input, fc2
    input, routing weights), each ``[capacity, width]``, balanced reference ``T * k`` rows."""
    num_experts, hidden, two_ffn = params["w_gate_up"].shape
    dtype = dtype or params["w_gate_up"].dtype
    _, capacity = capacity_rows(tokens, top_k, cfg)
    widths = {"fc1_in": hidden, "act_in": two_ffn, "fc2_in": two_ffn // 2, "probs": 1}
    return [StashSpec(f"{layer}/{name}", widths[name], dtype, capacity, tokens * top_k)
            for name in STASHED]


def _will_differentiate(params, x, weights) -> bool:
    if not torch.is_grad_enabled():
        return False
    tensors = [x, weights, params["w_gate_up"], params["w_down"]]
    return any(t.requires_grad for t in tensors)


def _prepare(params, x, top_k, norm_topk_prob, routing):
    missing = [n for n in PARAM_NAMES if n not in params]
    if missing:
        raise ValueError(f"MoE params need {PARAM_NAMES}; missing {missing} "
                         f"(build them with psf.moe_init or psf.from_hf_moe_block)")
    num_experts, hidden, _ = params["w_gate_up"].shape
    if x.shape[-1] != hidden:
        raise ValueError(f"x has hidden size {x.shape[-1]} but the experts expect {hidden}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an integer in [1, {num_experts}], got {top_k!r}")
    if x.dtype != params["w_gate_up"].dtype:
        raise ValueError(f"x is {x.dtype} but the expert weights are "
                         f"{params['w_gate_up'].dtype}: cast one to the other")
    x2d = x.reshape(-1, hidden)
    if routing is None:
        ids, weights = route(params["router"], x2d, top_k, norm_topk_prob)
    else:
        ids, weights = routing
        want = (x2d.shape[0], top_k)
        if tuple(ids.shape) != want or tuple(weights.shape) != want:
            raise ValueError(f"routing ids and weights must both be [T, top_k] = {list(want)}; "
                             f"got {list(ids.shape)} and {list(weights.shape)}")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"routing ids must be integers, got {ids.dtype}")
    return x2d, ids, weights, num_experts


def _layer(params, x2d, ids, weights, plan, static, leaves, num_experts, top_k, raised, delta):
    """Dispatch -> grouped SwiGLU -> combine for a canonical plan."""
    valid = ids < num_experts
    # Padding pairs get weight 0 through a select (not a product), so an inf/NaN weight on a
    # padding pair neither leaks forward nor gets a NaN gradient.
    w = torch.where(valid, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
    w = w.to(x2d.dtype).reshape(-1)
    x_rows, w_rows = Dispatch.apply(x2d, w, plan.pair_row, plan.row_pair, top_k)
    if raised is None:
        raised = torch.zeros(4, dtype=torch.int32, device=x2d.device)
        delta = plan.expert_load
    y_rows, _, _ = GroupedSwiGLU.apply(x_rows, w_rows, params["w_gate_up"], params["w_down"],
                                       plan.offs, plan.n_valid, raised, delta, static,
                                       *leaves)
    return Combine.apply(y_rows, plan.pair_row, plan.row_pair, top_k)
