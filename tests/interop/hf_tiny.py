"""Tiny random-init transformers MoE causal LMs of each family psf computes, fp32."""

import torch

FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3")
VOCAB = 64


def tiny_model(family: str, seed: int = 0, layers: int = 3, experts: int = 4):
    import transformers
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  num_experts_per_tok=2, attn_implementation="sdpa", pad_token_id=0,
                  eos_token_id=1, bos_token_id=2)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=24, num_local_experts=experts, **common)
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=24, intermediate_size=40,
                                          num_experts=experts, mlp_only_layers=[1], head_dim=8,
                                          **common)
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=24, num_experts=experts, **common)
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(moe_intermediate_size=24, intermediate_size=40,
                                          shared_expert_intermediate_size=24,
                                          num_experts=experts, **common)
    elif family == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            moe_intermediate_size=24, intermediate_size=40, n_routed_experts=experts,
            n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, **{**common, "num_key_value_heads": 4})
    else:
        raise ValueError(family)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    if family == "deepseek_v3":          # a non-zero score-correction bias
        g = torch.Generator().manual_seed(seed + 1)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.2)
    return model


def lm_batch(batch=2, seq=12, seed=0, pad_from=None):
    """``input_ids``, ``labels`` (= ids) and, with ``pad_from``, a right-padded mask: row 1 is
    padding from ``pad_from`` on, with labels -100 there and on the last real token's target."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if pad_from is not None:
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[-1, pad_from:] = 0
        out["labels"][-1, pad_from:] = -100
        out["input_ids"][-1, pad_from:] = 0
        out["attention_mask"] = mask
    return out
