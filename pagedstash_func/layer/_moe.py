"""The MoE layer: `moe_init`, `moe`, and its two paths `moe_exact` and `moe_capacity`.

``psf.moe(params, x, top_k=k)`` is plain math: router, top-k, SwiGLU experts, weighted sum.
It reads the current frame (`_frame`) and picks the path: outside a step, or in a step's exact
rerun, the exact path; while ``step.init`` records, the exact path plus a `LayerInfo`; inside a
step, the capacity path with the step's state. With ``group=`` the experts are spread over the
ranks of a process group (`_expert_parallel`); without, over ``cfg.expert_ranks`` virtual ranks
of this device.
"""

from __future__ import annotations

import math

import torch

from ..core import _frame
from .. import kernels
from ._call import PARAM_NAMES, Call, prepare
from ..core._config import StashConfig
from ..experts._dispatch import make_plan
from ..parallel._mesh import ep_group
from ..parallel._expert_parallel import (
    exchange_signature, route_capacity, route_exact, transport_for,
)
from ..parallel._placement import agree
from ..experts._experts import ExpertStatic, LocalRoute, MoEExperts, Routed, weight_dtype
from ..stash._pools import is_kept_whole, layer_pool, stashed_names
from ..stash._paging import StashRecord, StashSlot, flatten_slots, stash_slot
from ..core._router import Router, router_stats
from ..core._routing import canonical_ids, capacity_rows, check_ids
from ..stash._state import StashState, StateMismatchError, empty_table

__all__ = ["PARAM_NAMES", "moe", "moe_capacity", "moe_exact", "moe_init", "shared_expert"]
layout = kernels.layout


def moe_init(num_experts: int, hidden: int, ffn: int, *, generator=None,
             dtype=torch.float32, device=None) -> dict[str, torch.Tensor]:
    """Parameters of one MoE layer, as a dict pytree.

    Weights are normal with std ``1/sqrt(fan_in)``, drawn in fp32 on the generator's device
    (so a CUDA generator works), then cast to ``dtype`` and moved to ``device``.

    Args:
        num_experts: ``E``, a positive int.
        hidden: ``H``, a positive int.
        ffn: ``F``, each expert's FFN size, a positive int.
        generator: the ``torch.Generator`` to draw from (default: torch's global one).
        dtype: the parameters' dtype.
        device: where the parameters go (default: where they were drawn, the generator's
            device, or the CPU without a generator).

    Returns:
        ``{"router": [E, H], "w_gate_up": [E, H, 2F], "w_down": [E, F, H]}``, gate in
            ``w_gate_up[..., :F]`` and up in ``w_gate_up[..., F:]``.

    Raises:
        ValueError: ``num_experts``, ``hidden`` or ``ffn`` is not a positive integer.

    Example::

        params = psf.moe_init(8, 64, 128, generator=torch.Generator().manual_seed(0))
    """
    for name, value in (("num_experts", num_experts), ("hidden", hidden), ("ffn", ffn)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    source = generator.device if generator is not None else None

    def normal(*shape, fan_in):
        t = torch.randn(*shape, generator=generator, dtype=torch.float32, device=source)
        return (t / math.sqrt(fan_in)).to(dtype=dtype, device=device)

    return {"router": normal(num_experts, hidden, fan_in=hidden),
            "w_gate_up": normal(num_experts, hidden, 2 * ffn, fan_in=hidden),
            "w_down": normal(num_experts, ffn, hidden, fan_in=ffn)}


def moe(params, x, *, top_k: int, norm_topk_prob: bool = True, routing=None, group=None,
        router: Router | None = None, return_stats: bool = False):
    """One MoE layer: ``x [..., H]`` -> ``[..., H]``.

    Router: ``router`` (a `psf.Router`; default: an fp32 softmax over all ``E`` experts, top-k,
    renormalised if ``norm_topk_prob``), with ``params["router_bias"]`` ``[E]`` added to the
    scores to choose experts where present; experts ``w_down(silu(x w_gate) * (x w_up))``;
    output the routing-weighted sum over the k experts, plus the shared expert where
    ``params`` has one (``shared_gate_up [H, 2Fs]``, ``shared_down [Fs, H]``: a SwiGLU on
    every token, scaled per token by ``sigmoid(x shared_gate.T)`` where ``shared_gate [1, H]``
    is given, as Qwen2-MoE does).

    Inside a `stash_aware` step this call is one layer of the step (capacity, stash and flags
    handled by the transform); elsewhere it runs the exact, dropless path.

    Args:
        params: the layer's dict: ``router [E, H]``, ``w_gate_up [E, H, 2F]``, ``w_down
            [E, F, H]`` (`psf.moe_init`), optionally ``router_bias [E]`` and the shared
            expert's ``shared_gate_up``, ``shared_down``, ``shared_gate``; one device, the
            experts one dtype.
        x: ``[..., H]`` tokens, in the experts' dtype, on their device.
        top_k: experts chosen per token, ``k`` (an int in ``[1, E]``).
        norm_topk_prob: renormalise the ``k`` kept weights of the default router (say it in
            ``router`` otherwise).
        routing: ``(ids [T, k], weights [T, k])`` replaces the router; ids (int32 or int64)
            lie in ``[-1, E]`` where ``-1`` and ``E`` are padding (no expert, no output, zero
            gradient); weights floating point.
        group: a process group over which the experts are sharded (`psf.shard_experts`), or a
            ``("dp", "ep")`` ``DeviceMesh`` (sharded over ``ep``); ``x`` is then this rank's
            tokens and ``E`` the router's rows.
        router: a `psf.Router` describing how to route (default as above).
        return_stats: also return a `psf.RouterStats` of this call (the router's logits and
            normalised scores with their gradient, and the ids chosen) for the load-balancing
            losses (`psf.switch_loss`, `psf.load_balancing_loss`, `psf.z_loss`). They see
            every pair the router chose, also those a capacity attempt drops (as its exact
            rerun would). Not with ``routing=`` (there is no router): build them with
            `psf.router_stats`.

    Returns:
        ``y`` ``[..., H]`` in ``x``'s shape and dtype; ``(y, stats)`` with
            ``return_stats=True``.

    Raises:
        ValueError: ``return_stats=True`` beside ``routing=``, parameters or ``x`` of shapes,
            dtypes or devices that do not fit together (the message names them), or (on the
            exact path) a routing id outside ``[-1, E]``.
        TypeError: ``params`` is not a dict, ``top_k`` not an int, or ``routing`` not a pair
            of an integer and a floating-point tensor.
    """
    group = ep_group(group)
    if return_stats and routing is not None:
        raise ValueError("return_stats needs psf.moe's own router; with routing=(ids, weights) "
                         "build the statistics with psf.router_stats(logits, ids, valid)")
    frame = _frame.current()
    if frame is not None and frame.mode == "capacity":
        y, call = _capacity_call(frame, params, x, top_k, norm_topk_prob, routing, group,
                                 router)
    else:
        record = frame if frame is not None and frame.mode == "record" else None
        y, call = _exact(params, x, top_k, norm_topk_prob, routing, group, record, router)
    if group is not None and frame is not None and frame.mode != "record":
        frame.anchors.append(y)     # its backward exchange must run on every rank
    return _finish(params, call, y, x.shape, return_stats, router)


def moe_exact(params, x, *, top_k: int, norm_topk_prob: bool = True, routing=None,
              group=None, router: Router | None = None):
    """The exact (dropless) path: buffers sized from the routed count (host reads).

    It runs the exact path whether or not a step is open (`moe` runs it outside a step).

    Args:
        params: the layer's dict, as `moe` takes it.
        x: ``[..., H]`` tokens, in the experts' dtype, on their device.
        top_k: experts chosen per token, ``k``.
        norm_topk_prob: as `moe` takes it.
        routing: ``(ids [T, k], weights [T, k])`` in place of the router, as `moe` takes it.
        group: the process group (or ``("dp", "ep")`` mesh) the experts are sharded over.
        router: a `psf.Router` (default: `moe`'s).

    Returns:
        ``y`` ``[..., H]``, in ``x``'s shape and dtype.

    Raises:
        ValueError: inputs that do not fit together, as in `moe`, or a routing id outside
            ``[-1, E]``.
    """
    group = ep_group(group)
    y, call = _exact(params, x, top_k, norm_topk_prob, routing, group, router=router)
    return _finish(params, call, y, x.shape, False)


def moe_capacity(params, x, state: StashState, *, layer: str, top_k: int, cfg: StashConfig,
                 norm_topk_prob: bool = True, routing=None, group=None,
                 router: Router | None = None):
    """The sync-free path: pre-sized buffers, drops over budget, optional paged stash.

    Over-budget pairs are dropped (see `pagedstash_func.experts._dispatch`, and `_comm` across
    ranks) and raise the ``over_budget`` flag; ids outside ``[-1, E]`` are treated as padding
    and raise ``bad_id``. Nothing is read on the host.

    Args:
        params: the layer's dict, as `moe` takes it.
        x: ``[..., H]`` tokens, in the experts' dtype, on their device.
        state: a live `StashState` (consumed) holding the flags, and for ``cfg.paged_stash``
            the pages of `moe_stash_specs` ``(layer, ...)``. Pairs per expert are added to
            ``state.counts[f"{layer}/expert_load"]`` ``[E]`` and placed rows to
            ``state.counts[f"{layer}/rows"]`` ``[1]`` when those entries exist.
        layer: this call's name in the state (and in ``cfg.layer_factors``, which sets its
            capacity factor when it names it).
        top_k: experts chosen per token, ``k``.
        cfg: the `StashConfig`; needs a ``capacity_factor``.
        norm_topk_prob: as `moe` takes it.
        routing: ``(ids [T, k], weights [T, k])`` in place of the router, as `moe` takes it.
        group: the process group (or ``("dp", "ep")`` mesh) the experts are sharded over.
        router: a `psf.Router` (default: `moe`'s).

    Returns:
        ``(y, next_state)``: ``y`` ``[..., H]`` in ``x``'s shape and dtype, and the state
            that replaces ``state``.

    Raises:
        ValueError: ``cfg`` has no ``capacity_factor``, the state holds no pages (or pages of
            another size) for ``layer``, or the inputs do not fit together, as in `moe`.
        ConsumedStateError: ``state`` was consumed by an earlier call.
    """
    call = prepare(params, x, top_k, norm_topk_prob, routing, ep_group(group), router)
    y, state = _capacity(params, call, state, layer, cfg)
    return _finish(params, call, y, x.shape, False), state


def _finish(params, call, y, shape, return_stats, router=None):
    """The routed experts' ``y [T, H]`` plus the shared expert, in ``x``'s shape; with the
    router's statistics when asked."""
    if params.get("shared_gate_up") is not None:
        y = y + shared_expert(params, call.x)
    y = y.reshape(shape)
    if return_stats:
        return y, router_stats(call.logits, call.ids, scores=(router or Router()).scores)
    return y


def shared_expert(params, x):
    """The shared expert of ``params`` on every token.

    ``sigmoid(x shared_gate.T) * (silu(x Wg) * (x Wu)) shared_down`` (without ``shared_gate``:
    no sigmoid factor); ``Wg, Wu`` the halves of ``shared_gate_up``.

    Args:
        params: the layer's dict with ``shared_gate_up [H, 2Fs]``, ``shared_down [Fs, H]`` and
            optionally ``shared_gate [1, H]``.
        x: ``[T, H]`` tokens, in the weights' dtype, on their device.

    Returns:
        ``[T, H]``, in ``x``'s dtype.
    """
    gate, up = (x @ params["shared_gate_up"]).chunk(2, dim=-1)
    out = (torch.nn.functional.silu(gate) * up) @ params["shared_down"]
    if params.get("shared_gate") is not None:
        out = torch.sigmoid(x @ params["shared_gate"].T) * out
    return out


# ----------------------------------------------------------------------------- the two paths


def _exact(params, x, top_k, norm_topk_prob, routing, group, record=None, router=None):
    error = call = None
    try:
        call = prepare(params, x, top_k, norm_topk_prob, routing, group, router)
        check_ids(call.ids, call.num_experts)
        if record is not None:
            _check_ranks(record.cfg, call)
    except (ValueError, TypeError) as err:
        error = err
    if group is not None:                   # refused on one rank: refused on every rank
        agree(group, error, "its psf.moe call")
    elif error is not None:
        raise error
    ids, _ = canonical_ids(call.ids, call.num_experts)
    if group is None:
        n_valid = int((ids < call.num_experts).sum())
        routed = _local(make_plan(ids, call.num_experts, 1, ids.numel(), n_valid), n_valid)
    else:
        _, hidden, two_ffn = params["w_gate_up"].shape
        routed = route_exact(ids, call.num_experts, group, exchange_signature(
            hidden, two_ffn // 2, call.num_experts, call.top_k, params["w_gate_up"].dtype,
            call.x.dtype))
    if record is not None:
        record.layers.append(_layer_info(record, params, call, int(routed.n_valid)))
        record.device = call.x.device
        if group is not None:
            record.recorded_groups.append((len(record.layers) - 1, group))
    return _layer(params, call, routed, ExpertStatic(call.top_k, routed.rows, routed.route,
                                                     routed.args,
                                                     n_route=len(routed.tensors)), ()), call


def _capacity(params, call: Call, state, layer, cfg, transport=None):
    _check_ranks(cfg, call)
    if not cfg.uses_capacity:
        raise ValueError("moe_capacity needs cfg.capacity_factor; for the exact path call "
                         "psf.moe outside a step (or psf.moe_exact)")
    state.check_alive()
    cap = capacity_rows(call.tokens, call.top_k, cfg, call.ranks, layer)
    names = stashed_names(call.ranks if call.group is not None else 1)
    slots = _stash_slots(state, layer, cap.rows, call, names) if cfg.paged_stash else None
    ids, bad = canonical_ids(call.ids, call.num_experts)
    if call.group is None:
        routed = _local(make_plan(ids, call.num_experts, cfg.expert_ranks, cap.budget,
                                  cap.rows), cap.rows)
    else:
        routed = route_capacity(ids, call.num_experts, call.group, cap.budget,
                                transport or transport_for(cfg, call.group),
                                call.x.shape[-1] * call.x.element_size())
    # Pages are handed back by backward; a call that will have no backward stashes nothing.
    stash = slots is not None and _will_differentiate(params, call)
    traced = stash and torch.compiler.is_compiling()
    if stash and (traced or _frame.under_compile_hook()):   # traced, or fallen back from it
        _check_compiled_by_psf()
    state.consume(f"moe_capacity(..., layer={layer!r})")
    flags, counts = _with_statistics(state, layer, routed, bad)
    record, kept = None, ()
    if stash:
        kept = tuple(name for name in names if is_kept_whole(state, f"{layer}/{name}"))
        slots = [s for name, s in zip(names, slots) if name not in kept]
        names_paged = tuple(name for name in names if name not in kept)
        private = _own_pools(state, layer, names_paged, slots, traced)
        # Traced, the record holds no pool: the compiled backward owns them (an output of the
        # forward that its backward mutates is something a compiler cannot split)
        record = StashRecord(layer, tuple(f"{layer}/{name}" for name in names),
                             private={} if traced else private, compiled=traced)
        names = names_paged
    static = ExpertStatic(call.top_k, routed.rows, routed.route, routed.args, stash,
                          state.page_size, names, state.backend, record, kept,
                          call.tokens * call.top_k, stash and cfg.stash_precision == "fp8",
                          len(routed.tensors), traced)
    stash_args = (flags, *flatten_slots(slots)) if stash else ()
    y = _layer(params, call, routed, static, stash_args)
    pending = state.pending + ((record,) if stash else ())
    return y, state.successor(flags=flags, counts=counts, pending=pending)


def _check_compiled_by_psf() -> None:
    """A stashing attempt traced by ``torch.compile`` must come from `psf.compile`: whether a
    layer's pages are still there for its backward is host-side status, which the compiled
    step checks around the graph (a bare ``torch.compile`` would let a second backward read
    pages that went back)."""
    frame = _frame.current()
    if frame is None or not frame.compiled:
        raise ValueError(
            "torch.compile over a stash_aware step with paged_stash=True: compile it with "
            "psf.compile(step) instead, which keeps the check that each layer's pages are "
            "still held for its backward outside the compiled graph (and compiles with "
            "fullgraph=True). torch.compile(step) works as it is without the stash.")
    # (a bare torch.compile that fell back to eager here is refused too: in the fallback the
    # compiler's frame hook is still set)


def _capacity_call(frame, params, x, top_k, norm_topk_prob, routing, group, router=None):
    """One call inside a step: layer ``frame.calls`` of the state, which threads on."""
    layers = frame.state.layers
    if frame.calls >= len(layers):
        raise ValueError(
            f"the loss called psf.moe more often ({frame.calls + 1}) than when the state was "
            f"built ({len(layers)} calls); rebuild it with step.init(params, batch)")
    info = layers[frame.calls]
    call = prepare(params, x, top_k, norm_topk_prob, routing, group, router)
    _check_against(info, frame.calls, params, call, frame.cfg)
    frame.calls += 1
    if group is not None:
        frame.groups[info.name] = group      # the runner reads this layer's flags over it
    y, frame.state = _capacity(params, call, frame.state, info.name, frame.cfg, info.transport)
    return y, call


def _check_against(info, index, params, call, cfg=None):
    """The call must have the shapes the state was built for (`LayerInfo`)."""
    _, hidden, two_ffn = params["w_gate_up"].shape
    now = (call.tokens, call.top_k, call.num_experts, hidden, two_ffn // 2,
           params["w_gate_up"].dtype, call.ranks)
    then = (info.tokens, info.top_k, info.num_experts, info.hidden, info.ffn, info.dtype,
            info.group_size)
    if now != then:
        fields = ("tokens", "top_k", "experts", "hidden", "ffn", "dtype", "ranks")
        diff = ", ".join(f"{f} {a} (state: {b})" for f, a, b in zip(fields, now, then) if a != b)
        raise StateMismatchError(
            f"psf.moe call {index} ({info.name}) does not match the state it runs with: "
            f"{diff}. Rebuild the state with step.init(params, batch) for these shapes "
            f"(static shapes: pad batches to a few fixed sizes, psf.pad_to_bucket for "
            f"transformers LM batches or psf.pad_rows for others, and keep a state per "
            f"size).", shape=now[0] != then[0])
    if cfg is not None and cfg.uses_capacity:
        if call.ranks == 1 and cfg.expert_ranks != info.expert_ranks:
            raise StateMismatchError(
                f"psf.moe call {index} ({info.name}) runs over expert_ranks="
                f"{cfg.expert_ranks} virtual ranks, but its state was built for expert_ranks="
                f"{info.expert_ranks} (budgets and buffers are per rank): build a state with "
                f"this step's init, or use the config the state was built with")
        cap = capacity_rows(call.tokens, call.top_k, cfg, call.ranks, info.name)
        if (cap.budget, cap.rows) != (info.budget, info.capacity):
            raise StateMismatchError(
                f"psf.moe call {index} ({info.name}) runs at a budget of {cap.budget} rows "
                f"a rank, {cap.rows} in all (capacity factor {cfg.factor_for(info.name)}), but "
                f"its state was built for {info.budget} a rank, {info.capacity} in all: a "
                f"state is built by step.init for one config (its budgets "
                f"agreed across ranks, its reports read against them). Build a state with the "
                f"new step's init")


def _check_ranks(cfg, call):
    if call.group is None:
        if call.num_experts % cfg.expert_ranks:
            raise ValueError(f"{call.num_experts} experts do not split into expert_ranks="
                             f"{cfg.expert_ranks} equal groups; pick a divisor of "
                             f"{call.num_experts}")
    elif cfg.expert_ranks not in (1, call.ranks):
        raise ValueError(f"expert_ranks={cfg.expert_ranks} but the experts are spread over a "
                         f"group of {call.ranks} ranks: leave expert_ranks at 1 (or set it to "
                         f"{call.ranks})")


def _local(plan, rows) -> Routed:
    return Routed(LocalRoute, (plan.pair_row, plan.row_pair, plan.row_token), (), plan.offs,
                  plan.n_valid, rows, plan.over_budget, plan.expert_load)


def _layer_info(frame, params, call, received) -> _frame.LayerInfo:
    cfg = frame.cfg
    _, hidden, two_ffn = params["w_gate_up"].shape
    name = f"moe{len(frame.layers)}"
    cap = capacity_rows(call.tokens, call.top_k, cfg, call.ranks, name) if cfg.uses_capacity \
        else None
    return _frame.LayerInfo(
        name=name, tokens=call.tokens, top_k=call.top_k,
        num_experts=call.num_experts, hidden=hidden, ffn=two_ffn // 2,
        dtype=params["w_gate_up"].dtype,
        expert_ranks=call.ranks if call.group is not None else cfg.expert_ranks,
        capacity=cap.rows if cap else 0, balanced_rows=call.tokens * call.top_k,
        observed_rows=received, budget=cap.budget if cap else 0, group_size=call.ranks)


def _stash_slots(state, layer, rows, call, names):
    failed = [r.layer for r in state.pending if r.status == "failed"]
    if failed:
        raise ValueError(
            f"this state holds the pages of a forward whose backward failed halfway (in "
            f"{', '.join(failed)}): reclaim it first (state, _ = psf.reclaim(state)), then run "
            f"the step again.")
    busy = [r for r in state.pending if r.layer == layer]
    if busy:
        raise ValueError(
            f"{layer} still holds the pages of an earlier forward whose backward has not run: a "
            f"second forward into the same state would overwrite its page tables. Run that "
            f"backward first (forward, backward, forward, backward, as in gradient "
            f"accumulation), or give each in-flight step its own state (state.clone()).")
    slots = []
    for name in names:
        full = f"{layer}/{name}"
        if full not in state.tables:
            raise ValueError(
                f"the state has no pages for {full!r}: build it with "
                f"psf.init_stash_state(psf.moe_stash_specs({layer!r}, params, tokens="
                f"{call.tokens}, top_k={call.top_k}, cfg=cfg, group_size={call.ranks}), cfg)")
        spec = state.spec(full)
        if spec.capacity != rows:
            raise ValueError(
                f"the state's pages for {full!r} were sized for {spec.capacity} rows but "
                f"this call needs {rows} ({call.tokens} tokens, top_k={call.top_k}, "
                f"group_size={call.ranks}); build the state for this batch shape")
        # a pool of the layer's own is allocated only once the call is known to stash
        slots.append(None if full in state.layer_pools else stash_slot(state, full))
    return slots


def _own_pools(state, layer, names, slots, traced=False) -> dict:
    """Fill in ``slots`` the pools of the layer's own (``pool_scope="layer"``), allocated now:
    ``{table name: StashSlot}`` of them (empty with ``pool_scope="state"``). ``traced`` (by
    `psf.compile`): with a page table of the call's own too, made beside its pool, so that the
    state's table, which the compiled forward returns, is not one its backward changes (a
    compiler cannot split a graph whose forward output depends on its backward)."""
    private = {}
    for i, name in enumerate(names):
        if slots[i] is None:
            full = f"{layer}/{name}"
            table = state.tables[full]
            if traced:
                table = empty_table(table.numel(), table.device)
            slots[i] = private[full] = StashSlot(table, *layer_pool(state, full))
    return private


def _with_statistics(state, layer, routed: Routed, bad):
    """The state's flags with ``over_budget``/``bad_id`` raised, and its counters with this
    call's pairs per expert and placed rows added: new tensors, nothing is mutated, so a
    recompute can never count twice."""
    raised = [torch.zeros((), dtype=torch.bool, device=bad.device)] * layout.NUM_FLAGS
    raised[layout.FLAG_OVER_BUDGET], raised[layout.FLAG_BAD_ID] = routed.over_budget, bad
    flags = torch.maximum(state.flags, torch.stack(raised).to(state.flags.dtype))
    counts = dict(state.counts)
    for stat, delta in (("expert_load", routed.expert_load), ("rows", routed.n_valid)):
        key = f"{layer}/{stat}"
        if key in counts:
            counts[key] = counts[key] + delta.to(counts[key].dtype)
    return flags, counts


def _will_differentiate(params, call: Call) -> bool:
    if not torch.is_grad_enabled():
        return False
    tensors = [call.x, call.weights, params["w_gate_up"], params["w_down"]]
    return any(t.requires_grad for t in tensors)


def _layer(params, call: Call, routed: Routed, static, stash_args):
    """The experts of a routed call: ``[T, H]`` out."""
    valid = call.ids < call.num_experts
    # Padding pairs get weight 0 through a select (not a product), so an inf/NaN weight on a
    # padding pair neither leaks forward nor gets a NaN gradient.
    weights = call.weights
    w = torch.where(valid, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
    w = w.to(weight_dtype(call.x.dtype)).reshape(-1)
    args = (call.x, w, params["w_gate_up"], params["w_down"], routed.offs, routed.n_valid,
            static, *routed.tensors, *stash_args)
    if torch.compiler.is_compiling() and not (torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in args)):
        # nothing to differentiate: the forward as a plain function (Dynamo would call the
        # Function's forward with a context first, as if it had no setup_context)
        return MoEExperts.forward(*args)[0]
    return MoEExperts.apply(*args)[0]
