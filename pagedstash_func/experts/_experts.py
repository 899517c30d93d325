"""The expert computation of one MoE layer as one ``autograd.Function``, lean on memory.

For a dispatch plan (`_dispatch.Plan`: which buffer row each (token, slot) pair takes, rows
grouped by expert, group ends ``offs``, ``n`` valid rows), the forward is::

    x_rows = x[row_token]                                  # [C, H]  gather
    gate_up = grouped_mm(x_rows, W_gate_up)                # [C, 2F]
    z = silu(gate) * up * w_rows                           # [C, F]  fused kernel, fp32 inside
    y_rows = grouped_mm(z, W_down)                         # [C, H]
    y[t] = sum over the k slots of y_rows[pair_row]        # [T, H]  gather-sum, slot order

The routing weight scales the fc2 input (the same product as scaling the output), so backward
never needs ``y_rows``. Backward keeps only ``x_rows`` and ``gate_up`` and ``w_rows`` (``[C]``
fp32, 4 bytes a row: a page copy of it would cost a launch each way for nothing). With the stash
(`_pools.stashed_names`) the SwiGLU forward kernel writes ``gate_up``'s valid rows into pages
as it reads them, and the SwiGLU backward kernel reads them from there (no ``[C, 2F]`` buffer
in backward); ``x_rows`` is paged too across ranks, while on one device the layer keeps its
input ``x`` instead and gathers ``x_rows`` from it again. With ``pool_scope="layer"`` a
tensor whose own pool would not be smaller than its buffer is not paged: the buffer itself is
kept (`_pools.kept_whole`) and let go as soon as backward has read it. It recomputes ``z``
inside the fused SwiGLU backward kernel, frees each temporary after its last reader, and sums
each token's ``k`` rows in slot order (no atomics: the same bits on every run). No ``[T*k, H]`` or
``[C+1, H]`` copy is ever made.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import kernels
from ..stash._paging import StashRecord, Stasher, unflatten_slots
from ..stash._pools import STASHED
from ..core._function import active_transforms, fast_apply

_GROUPED_MM = getattr(torch, "_grouped_mm", None)

SECOND_ORDER = (
    "psf.moe is differentiable once: its backward runs fused kernels whose own derivatives are "
    "not implemented, so {what} through it is refused rather than computed wrong. Take "
    "first-order gradients only (torch.func.grad, vjp, .backward()), or use a finite-difference "
    "or dense reference for curvature.")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a [C, K]`` by ``b [E, K, N]`` per group of rows -> ``[C, N]``.

    Rows past ``offs[-1]`` are unspecified (``torch._grouped_mm`` leaves them unwritten): never
    read them. On CUDA in bf16 this is ``torch._grouped_mm`` (no host sync); elsewhere a loop
    over groups that reads ``offs`` on the host.
    """
    if a.shape[0] == 0:
        return a.new_zeros(0, b.shape[2])
    if _use_grouped_mm(a, b):
        return _GROUPED_MM(a, b, offs=offs)
    if torch.compiler.is_compiling():       # no host read of offs: a static-shape form
        return _grouped_static(a, b, offs)
    out = a.new_zeros(a.shape[0], b.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[e]
        start = end
    return out


def grouped_mm_wgrad(a: torch.Tensor, g: torch.Tensor, offs: torch.Tensor,
                     num_groups: int) -> torch.Tensor:
    """``sum_rows a[rows]^T g[rows]`` per group: ``a [C, K]``, ``g [C, N]`` -> ``[E, K, N]``.

    Only rows inside a group are read; an empty group gets a zero gradient.
    """
    if a.shape[0] == 0:
        return a.new_zeros(num_groups, a.shape[1], g.shape[1])
    if _use_grouped_mm(a, g):
        return _GROUPED_MM(a.t(), g, offs=offs)
    if torch.compiler.is_compiling():       # likewise: every row into its group's sum
        return _grouped_wgrad_static(a, g, offs, num_groups)
    out = a.new_zeros(num_groups, a.shape[1], g.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[e] = a[start:end].t() @ g[start:end]
        start = end
    return out


def _group_of_rows(offs, rows: int, groups: int) -> torch.Tensor:
    """``[rows]`` int64: the group of each row by the group ends ``offs`` (``groups`` for a
    row past ``offs[-1]``), on the device."""
    return torch.searchsorted(offs.to(torch.int64), torch.arange(rows, device=offs.device),
                              right=True).clamp(max=groups)


def _grouped_static(a, b, offs):
    """`grouped_mm` with static shapes, for tracing where ``torch._grouped_mm`` cannot go: a
    product per group over every row, each row kept from its own group's (rows past
    ``offs[-1]`` zero). A row never meets another group's numbers, so a NaN or inf stays in
    its group, as in the eager loop; ``E`` times the loop's FLOPs (for tests, not speed)."""
    group = _group_of_rows(offs, a.shape[0], b.shape[0])
    out = a.new_zeros(a.shape[0], b.shape[2])
    for e in range(b.shape[0]):
        mine = (group == e)[:, None]
        out = torch.where(mine, torch.where(mine, a, 0) @ b[e], out)
    return out


def _grouped_wgrad_static(a, g, offs, num_groups):
    """`grouped_mm_wgrad` with static shapes: per group, the rows of the group alone (the
    others zero in both factors, so that nothing of theirs, NaN included, reaches it)."""
    group = _group_of_rows(offs, a.shape[0], num_groups)
    out = []
    for e in range(num_groups):
        mine = (group == e)[:, None]
        out.append(torch.where(mine, a, 0).t() @ torch.where(mine, g, 0))
    return torch.stack(out)


def _use_grouped_mm(a, b) -> bool:
    return _GROUPED_MM is not None and a.is_cuda and a.dtype == torch.bfloat16 \
        and b.dtype == torch.bfloat16


def gather_or_zero(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` with index ``len(values)`` (the sentinel) giving zero: ``[len(index)]``."""
    return torch.cat([values, values.new_zeros(1)])[index]


def weight_dtype(dtype: torch.dtype) -> torch.dtype:
    """Routing weights stay in fp32 (fp64 for fp64 activations) inside the layer."""
    return torch.promote_types(dtype, torch.float32)


class ExpertStatic(NamedTuple):
    """Static arguments of `MoEExperts`: how rows are routed, and whether and how to stash.

    ``route`` builds the route object from the route tensors and ``route_args`` (the
    transport of an expert-parallel route); see `LocalRoute` for what a route provides.
    """

    top_k: int
    rows: int                           # C: rows of the grouped expert buffer
    route: type
    route_args: tuple = ()
    stash: bool = False
    page_size: int = 1
    stashed: tuple = STASHED            # the names paged (`stashed_names`), in slot order
    backend: str = "auto"
    record: StashRecord | None = None   # host-side status of this call's pages (stashing)
    kept: tuple = ()                    # stashed names kept whole, not paged (`kept_whole`)
    expected_rows: int = 0              # T * k, rows expected here; sizes the copy grids
    fp8: bool = False                   # act_in stashed as float8 rows with fp32 row scales
    n_route: int = 0                    # route tensors among the Function's tensor arguments
    traced: bool = False                # stashing inside `psf.compile`'s graph: no host-side
    #                                     bookkeeping in the Function (`step._compile`)

    @property
    def regathers(self) -> bool:
        """Whether backward gathers the fc1 input again from ``x`` (stashing on one device,
        where it is neither paged nor kept)."""
        return self.stash and "fc1_in" not in self.stashed + self.kept

    def route_of(self, tensors):
        return self.route(*tensors, *self.route_args)


class LocalRoute(NamedTuple):
    """Rows on this device (`_dispatch.Plan`): token ``t``'s slot ``s`` sits in buffer row
    ``pair_row[t * k + s]``. Each method is one direction of the layer's data movement."""

    pair_row: torch.Tensor    # [P] row of each pair (C if not placed)
    row_pair: torch.Tensor    # [C] pair of each row (P if unused)
    row_token: torch.Tensor   # [C] token of each row (a valid token if unused)

    def rows_of(self, t, static, n_valid, after=None):
        """``[T, H]`` -> ``[C, H]``: the token of each row; rows ``>= n`` are left unwritten
        (every consumer, a grouped GEMM, reads rows inside the groups alone). ``after``: what
        a compiled backward's gather must follow (`kernels.gather_rows`)."""
        return kernels.gather_rows(t, self.row_token, n_valid, static.backend,
                                   **after_of(static, after))

    def tokens_of(self, rows, static):
        """``[C, H]`` -> ``[T, H]``: each token sums its ``k`` rows in slot order."""
        return kernels.gather_sum(rows, self.pair_row, static.top_k, static.backend)

    def weights_of(self, w_pairs, static):
        """``[P]`` -> ``[C]``: the routing weight of each row (zero if unused)."""
        return gather_or_zero(w_pairs, self.row_pair)

    def weight_grads_of(self, d_w_rows, static):
        """``[C]`` -> ``[P]``: the gradient of each pair's weight (zero if not placed)."""
        return gather_or_zero(d_w_rows, self.pair_row)


class Routed(NamedTuple):
    """A planned call: its route (`LocalRoute` or an expert-parallel route) and the grouped
    rows it fills, with the statistics the state keeps."""

    route: type
    tensors: tuple             # the route's tensor fields, in order
    args: tuple                # the route's non-tensor fields (its transport)
    offs: torch.Tensor         # [E_local] int32 group ends
    n_valid: torch.Tensor      # [1] int32 rows in use
    rows: int                  # C: rows of the grouped buffer
    over_budget: torch.Tensor  # 0-d bool
    expert_load: torch.Tensor  # [E] int64 pairs this call routed to each expert


@fast_apply
class MoEExperts(torch.autograd.Function):
    """``x [T, H]``, ``w_pairs [P]`` -> ``y [T, H]``: rows out, grouped SwiGLU, rows back.

    ``apply(x, w_pairs, w_gate_up, w_down, offs, n_valid, static, *route_tensors,
    *stash_args)``: ``w_pairs`` are the routing weights per (token, slot) pair (fp32, zero for
    padding); ``offs [E_local]`` int32 and ``n_valid [1]`` int32 describe the grouped rows;
    ``static`` is an `ExpertStatic` (its ``route`` consumes ``len(route._fields)`` minus the
    non-tensor fields of the route tensors); when it stashes, ``stash_args`` are the state's
    ``flags`` then the flattened `StashSlot` of each name in ``static.stashed`` (flat: under
    ``torch.func`` only top-level tensor arguments arrive unwrapped).

    Returns ``(y, x_rows, gate_up, w_rows)`` (traced into `psf.compile`'s graph with
    stashing: ``(y, fc1_in kept, act_in kept, w_rows, act_in's float8 scale)``, each empty
    unless kept or used, the compiler then owning what backward reads); only ``y`` is
    differentiable. With stashing
    ``x_rows`` and ``gate_up`` are empty: the valid rows of the stashed ones live in pages until
    backward reads them (``gate_up`` straight from its pages, ``x_rows`` across ranks by a
    pop), and on one device ``x`` is saved to gather ``x_rows`` again
    (``setup_context`` keeps the slots as attributes: later stashes mutate the pools, which
    ``save_for_backward``'s version check would refuse; backward hands them on in a
    `SlotsOnce`, so that each pool of the layer's own goes as soon as it is read). Without
    stashing they are saved, so a second backward (``retain_graph=True``) is exact; with
    stashing it is refused.
    """

    @staticmethod
    def forward(x, w_pairs, w_gate_up, w_down, offs, n_valid, static, *args):
        route_tensors, stash_args = _split_args(static, args)
        route = static.route_of(route_tensors)
        x_rows = route.rows_of(x, static, n_valid)                         # [C, H]
        w_rows = route.weights_of(w_pairs, static)                         # [C]
        tracing = static.traced
        stasher = Stasher(static, stash_args, n_valid, tracing) if static.stash else None
        kept = {}     # under compile: kept buffers and the fp8 scale, returned and saved
        try:        # joined even if the layer fails halfway: no copy outlives its source
            if stasher and "fc1_in" in static.stashed:
                stasher.stash(x_rows, 0)         # may overlap the gate_up GEMM
            gate_up = grouped_mm(x_rows, w_gate_up, offs)                  # [C, 2F]
            if stasher and "act_in" in static.stashed and not static.fp8:  # the SwiGLU
                z = stasher.swiglu(gate_up, w_rows, static.stashed.index("act_in"))  # kernel
            else:                                                          # writes pages
                z = kernels.swiglu_forward(gate_up, w_rows, n_valid, static.backend)   # [C, F]
            if static.stash and static.fp8:        # float8 rows into pages (or kept whole)
                q, scale = quantize_rows(gate_up, n_valid)
                (kept if tracing else static.record.buffers)["act_in_scale"] = scale
                if "act_in" in static.stashed:
                    stasher.stash(q.view(torch.uint8), static.stashed.index("act_in"))
                    del q
                else:
                    gate_up = q
            y_rows = grouped_mm(z, w_down, offs)                           # [C, H]
            del z
            y = route.tokens_of(y_rows, static)                            # [T, H]
        finally:
            if stasher:
                stasher.join()
        if not static.stash:
            return y, x_rows, gate_up, w_rows
        # Buffers kept whole go to the record, which backward empties as soon as it reads them
        # (a saved tensor would live as long as the graph, to the end of torch.func's backward)
        kept.update((n, {"fc1_in": x_rows, "act_in": gate_up}[n]) for n in static.kept)
        if tracing:     # the compiler owns lifetimes: what backward reads is saved, in order
            # (distinct empties: Dynamo maps each output to its own gradient by identity)
            return (y, *(kept.get(n, y.new_empty(0)) for n in ("fc1_in", "act_in")), w_rows,
                    kept.get("act_in_scale", y.new_empty(0)))
        static.record.buffers.update(kept)
        # Return no stashed intermediates: an output marked non-differentiable stays referenced
        # by the autograd node until backward, which would keep the padded buffers beside their
        # pages. The [C] routing weights are kept.
        empty = y.new_empty(0)
        return y, empty, empty, w_rows

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, w_gate_up, w_down, offs, n_valid, static, *args = inputs
        route_tensors, stash_args = _split_args(static, args)
        y, x_rows, gate_up, w_rows, *scale = output
        ctx.y_meta = (y.shape, y.dtype, y.device)
        ctx.mark_non_differentiable(x_rows, gate_up, w_rows, *scale)
        # No zero gradients for the three intermediates: materialising them would allocate
        # [C, H] + [C, 2F] of zeros at the start of backward (seen as 456 MiB at the peak).
        ctx.set_materialize_grads(False)
        ctx.static = static
        ctx.n_route = len(route_tensors)
        ctx.traced = static.traced
        kept = {}
        if ctx.traced:      # a compiled attempt: buffers kept whole came out as outputs
            out = {"fc1_in": x_rows, "act_in": gate_up, "act_in_scale": scale[0]}
            kept = {n: out[n] for n in static.kept + (("act_in_scale",) if static.fp8 else ())}
            x_rows = gate_up = x_rows[:0]
        ctx.kept_names = tuple(kept)
        if static.regathers:
            x_rows = inputs[0]                  # x: backward gathers the fc1 input again
        ctx.slots = unflatten_slots(stash_args[1:]) if static.stash and not ctx.traced else ()
        # Traced, the slots are saved like any tensor: the compiler orders the pools' mutations
        # (functionalised), and it frees what backward has read after its last reader.
        traced_slots = stash_args[1:] if ctx.traced else ()
        ctx.n_saved = 7 + len(route_tensors)
        ctx.save_for_backward(w_gate_up, w_down, offs, n_valid, x_rows, gate_up, w_rows,
                              *route_tensors, *kept.values(), *traced_slots)

    @staticmethod
    def backward(ctx, grad_y, *_):
        if ctx.traced:
            return _traced_backward(ctx, grad_y)
        static = ctx.static
        saved = _saved(ctx)         # before the pages are claimed: a refusal leaves them held
        if static.stash:
            static.record.claim()
        grad_y = _grad_or_zeros(ctx, grad_y)   # y never reached the loss: pages still go back
        needs = tuple(ctx.needs_input_grad[:4])
        slots = SlotsOnce(ctx.slots, static.record.buffers if static.stash else {})
        if static.stash:
            # The backward gets the only hold on the slots (and kept buffers) and drops each
            # once its last reader has run: a pool of the layer's own (pool_scope="layer") is
            # freed then, not with the whole graph, nor at the end of this backward.
            ctx.slots = ()
            static.record.let_go()
        try:
            refuse_transforms(grad_y, backward=True)
            if torch.compiler.is_compiling():       # traced once: no second derivative here
                grads = ExpertsBackward.forward(grad_y, static, needs, ctx.n_route, slots,
                                                *saved)
            else:
                grads = ExpertsBackward.apply(grad_y, static, needs, ctx.n_route, slots, *saved)
        except BaseException:
            if static.stash:    # pending again: reclaim gives back what its tables still hold
                static.record.status = "failed"
            raise
        return _input_grads(ctx, grads, needs)


def _traced_backward(ctx, grad_y):
    """`MoEExperts.backward` of a compiled attempt: the same math, with no host-side
    bookkeeping inside the graph (the compiled step claims the pages of every layer before its
    backward runs: `step._compile`)."""
    static = ctx.static
    saved = ctx.saved_tensors
    saved, kept, flat = (saved[:ctx.n_saved], saved[ctx.n_saved:][:len(ctx.kept_names)],
                         saved[ctx.n_saved + len(ctx.kept_names):])
    needs = tuple(ctx.needs_input_grad[:4])
    slots = SlotsOnce(unflatten_slots(flat), dict(zip(ctx.kept_names, kept)))
    grads = ExpertsBackward.forward(_grad_or_zeros(ctx, grad_y), static, needs, ctx.n_route,
                                    slots, *saved)
    return _input_grads(ctx, grads, needs)


def _grad_or_zeros(ctx, grad_y):
    """``grad_y``, or zeros of ``y``'s shape where ``y`` never reached the loss."""
    if grad_y is not None:
        return grad_y
    return torch.zeros(ctx.y_meta[0], dtype=ctx.y_meta[1], device=ctx.y_meta[2])


def _input_grads(ctx, grads, needs) -> tuple:
    """`MoEExperts.backward`'s return: a gradient for each of the four differentiable inputs
    that needs one, ``None`` for the rest of its arguments."""
    grads = [g if need else None for g, need in zip(grads, needs)]
    return (*grads, *([None] * (len(ctx.needs_input_grad) - 4)))


def refuse_transforms(*inputs, backward: bool = False) -> None:
    """`NotImplementedError` where ``vmap`` or forward-mode AD would run the layer, which has
    neither rule (`core._function.active_transforms`). ``inputs``: the layer's inputs
    (tensors or trees of them); ``backward``: the layer's own backward is being
    transformed."""
    vmap, forward_ad = active_transforms(*inputs)
    if forward_ad:
        what = "forward-mode AD over its backward" if backward else \
            "forward-mode AD (jvp, hessian, hvp)"
        raise NotImplementedError(SECOND_ORDER.format(what=what))
    if vmap:
        if backward:
            raise NotImplementedError(SECOND_ORDER.format(
                what="vmap over its backward (jacrev, jacobian, a batched pullback)"))
        raise NotImplementedError("psf.moe does not support vmap: run it on the whole batch "
                                  "(tokens are already a batch dimension)")


def _saved(ctx) -> tuple:
    """``ctx.saved_tensors``, with the one way a user can break them named: on one device a
    stashing layer keeps its input ``x`` (to gather its rows again), so ``x`` changed in place
    after the layer ran (``x += moe(...)``) is refused, with the fix."""
    try:
        return ctx.saved_tensors
    except RuntimeError as err:
        if not (ctx.static.stash and "inplace" in str(err)):
            raise
        raise RuntimeError(
            f"{ctx.static.record.layer}'s input x was changed in place after the layer ran "
            f"(e.g. x += psf.moe(params, x, ...)); with paged_stash the layer keeps x to gather "
            f"its rows again in backward. Write x = x + psf.moe(...) (a new tensor), or modify "
            f"a clone of x.") from err


def _split_args(static, args):
    """``(route tensors, stash args)`` from the tensors after `ExpertStatic`."""
    return args[:static.n_route], args[static.n_route:]


@fast_apply
class ExpertsBackward(torch.autograd.Function):
    """The first-order backward of `MoEExperts`, as a function of its own so that
    differentiating it (grad of grad, ``create_graph=True`` then backward) raises instead of
    silently giving zeros. Returns ``(grad_x, grad_w_pairs, d_w_gate_up, d_w_down)``; entries
    not in ``needs`` are empty."""

    @staticmethod
    def forward(grad_y, static, needs, n_route, slots, w_gate_up, w_down, offs, n_valid,
                x_rows, gate_up, w_rows, *args):
        route = static.route_of(args[:n_route])
        slots, buffers = slots.take()   # the only hold on them from here: see `SlotsOnce`
        empty = grad_y.new_empty(0)
        capacity, experts = static.rows, w_gate_up.shape[0]
        grad_y_rows = route.rows_of(grad_y.contiguous(), static, n_valid)        # [C, H]
        dz = grouped_mm(grad_y_rows, w_down.transpose(1, 2), offs)              # [C, F]
        if "act_in" in buffers:     # kept whole: read once, then let go
            act = buffers.pop("act_in")
            if static.fp8:
                act = dequantize_rows(act, buffers.pop("act_in_scale"), dz.dtype)
            d_gate_up, z, d_w_rows = kernels.swiglu_backward(act, dz, w_rows, n_valid,
                                                             static.backend)
            del act
        elif static.stash and static.fp8:     # float8 rows popped (pages go back), then
            i = static.stashed.index("act_in")                        # dequantised
            act = _pop(slots[i], capacity, static, dz).view(torch.float8_e4m3fn)
            slots[i] = None
            act = dequantize_rows(act, buffers.pop("act_in_scale"), dz.dtype)
            d_gate_up, z, d_w_rows = kernels.swiglu_backward(act, dz, w_rows, n_valid,
                                                             static.backend)
            del act
        elif static.stash:     # gate_up read from its pages, which then go back (act_in
            i = static.stashed.index("act_in")               # first: reverse stash order)
            act = slots[i]
            d_gate_up, z, d_w_rows = kernels.swiglu_backward_paged(
                act.table, act.cuda, act.host, dz, w_rows, n_valid, static.page_size,
                static.backend)
            kernels.stash_release(*act, static.page_size, static.backend,
                                  **after_of(static, d_gate_up))
            del act             # gate_up's last reader is done: its own pool may go now
            slots[i] = None
        else:
            d_gate_up, z, d_w_rows = kernels.swiglu_backward(gate_up, dz, w_rows, n_valid,
                                                             static.backend)
        del dz, gate_up, w_rows
        d_w_down = grouped_mm_wgrad(z, grad_y_rows, offs, experts) if needs[3] else empty
        del z, grad_y_rows
        grad_x = empty
        if needs[0]:
            d_x_rows = grouped_mm(d_gate_up, w_gate_up.transpose(1, 2), offs)   # [C, H]
            grad_x = route.tokens_of(d_x_rows, static)
            del d_x_rows
        if "fc1_in" in buffers:
            x_rows = buffers.pop("fc1_in")
        elif static.stash and "fc1_in" in static.stashed:   # fc1_in last: it is read last
            x_rows = _pop(slots[0], capacity, static, d_gate_up)
            slots[0] = None     # popped: its own pool goes before the weight-gradient GEMM
        elif static.regathers and needs[2]:   # x_rows holds x: gather the same rows again
            x_rows = route.rows_of(x_rows, static, n_valid, after=d_gate_up)
        d_w_gate_up = grouped_mm_wgrad(x_rows, d_gate_up, offs, experts) if needs[2] else empty
        grad_w = route.weight_grads_of(d_w_rows, static) if needs[1] else empty
        return grad_x, grad_w, d_w_gate_up, d_w_down

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(SECOND_ORDER.format(what="a second derivative (grad of grad, "
                                                    "create_graph=True then backward)"))


class SlotsOnce:
    """The `StashSlot` of each paged tensor of one backward, and the buffers kept whole
    (`StashRecord.buffers`), handed over once.

    `MoEExperts.backward` drops its own references and passes this box (not the slot tensors
    as arguments, which the call would hold until it returns); `ExpertsBackward` takes them
    and lets each go once its last reader has run (a slot set to ``None``, a buffer popped).
    With ``pool_scope="layer"`` that frees the pool then (the caching allocator reuses it in
    stream order, after the kernels already queued on it); a shared pool is held by the state
    and stays."""

    def __init__(self, slots, buffers):
        self._slots, self._buffers = list(slots), dict(buffers)

    def take(self) -> tuple[list, dict]:
        """``(slots, kept buffers by short name)``; the box is empty afterwards."""
        taken = self._slots, self._buffers
        self._slots, self._buffers = [], {}
        return taken


FP8_MAX = 448.0      # the largest float8 e4m3 (fn) value


def quantize_rows(t: torch.Tensor, n_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [C, W]`` -> ``(q [C, W] float8_e4m3fn, scale [C] fp32)`` with ``t ~ q * scale``, one
    scale per row (its largest magnitude over 448); rows ``>= n`` (unwritten) become zeros
    with scale 1. On the device, no host read."""
    valid = torch.arange(t.shape[0], device=t.device) < n_valid.reshape(-1)[:1].to(t.device)
    amax = t.abs().amax(dim=1).float() if t.shape[1] else t.new_zeros(t.shape[0]).float()
    tiny = torch.finfo(torch.float32).tiny         # amax / 448 of a subnormal row is 0
    scale = torch.where(valid & (amax > 0), (amax / FP8_MAX).clamp_min(tiny),
                        torch.ones_like(amax))
    q = (t.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX)
    q = torch.where(valid[:, None], q, torch.zeros((), device=t.device))
    return q.to(torch.float8_e4m3fn), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype``: the rows `quantize_rows` made."""
    return (q.float() * scale[:, None]).to(dtype)


def _pop(slot, capacity, static, after):
    # No zero tail: the one consumer of this pop (x_rows, across ranks), grouped_mm_wgrad,
    # reads rows inside the groups alone, which end at offs[-1] = n. After an overflow the pop
    # still gives zeros. Compiled, it follows ``after`` (computed from the gradient), so that
    # it stays in backward (`kernels.stash_release`).
    return kernels.stash_pop(*slot, capacity, static.page_size, static.backend, 0, 0, 0, False,
                             static.expected_rows, **after_of(static, after))


def after_of(static, tensor) -> dict:
    """``after=tensor`` for a page op of a compiled backward (`kernels.stash_release`)."""
    return {"after": tensor} if static.traced else {}
