"""The MoE layer: `moe_init`, `moe`, and its two paths `moe_exact` and `moe_capacity`.

``psf.moe(params, x, top_k=k)`` is plain math: router, top-k, SwiGLU experts, weighted sum.
It reads the current frame (`_frame`) and picks the path: outside a step, or in a step's exact
rerun, the exact path; while ``step.init`` records, the exact path plus a `LayerInfo`; inside a
step, the capacity path with the step's state (`moe_capacity`).
"""

from __future__ import annotations

import math

import torch

from . import _frame, kernels
from ._config import StashConfig
from ._dispatch import make_plan
from ._experts import STASHED, ExpertStatic, MoEExperts, weight_dtype
from ._paging import StashRecord, flatten_slots, stash_slot
from ._routing import canonical_ids, capacity_rows, check_ids, route
from ._state import StashState

PARAM_NAMES = ("router", "w_gate_up", "w_down")
layout = kernels.layout


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
    x2d, ids, weights = _prepare(params, x, top_k, norm_topk_prob, routing)
    if frame is None or frame.mode == "exact":
        y = _exact(params, x2d, ids, weights, top_k)
    elif frame.mode == "record":
        y = _exact(params, x2d, ids, weights, top_k, record=frame)
    else:
        y = _capacity_call(frame, params, x2d, ids, weights, top_k)
    return y.reshape(x.shape)


def moe_exact(params, x, *, top_k: int, norm_topk_prob: bool = True, routing=None):
    """The exact (dropless) path: buffers sized from the routed count (one host read)."""
    x2d, ids, weights = _prepare(params, x, top_k, norm_topk_prob, routing)
    return _exact(params, x2d, ids, weights, top_k).reshape(x.shape)


def moe_capacity(params, x, state: StashState, *, layer: str, top_k: int,
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
    x2d, ids, weights = _prepare(params, x, top_k, norm_topk_prob, routing)
    y, state = _capacity(params, x2d, ids, weights, top_k, state, layer, cfg)
    return y.reshape(x.shape), state


# ----------------------------------------------------------------------------- the two paths


def _exact(params, x2d, ids, weights, top_k, record: _frame.Frame | None = None):
    num_experts = params["w_gate_up"].shape[0]
    check_ids(ids, num_experts)
    ids, _ = canonical_ids(ids, num_experts)
    n_valid = int((ids < num_experts).sum())
    if record is not None:
        record.layers.append(_layer_info(record, params, x2d, top_k, n_valid))
        record.device = x2d.device
    plan = make_plan(ids, num_experts, 1, budget=ids.numel(), capacity=n_valid)
    return _layer(params, x2d, ids, weights, plan, ExpertStatic(top_k), ())


def _capacity(params, x2d, ids, weights, top_k, state, layer, cfg):
    if not cfg.uses_capacity:
        raise ValueError("moe_capacity needs cfg.capacity_factor; for the exact path call "
                         "psf.moe outside a step (or psf.moe_exact)")
    num_experts = params["w_gate_up"].shape[0]
    if num_experts % cfg.expert_ranks:
        raise ValueError(f"{num_experts} experts do not split into expert_ranks="
                         f"{cfg.expert_ranks} equal groups; pick a divisor of {num_experts}")
    state.check_alive()
    tokens = x2d.shape[0]
    cap = capacity_rows(tokens, top_k, cfg)
    ids, bad = canonical_ids(ids, num_experts)
    plan = make_plan(ids, num_experts, cfg.expert_ranks, cap.budget, cap.rows)
    slots = _stash_slots(state, layer, cap.rows, tokens, top_k) if cfg.paged_stash else None
    # Pages are handed back by backward; a call that will have no backward stashes nothing.
    stash = slots is not None and _will_differentiate(params, x2d, weights)
    state.consume(f"moe_capacity(..., layer={layer!r})")
    flags, counts = _with_statistics(state, layer, plan, bad)
    record = StashRecord(layer, tuple(f"{layer}/{name}" for name in STASHED)) if stash else None
    static = ExpertStatic(top_k, stash, state.page_size, state.backend, record)
    stash_args = (flags, *flatten_slots(slots)) if stash else ()
    y = _layer(params, x2d, ids, weights, plan, static, stash_args)
    pending = state.pending + ((record,) if stash else ())
    return y, state.successor(flags=flags, counts=counts, pending=pending)


def _capacity_call(frame, params, x2d, ids, weights, top_k):
    """One call inside a step: layer ``frame.calls`` of the state, which threads on."""
    layers = frame.state.layers
    if frame.calls >= len(layers):
        raise ValueError(
            f"the loss called psf.moe more often ({frame.calls + 1}) than when the state was "
            f"built ({len(layers)} calls); rebuild it with step.init(params, batch)")
    info = layers[frame.calls]
    tokens = x2d.shape[0]
    if (tokens, top_k) != (info.tokens, info.top_k):
        raise ValueError(
            f"psf.moe call {frame.calls} ({info.name}) sees {tokens} tokens with top_k="
            f"{top_k}, but the state was built for {info.tokens} tokens with top_k="
            f"{info.top_k}; rebuild it with step.init for this batch shape")
    frame.calls += 1
    y, frame.state = _capacity(params, x2d, ids, weights, top_k, frame.state, info.name,
                               frame.cfg)
    return y


def _layer_info(frame, params, x2d, top_k, n_valid) -> _frame.LayerInfo:
    cfg = frame.cfg
    num_experts, hidden, two_ffn = params["w_gate_up"].shape
    tokens = x2d.shape[0]
    cap = capacity_rows(tokens, top_k, cfg) if cfg.uses_capacity else None
    return _frame.LayerInfo(
        name=f"moe{len(frame.layers)}", tokens=tokens, top_k=top_k, num_experts=num_experts,
        hidden=hidden, ffn=two_ffn // 2, dtype=params["w_gate_up"].dtype,
        expert_ranks=cfg.expert_ranks, capacity=cap.rows if cap else 0,
        balanced_rows=tokens * top_k, observed_rows=n_valid, budget=cap.budget if cap else 0)


def _stash_slots(state, layer, rows, tokens, top_k):
    slots = []
    for name in STASHED:
        full = f"{layer}/{name}"
        if full not in state.tables:
            raise ValueError(
                f"the state has no pages for {full!r}: build it with "
                f"psf.init_stash_state(psf.moe_stash_specs({layer!r}, params, tokens="
                f"{tokens}, top_k={top_k}, cfg=cfg), cfg)")
        spec = state.spec(full)
        if spec.capacity != rows:
            raise ValueError(
                f"the state's pages for {full!r} were sized for {spec.capacity} rows but "
                f"this call needs {rows} ({tokens} tokens, top_k={top_k}); build the "
                f"state for this batch shape")
        slots.append(stash_slot(state, full))
    return slots


def _with_statistics(state, layer, plan, bad):
    """The state's flags with ``over_budget``/``bad_id`` raised, and its counters with this
    call's pairs per expert and placed rows added: new tensors, nothing is mutated, so a
    recompute can never count twice."""
    raised = [torch.zeros((), dtype=torch.bool, device=bad.device)] * layout.NUM_FLAGS
    raised[layout.FLAG_OVER_BUDGET], raised[layout.FLAG_BAD_ID] = plan.over_budget, bad
    flags = torch.maximum(state.flags, torch.stack(raised).to(state.flags.dtype))
    counts = dict(state.counts)
    for stat, delta in (("expert_load", plan.expert_load), ("rows", plan.n_valid)):
        key = f"{layer}/{stat}"
        if key in counts:
            counts[key] = counts[key] + delta.to(counts[key].dtype)
    return flags, counts


def _will_differentiate(params, x, weights) -> bool:
    if not torch.is_grad_enabled():
        return False
    tensors = [x, weights, params["w_gate_up"], params["w_down"]]
    return any(t.requires_grad for t in tensors)


def _prepare(params, x, top_k, norm_topk_prob, routing):
    """Validate the call; ``(x [T, H], ids [T, k], weights [T, k])`` with the router run once."""
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
    return x2d, ids, weights


def _layer(params, x2d, ids, weights, plan, static, stash_args):
    """The experts of a canonical plan: ``[T, H]`` out."""
    valid = ids < params["w_gate_up"].shape[0]
    # Padding pairs get weight 0 through a select (not a product), so an inf/NaN weight on a
    # padding pair neither leaks forward nor gets a NaN gradient.
    w = torch.where(valid, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
    w = w.to(weight_dtype(x2d.dtype)).reshape(-1)
    y, _, _, _ = MoEExperts.apply(x2d, w, params["w_gate_up"], params["w_down"], plan.pair_row,
                                  plan.row_pair, plan.row_token, plan.offs, plan.n_valid,
                                  static, *stash_args)
    return y
