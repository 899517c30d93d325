"""One `psf.moe` call, validated: shapes of the parameters against each other and against
``x``, ``top_k`` and precomputed routing. Every mistake is a `ValueError` (or a `TypeError`
for a wrong type) that names the argument, the shapes involved and the fix, raised before
anything runs on the device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..core._router import route_with
from ..experts._experts import refuse_transforms
from ..core._routing import resolve_router

PARAM_NAMES = ("router", "w_gate_up", "w_down")
# optional: a score-correction bias [E], and a shared SwiGLU expert (with a per-token gate)
OPTIONAL_NAMES = ("router_bias", "shared_gate_up", "shared_down", "shared_gate")
_ID_DTYPES = (torch.int32, torch.int64)


class Call(NamedTuple):
    """A validated call: ``x [T, H]``, ``ids [T, k]`` and ``weights [T, k]`` (the router has
    run, once), ``E`` experts in all (the router's rows) of which ``E / R`` are here."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    top_k: int
    num_experts: int
    group: object          # None: every expert is on this device
    ranks: int             # R: size of ``group`` (1 without one)
    logits: torch.Tensor | None = None     # [T, E] the router's (None: routing was given)

    @property
    def tokens(self) -> int:
        return self.x.shape[0]


def prepare(params, x, top_k, norm_topk_prob=True, routing=None, group=None,
            router=None) -> Call:
    """Validate a call and run the router (unless ``routing`` is given)."""
    refuse_transforms(x, params, routing)
    router = resolve_router(router, norm_topk_prob)
    num_experts, hidden, ranks = check_params(params, group)
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__} {top_k!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the router has {num_experts} "
                         f"experts), got {top_k}")
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError(f"x must be a tensor [..., H] with H = {hidden}, got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    if x.shape[-1] != hidden:
        raise ValueError(f"x has hidden size {x.shape[-1]} but the experts expect {hidden}")
    if x.dtype != params["w_gate_up"].dtype:
        raise ValueError(f"x is {x.dtype} but the expert weights are "
                         f"{params['w_gate_up'].dtype}: cast one to the other")
    x2d = x.reshape(-1, hidden)
    if routing is None:
        ids, weights, logits = route_with(params["router"], x2d, top_k, router,
                                          params.get("router_bias"))
    else:
        if params.get("router_bias") is not None or router != resolve_router(None,
                                                                              router.normalize):
            raise ValueError("routing=(ids, weights) replaces the router, so a router= or a "
                             "router_bias would be ignored: route with psf.route(..., router=, "
                             "bias=) and pass its output, or leave routing out")
        ids, weights = check_routing(routing, x2d.shape[0], top_k)
        logits = None
    return Call(x2d, ids, weights, top_k, num_experts, group, ranks, logits)


def check_params(params, group=None) -> tuple[int, int, int]:
    """``(E, H, R)`` of one layer's parameters; `ValueError` naming both shapes of any
    mismatch. ``E`` is the router's row count; the experts hold ``E / R`` of them."""
    if not isinstance(params, dict):
        raise TypeError(f"MoE params must be a dict with {PARAM_NAMES} (from psf.moe_init, "
                        f"psf.shard_experts or psf.from_hf_moe_block), got "
                        f"{type(params).__name__}")
    missing = [n for n in PARAM_NAMES if n not in params]
    if missing:
        raise ValueError(f"MoE params need {PARAM_NAMES}; missing {missing} "
                         f"(build them with psf.moe_init or psf.from_hf_moe_block)")
    router, w_gate_up, w_down = (params[n] for n in PARAM_NAMES)
    for name, t, dim in (("router", router, 2), ("w_gate_up", w_gate_up, 3),
                         ("w_down", w_down, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != dim:
            raise ValueError(f"{name} must be a {dim}-d tensor, got "
                             f"{list(getattr(t, 'shape', [])) or type(t).__name__}")
    num_experts, hidden = router.shape
    local, hidden_up, two_ffn = w_gate_up.shape
    if w_down.dtype != w_gate_up.dtype or len({router.device, w_gate_up.device,
                                              w_down.device}) > 1:
        raise ValueError(f"router ({router.dtype}, {router.device}), w_gate_up "
                         f"({w_gate_up.dtype}, {w_gate_up.device}) and w_down ({w_down.dtype}, "
                         f"{w_down.device}) must share a device, and the experts a dtype")
    ranks = 1 if group is None else dist.get_world_size(group)
    _check_experts(num_experts, local, ranks, router, w_gate_up)
    shapes = f"router {list(router.shape)}, w_gate_up {list(w_gate_up.shape)}, w_down " \
             f"{list(w_down.shape)}"
    if hidden_up != hidden or two_ffn % 2:
        raise ValueError(f"w_gate_up must be [E, H, 2F] with H = {hidden} from the router; "
                         f"got {shapes}")
    if tuple(w_down.shape) != (local, two_ffn // 2, hidden):
        raise ValueError(f"w_down must be [E, F, H] = {[local, two_ffn // 2, hidden]} to match "
                         f"the router and w_gate_up; got {shapes}")
    _check_optional(params, num_experts, hidden, router, w_gate_up)
    return num_experts, hidden, ranks


def _check_optional(params, num_experts, hidden, router, w_gate_up):
    """Shapes of the optional entries: ``router_bias [E]``, ``shared_gate_up [H, 2Fs]``,
    ``shared_down [Fs, H]`` (both or neither) and ``shared_gate [1, H]`` (needs them)."""
    unknown = set(params) - set(PARAM_NAMES) - set(OPTIONAL_NAMES)
    if unknown:
        raise ValueError(f"MoE params hold {sorted(unknown)}, which psf.moe does not read "
                         f"(it reads {PARAM_NAMES} and optionally {OPTIONAL_NAMES})")
    bias = params.get("router_bias")
    if bias is not None and (not isinstance(bias, torch.Tensor)
                             or tuple(bias.shape) != (num_experts,)
                             or not bias.is_floating_point() or bias.device != router.device):
        raise ValueError(f"router_bias must be a floating-point tensor [E] = [{num_experts}] "
                         f"on the router's device ({router.device}), got "
                         f"{getattr(bias, 'dtype', '')} "
                         f"{list(getattr(bias, 'shape', [])) or type(bias).__name__} on "
                         f"{getattr(bias, 'device', '-')}")
    up, down, gate = (params.get(n) for n in ("shared_gate_up", "shared_down", "shared_gate"))
    if (up is None) != (down is None) or (gate is not None and up is None):
        raise ValueError("a shared expert needs shared_gate_up [H, 2Fs] and shared_down "
                         "[Fs, H] (shared_gate [1, H] is optional beside them)")
    if up is None:
        return
    ok = all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (up, down)) and \
        up.shape[0] == hidden and up.shape[1] % 2 == 0 and \
        tuple(down.shape) == (up.shape[1] // 2, hidden)
    if gate is not None:
        ok = ok and isinstance(gate, torch.Tensor) and tuple(gate.shape) == (1, hidden)
    if not ok:
        raise ValueError(f"the shared expert must be shared_gate_up [H, 2Fs], shared_down "
                         f"[Fs, H] and optionally shared_gate [1, H] with H = {hidden}; got "
                         f"{[list(getattr(t, 'shape', [])) for t in (up, down, gate)]}")
    shared = [t for t in (up, down, gate) if t is not None]
    if {t.dtype for t in shared} != {w_gate_up.dtype} or \
            {t.device for t in shared} != {router.device}:
        raise ValueError(f"the shared expert's weights must have the experts' dtype "
                         f"({w_gate_up.dtype}) and device ({router.device})")


def _check_experts(num_experts, local, ranks, router, w_gate_up):
    if local * ranks == num_experts:
        return
    if ranks == 1:
        raise ValueError(f"the router has {num_experts} rows (experts) but w_gate_up holds "
                         f"{local} experts: router {list(router.shape)}, w_gate_up "
                         f"{list(w_gate_up.shape)}. They must agree (E = the router's rows).")
    if local == num_experts:
        raise ValueError(f"with a group of {ranks} ranks each rank holds {num_experts} / "
                         f"{ranks} experts, but these params hold all {num_experts}: pass "
                         f"psf.shard_experts(params, group)")
    raise ValueError(f"the router has {num_experts} rows but w_gate_up holds {local} experts on "
                     f"each of {ranks} ranks ({local * ranks} in all): these params were "
                     f"sharded for another group size; shard the full params for this group")


def check_routing(routing, tokens, top_k):
    """``(ids, weights)`` of precomputed routing, both ``[T, top_k]``, ids a signed int."""
    try:
        ids, weights = routing
    except (TypeError, ValueError):
        raise TypeError("routing must be a pair (ids [T, top_k], weights [T, top_k])") from None
    want = (tokens, top_k)
    if tuple(ids.shape) != want or tuple(weights.shape) != want:
        raise ValueError(f"routing ids and weights must both be [T, top_k] = {list(want)}; "
                         f"got {list(ids.shape)} and {list(weights.shape)}")
    if ids.dtype not in _ID_DTYPES:
        raise TypeError(f"routing ids must be int32 or int64 (-1 marks padding), got "
                        f"{ids.dtype}: pass ids.long()")
    if not weights.is_floating_point():
        raise TypeError(f"routing weights must be floating point, got {weights.dtype}")
    return ids, weights
