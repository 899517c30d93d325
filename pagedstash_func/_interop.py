"""Weights from `transformers` MoE blocks (transformers is an optional dependency)."""

from __future__ import annotations

import torch


def from_hf_moe_block(block) -> dict[str, torch.Tensor]:
    """Params for `psf.moe` from a Mixtral or Qwen3-MoE sparse MoE block (transformers 5).

    Reads ``gate.weight [E, H]``, ``experts.gate_up_proj [E, 2F, H]`` and
    ``experts.down_proj [E, H, F]``; returns new tensors (a snapshot, detached) in this
    library's layout. Route with `hf_moe_kwargs` ``(block)`` to get the block's ``top_k`` and
    ``norm_topk_prob``.
    """
    try:
        router = block.gate.weight
        gate_up = block.experts.gate_up_proj
        down = block.experts.down_proj
    except AttributeError as err:
        raise ValueError(
            f"{type(block).__name__} is not a transformers-5 sparse MoE block (Mixtral, "
            f"Qwen3-MoE): expected gate.weight, experts.gate_up_proj and experts.down_proj. "
            f"Older transformers versions keep one nn.Linear per expert; upgrade to "
            f"transformers>=5.") from err
    with torch.no_grad():
        return {"router": router.detach().clone(),
                "w_gate_up": gate_up.detach().transpose(1, 2).contiguous(),
                "w_down": down.detach().transpose(1, 2).contiguous()}


def hf_moe_kwargs(block) -> dict:
    """``{"top_k": ..., "norm_topk_prob": ...}`` of a transformers MoE block, for `psf.moe`."""
    gate = block.gate
    return {"top_k": int(gate.top_k), "norm_topk_prob": bool(getattr(gate, "norm_topk_prob",
                                                                       True))}
