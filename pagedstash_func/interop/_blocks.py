"""Weights from `transformers` MoE blocks (transformers is an optional dependency).

Only blocks whose math is exactly `psf.moe`'s are accepted: a router `psf.Router` describes
(softmax or sigmoid scores, top-k, renormalisation, groups, a score-correction bias, scaling),
SwiGLU experts with SiLU and no biases, and optionally a shared SwiGLU expert (gated per token
by a sigmoid, as Qwen2-MoE's is). Anything else (another activation, router jitter) is refused
by name rather than silently computed differently.
"""

from __future__ import annotations

import torch

from ..core import _frame

SUPPORTED = ("MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "OlmoeSparseMoeBlock",
             "Qwen2MoeSparseMoeBlock", "DeepseekV3MoE")


def shared_module(block):
    """``(mlp, gate)``: the block's shared expert and its per-token gate (``None`` where it
    has none)."""
    mlp = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    return mlp, getattr(block, "shared_expert_gate", None)


def from_hf_moe_block(block) -> dict[str, torch.Tensor]:
    """Params for `psf.moe` from a Mixtral, Qwen3-MoE or OLMoE sparse MoE block (transformers 5).

    Reads ``gate.weight [E, H]``, ``experts.gate_up_proj [E, 2F, H]`` and
    ``experts.down_proj [E, H, F]``; returns new tensors (a snapshot, detached) in this
    library's layout. Route with `hf_moe_kwargs` ``(block)`` to get the block's ``top_k`` and
    ``norm_topk_prob``.

    A snapshot carries no gradient back to the block: take it once, outside the loss, and pass
    it in as params (or train the whole model through `from_hf_model`).

    Args:
        block: a transformers 5 sparse MoE block (``MixtralSparseMoeBlock``,
            ``Qwen3MoeSparseMoeBlock``, ``OlmoeSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock`` or
            ``DeepseekV3MoE``).

    Returns:
        ``{"router": [E, H], "w_gate_up": [E, H, 2F], "w_down": [E, F, H]}`` in the block's
            dtype and on its device, with ``router_bias [E]`` where the gate has a
            score-correction bias and ``shared_gate_up [H, 2Fs]``, ``shared_down [Fs, H]``,
            ``shared_gate [1, H]`` where the block has a shared expert (and its gate).

    Raises:
        ValueError: the block is not one psf computes exactly (naming what differs), or it is
            called inside a ``torch.func`` transform or a `stash_aware` step, where its tensors
            would silently get no gradient.
    """
    check_hf_block(block)
    if _frame.current() is not None or torch._C._functorch.maybe_current_level() is not None:
        raise ValueError("from_hf_moe_block returns a detached snapshot, so inside a loss being "
                         "differentiated its tensors get no gradient: take the snapshot once "
                         "outside the loss and pass it in as params, or train the whole model "
                         "with params, loss_fn = psf.from_hf_model(model)")
    with torch.no_grad():
        out = {"router": block.gate.weight.detach().clone(),
               "w_gate_up": block.experts.gate_up_proj.detach().transpose(1, 2).contiguous(),
               "w_down": block.experts.down_proj.detach().transpose(1, 2).contiguous()}
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if bias is not None:
            out["router_bias"] = bias.detach().clone()
        mlp, gate = shared_module(block)
        if mlp is not None:
            out["shared_gate_up"] = torch.cat([mlp.gate_proj.weight.detach().T,
                                               mlp.up_proj.weight.detach().T], dim=1)
            out["shared_down"] = mlp.down_proj.weight.detach().T.contiguous()
        if gate is not None:
            out["shared_gate"] = gate.weight.detach().clone()
        return out


def hf_moe_kwargs(block) -> dict:
    """The routing keyword arguments of a transformers MoE block, for `psf.moe`.

    Args:
        block: a transformers 5 sparse MoE block, as `from_hf_moe_block` takes it.

    Returns:
        ``{"top_k": int, "router": psf.Router(...)}``, the router describing the block's
            scores, renormalisation, groups and scaling.

    Raises:
        ValueError: the block is not one psf computes exactly, or its router cannot pick its
            ``top_k`` experts.
    """
    from ..core._router import Router
    check_hf_block(block)
    gate = block.gate
    normalize = bool(getattr(gate, "norm_topk_prob", True))
    if type(block).__name__ == "DeepseekV3MoE":
        router = Router(scores="sigmoid", normalize=normalize,
                        scale=float(gate.routed_scaling_factor), groups=int(gate.num_group),
                        groups_kept=int(gate.topk_group), logits_dtype=torch.float32)
    else:
        router = Router(normalize=normalize)
    router.check(int(gate.weight.shape[0]), int(gate.top_k))     # refused when built, by name
    return {"top_k": int(gate.top_k), "router": router}


def check_hf_block(block) -> None:
    """`ValueError` naming what `psf.moe` cannot represent in ``block``."""
    name = type(block).__name__
    if name not in SUPPORTED:
        raise ValueError(f"{name} is not a supported transformers-5 sparse MoE block "
                         f"({', '.join(SUPPORTED)}): its math may differ from psf.moe")
    mlp, gate = shared_module(block)
    if mlp is not None:
        act = type(getattr(mlp, "act_fn", None)).__name__
        if act not in ("SiLU", "SiLUActivation") or any(
                getattr(getattr(mlp, n, None), "bias", None) is not None
                for n in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"{name}'s shared expert is not a bias-free SwiGLU with SiLU "
                             f"(activation {act})")
    if gate is not None and (gate.weight.shape[0] != 1 or gate.bias is not None):
        raise ValueError(f"{name}'s shared_expert_gate must be a bias-free Linear(H, 1)")
    experts = block.experts
    missing = [a for a in ("gate_up_proj", "down_proj") if not hasattr(experts, a)]
    if missing or not hasattr(block.gate, "weight"):
        raise ValueError(f"{name} lacks gate.weight or experts.{missing}: older transformers "
                         f"versions keep one nn.Linear per expert; upgrade to transformers>=5")
    act = type(getattr(experts, "act_fn", None)).__name__
    if act not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"{name} uses the activation {act}; psf.moe's experts are SwiGLU with "
                         f"SiLU (hidden_act='silu')")
    if getattr(experts, "has_bias", False):
        raise ValueError(f"{name} has expert biases, which psf.moe does not compute")
    if getattr(block, "jitter_noise", 0):
        raise ValueError(f"{name} multiplies its input by router jitter noise "
                         f"(router_jitter_noise={block.jitter_noise}) in training; psf.moe "
                         f"draws no noise: build the block with router_jitter_noise=0")
