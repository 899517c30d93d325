"""Grouped SwiGLU experts over a row buffer, with the paged stash for what backward needs.

``y_rows = ((silu(x_rows @ W_gate) * (x_rows @ W_up)) * w_rows) @ W_down``, each row with the
weights of its expert (rows are grouped by expert, group ends in ``offs``). The routing weight
scales the fc2 input; the same product as scaling the output, and it keeps backward from
needing the ``[C, H]`` output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import kernels
from ._config import StashConfig
from ._paging import unflatten_slots
from ._pools import StashSpec
from ._routing import capacity_rows

_GROUPED_MM = getattr(torch, "_grouped_mm", None)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a [C, K]`` by ``b [E, K, N]`` per group of rows -> ``[C, N]``.

    Rows past ``offs[-1]`` are unspecified (``torch._grouped_mm`` leaves them unwritten): never
    read them. On CUDA in bf16 this is ``torch._grouped_mm`` (no host sync); elsewhere a loop
    over groups that reads ``offs`` on the host.
    """
    if _use_grouped_mm(a, b):
        return _GROUPED_MM(a, b, offs=offs)
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
    if _use_grouped_mm(a, g):
        return _GROUPED_MM(a.t(), g, offs=offs)
    out = a.new_zeros(num_groups, a.shape[1], g.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[e] = a[start:end].t() @ g[start:end]
        start = end
    return out


def _use_grouped_mm(a, b) -> bool:
    return _GROUPED_MM is not None and a.is_cuda and a.dtype == torch.bfloat16 \
        and b.dtype == torch.bfloat16


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def swiglu_backward(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient of `swiglu` w.r.t. ``gate_up``, computed in at least fp32."""
    wide = torch.promote_types(gate_up.dtype, torch.float32)
    gate, up = gate_up.to(wide).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    grad = grad.to(wide)
    d_gate = grad * up * sig * (1 + gate * (1 - sig))
    d_up = grad * silu
    return torch.cat([d_gate, d_up], dim=-1).to(gate_up.dtype)


class ExpertStatic(NamedTuple):
    """Static arguments of `GroupedSwiGLU`: whether it stashes, and how."""

    stash: bool
    page_size: int = 1
    backend: str = "auto"


STASHED = ("fc1_in", "act_in", "fc2_in", "probs")   # in stash order; popped in reverse


def stash_widths(hidden: int, ffn: int) -> dict[str, int]:
    """Row width of each tensor in `STASHED` for experts of hidden size ``hidden``, FFN ``ffn``."""
    return {"fc1_in": hidden, "act_in": 2 * ffn, "fc2_in": ffn, "probs": 1}


def moe_stash_specs(layer: str, params, *, tokens: int, top_k: int, cfg: StashConfig,
                    dtype=None, observed_rows: int | None = None) -> list[StashSpec]:
    """The tensors one capacity-path layer stashes (`STASHED`: fc1 input, activation input,
    fc2 input, routing weights), each ``[capacity, width]``, balanced reference ``T * k``."""
    _, hidden, two_ffn = params["w_gate_up"].shape
    dtype = dtype or params["w_gate_up"].dtype
    rows = capacity_rows(tokens, top_k, cfg).rows
    widths = stash_widths(hidden, two_ffn // 2)
    return [StashSpec(f"{layer}/{name}", widths[name], dtype, rows, tokens * top_k,
                      observed_rows, layer) for name in STASHED]


class GroupedSwiGLU(torch.autograd.Function):
    """Experts over a row buffer; saves, or stashes into pages, what backward needs.

    ``apply(x_rows, w_rows, w_gate_up, w_down, offs, n_valid, static, *stash_args)``:

    - ``x_rows [C, H]``, ``w_rows [C]`` (routing weight per row, zero in unused rows),
      ``w_gate_up [E, H, 2F]``, ``w_down [E, F, H]``, ``offs [E]`` int32 group ends,
      ``n_valid [1]`` int32 rows in use;
    - ``static`` an `ExpertStatic`; when it stashes, ``stash_args`` are the state's ``flags``
      then the flattened `StashSlot` of each tensor in `STASHED` (flat, because under
      ``torch.func`` only top-level tensor arguments arrive unwrapped).

    Returns ``(y_rows [C, H], gate_up [C, 2F], act [C, F])`` (the last two empty when
    stashing); only ``y_rows`` is differentiable and rows past ``n_valid`` are unspecified.
    With stashing, the valid rows of ``x_rows``, ``gate_up``, ``act`` and ``w_rows`` go to
    pages, and ``setup_context`` keeps only the slots (as attributes: later stashes mutate the
    pools, which ``save_for_backward``'s version check would refuse).
    """

    @staticmethod
    def forward(x_rows, w_rows, w_gate_up, w_down, offs, n_valid, static, *stash_args):
        gate_up = grouped_mm(x_rows, w_gate_up, offs)                     # [C, 2F]
        act = swiglu(gate_up)                                             # [C, F]
        y_rows = grouped_mm(act * w_rows.unsqueeze(1), w_down, offs)      # [C, H]
        if static.stash:
            flags, slots = stash_args[0], unflatten_slots(stash_args[1:])
            for src, slot in zip((x_rows, gate_up, act, w_rows.unsqueeze(1)), slots):
                kernels.stash_copy(src.contiguous(), n_valid, *slot, flags, static.page_size,
                                   static.backend, 0, 0)
            # Return no intermediates: an output marked non-differentiable stays referenced
            # by the autograd node until backward, which would keep the padded buffers alive
            # next to their pages.
            empty = y_rows.new_empty(0)
            return y_rows, empty, empty
        return y_rows, gate_up, act

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_rows, w_rows, w_gate_up, w_down, offs, n_valid, static, *stash_args = inputs
        _, gate_up, act = output
        ctx.mark_non_differentiable(gate_up, act)
        ctx.static = static
        ctx.capacity = x_rows.shape[0]
        if static.stash:
            ctx.slots = unflatten_slots(stash_args[1:])
            ctx.save_for_backward(w_gate_up, w_down, offs, n_valid)
        else:
            ctx.save_for_backward(w_gate_up, w_down, offs, n_valid, x_rows, w_rows, gate_up,
                                  act)

    @staticmethod
    def backward(ctx, grad_y, _grad_gate_up, _grad_act):
        static = ctx.static
        w_gate_up, w_down, offs, n_valid, *saved = ctx.saved_tensors
        if static.stash:
            popped = [kernels.stash_pop(*slot, ctx.capacity, static.page_size, static.backend,
                                        0, 0) for slot in reversed(ctx.slots)]
            w_rows, act, gate_up, x_rows = popped[0][:, 0], popped[1], popped[2], popped[3]
        else:
            x_rows, w_rows, gate_up, act = saved
        num_experts = w_gate_up.shape[0]
        grad_y = grad_y.contiguous()
        d_w_down = grouped_mm_wgrad(act * w_rows.unsqueeze(1), grad_y, offs, num_experts)
        d_act_w = grouped_mm(grad_y, w_down.transpose(1, 2), offs)         # [C, F]
        valid = torch.arange(ctx.capacity, device=grad_y.device) < n_valid
        wide = torch.promote_types(act.dtype, torch.float32)
        d_w_rows = torch.where(valid, (d_act_w.to(wide) * act.to(wide)).sum(-1), 0)
        d_gate_up = swiglu_backward(gate_up, d_act_w * w_rows.unsqueeze(1))
        d_w_gate_up = grouped_mm_wgrad(x_rows, d_gate_up, offs, num_experts)
        d_x_rows = grouped_mm(d_gate_up, w_gate_up.transpose(1, 2), offs)  # [C, H]
        nones = (None,) * (len(ctx.needs_input_grad) - 4)
        return (d_x_rows, d_w_rows.to(w_rows.dtype), d_w_gate_up, d_w_down) + nones
