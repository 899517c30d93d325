"""from_hf_config: transformers' own construction with each rank's experts alone. Seeded the
same, its weights are the single-process model's (every family, fp32 and bf16), its loss
transformers'; build_bytes counts what a rank holds, checked against the Qwen3-30B-A3B
architecture's own parameter count."""

import pytest
import torch
import torch.utils._pytree as pytree

import pagedstash_func as psf

transformers = pytest.importorskip("transformers")
from hf_tiny import FAMILIES, lm_batch, tiny_model  # noqa: E402


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_built_model_equals_the_model_transformers_builds(family, dtype):
    config = tiny_model(family, experts=8).config
    kwargs = {} if dtype is None else {"dtype": dtype}
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    after = torch.get_rng_state()
    torch.manual_seed(5)
    built, loss_fn = psf.from_hf_config(config, dtype=dtype)
    assert torch.equal(torch.get_rng_state(), after)       # the generator moved as far
    whole, reference = psf.from_hf_model(model)
    assert pytree.tree_structure(built) == pytree.tree_structure(whole)
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(built),
                                                 pytree.tree_leaves(whole)))
    batch = lm_batch(pad_from=8)
    assert torch.equal(loss_fn(built, batch)[0], reference(whole, batch)[0])
    counted = psf.build_bytes(config, dtype=dtype)
    assert loss_fn.built_bytes["held"] == counted["replicated"] + counted["experts"] \
        == counted["whole"]


def test_an_expert_init_it_cannot_take_is_refused_by_name():
    from pagedstash_func.interop._build import _ExpertDraws
    t = _ExpertDraws(torch.Size([4, 16, 8]), torch.float32, 0, 2)
    with pytest.raises(ValueError, match="aten.exponential_.*from_hf_model\\(model, group"):
        t.exponential_()


def test_a_rank_of_the_qwen3_30b_a3b_shape_is_built_in_a_sixth_of_the_whole():
    """48 layers, 128 experts of 768, hidden 2048, bf16, on 8 ranks: what one rank holds while
    it builds, counted on the meta device, against the architecture's parameter count."""
    H, F, E, L, V, heads, kv, hd = 2048, 768, 128, 48, 151936, 32, 4, 128
    config = transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=H, intermediate_size=6144, moe_intermediate_size=F,
        num_hidden_layers=L, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
        num_experts=E, num_experts_per_tok=8, tie_word_embeddings=False)
    counted = psf.build_bytes(config, ranks=8, dtype=torch.bfloat16)
    attention = H * heads * hd + 2 * H * kv * hd + heads * hd * H + 2 * hd
    per_layer = attention + 2 * H + E * H                   # norms, router
    replicated = 2 * V * H + L * per_layer + H              # embedding, head, final norm
    experts = L * E * (H * 2 * F + F * H)
    assert counted["replicated"] == 2 * replicated
    assert counted["experts"] == 2 * experts // 8
    assert counted["drawn"] == 2 * H * 2 * F                  # one expert's gate_up at a time
    assert counted["whole"] == 2 * (replicated + experts)
    assert counted["peak"] < counted["whole"] / 5
