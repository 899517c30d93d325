"""psf.plan_memory: what autograd keeps per kind against the tensors a real step keeps (CPU,
three families, stash and capacity paths, two token counts); weights, gradients and the
optimizer's state against the tensors `from_hf_model` and `sharded_optimizer` hold (one
process here, 4 gloo ranks in test_zero); a plan that cannot fit names what overflows."""

import pytest
import torch
import torch.utils._pytree as pytree

import pagedstash_func as psf

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=2,
              attn_implementation="sdpa", pad_token_id=0, eos_token_id=1, bos_token_id=2)


def config(family, dense=False):
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(moe_intermediate_size=48, num_experts=8,
                                           head_dim=32, intermediate_size=40,
                                           mlp_only_layers=[1] if dense else [], **COMMON)
    if family == "olmoe":
        return transformers.OlmoeConfig(intermediate_size=48, num_experts=8, **COMMON)
    return transformers.MixtralConfig(intermediate_size=48, num_local_experts=8, **COMMON)


def kept_bytes(loss, params) -> int:
    """Bytes of the storages autograd's graph of ``loss`` keeps, the parameters' own
    excepted: every node's saved tensors, read by walking the graph."""
    own = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(params)}
    seen, stack, visited = {}, [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        tensors = []
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except RuntimeError:
                    continue
                tensors += list(value) if isinstance(value, (tuple, list)) else [value]
        tensors += list(getattr(node, "saved_tensors", ()) or ())
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in own:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack += [f for f, _ in node.next_functions]
    return sum(seen.values())


STEPS = {
    "stash": psf.StashConfig(capacity_factor=1.25, paged_stash=True, pool_scope="layer"),
    "stash, one pool": psf.StashConfig(capacity_factor=1.25, paged_stash=True),
    "capacity": psf.StashConfig(capacity_factor=1.25, paged_stash=False),
    "exact": psf.StashConfig(),
    # each MoE layer at its own factor
    "per layer": psf.StashConfig(capacity_factor=0.5, paged_stash=False, expert_ranks=2,
                                 layer_factors={"moe0": 2.0, "moe1": 1.0}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mixtral", "qwen3_moe dense"])
def test_the_plan_counts_what_a_step_keeps_for_backward(family, dtype):
    """Within 1 % of the storages a real step's autograd graph keeps (the parameters' own
    excepted), at two token counts, on every path, in fp32 and in bf16 (where what is kept
    in fp32 and what in the model's dtype differ); "dense": a Qwen3-MoE whose second layer
    is a dense MLP."""
    cfg = config(family.split()[0], dense=family.endswith("dense"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    params, loss_fn = psf.from_hf_model(model)
    params = pytree.tree_map(lambda t: t.requires_grad_(), params)
    for seq in (64, 128):
        ids = torch.randint(3, 96, (2, seq))
        batch = {"input_ids": ids, "labels": ids.clone()}
        for name, step_cfg in STEPS.items():
            step = psf.stash_aware(loss_fn, step_cfg)
            loss, _ = step.attempt(params, batch, step.init(params, batch))
            plan = psf.plan_memory(model, 2 * seq, cfg=step_cfg, optimizer=None)
            a = plan.activations
            want = sum(v for k, v in a.items() if k != "stash_pools")
            got = kept_bytes(loss, params)
            assert abs(want - got) <= 0.01 * got, (seq, name, want, got)
            state = step.init(params, batch)
            pools = sum(lay.cuda_pages * lay.page_bytes
                        for lay in [*state.layer_pools.values(), *state.layouts])
            assert a["stash_pools"] == pools, (name, a["stash_pools"], pools)


@pytest.mark.parametrize("offload,optimizer", [(False, "adamw"), (True, "adamw"),
                                               (False, "adamw8bit")])
def test_held_terms_are_the_tensors_bytes(offload, optimizer):
    cfg = config("qwen3_moe")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    fp32 = psf.plan_memory(model, 256, optimizer=None)       # the model's own dtype
    assert fp32.weights == sum(t.nbytes for t in model.parameters())
    model = model.to(torch.bfloat16)
    params, _ = psf.from_hf_model(model)
    kind = torch.optim.AdamW if optimizer == "adamw" else pytest.importorskip(
        "torchao.optim").AdamW8bit
    opt = psf.sharded_optimizer(params, None, kind, offload=offload)
    opt.step(params, pytree.tree_map(torch.zeros_like, params))    # the moments made
    plan = psf.plan_memory(model, 256, offload=offload, optimizer=optimizer)
    assert sum(plan.terms().values()) == plan.peak
    assert set(plan.by_moment) == {"forward", "loss", "backward", "optimizer"}
    assert plan.by_moment[plan.peak_at] == plan.at_peak                  # copies, not one dict
    assert plan.by_moment[plan.peak_at] is not plan.at_peak
    assert max(sum(terms.values()) for terms in plan.by_moment.values()) == plan.peak
    held = sum(t.nbytes for t in pytree.tree_leaves(params))
    assert plan.weights == plan.gradients == held
    if offload:
        assert (plan.master, plan.optimizer_state) == (0, 0)
        assert plan.host == opt.state_bytes() and plan.pinned_host > 0
    else:
        assert plan.master + plan.optimizer_state == opt.state_bytes()
        assert plan.host == 0
    assert plan.peak > held * 2 and plan.peak_at in ("forward", "loss", "backward", "optimizer")


def test_a_plan_that_cannot_fit_names_what_overflows():
    """The OLMoE-1B-7B shape, 16 layers: AdamW's state does not fit 80 GB; offloaded it
    does, and the host holds 12 bytes a parameter."""
    cfg = transformers.OlmoeConfig(num_hidden_layers=16, hidden_size=2048, num_experts=64,
                                   intermediate_size=1024, num_experts_per_tok=8,
                                   vocab_size=50304, num_attention_heads=16,
                                   num_key_value_heads=16)
    plan = psf.plan_memory(cfg, 16384)
    with pytest.raises(ValueError, match=r"exceeds the device's 80.00 GiB .* optimizer_state "
                                         r"[\d.]+ GiB \(offload=True"):
        plan.check(80 * 2**30)
    offloaded = psf.plan_memory(cfg, 16384, offload=True)
    offloaded.check(80 * 2**30)
    assert offloaded.host == 12 * offloaded.weights // 2          # bf16 weights
    assert "peak" in offloaded.table() and "pinned host" in offloaded.table()


def test_bad_input_is_refused_by_name():
    eager = config("olmoe")
    eager._attn_implementation = "eager"
    with pytest.raises(ValueError, match="'eager' attention keeps each sequence's"):
        psf.plan_memory(eager, 128)
    for mesh in ((2, 4), 8, "dp"):
        with pytest.raises(ValueError, match="mesh must be a"):
            psf.plan_memory(config("olmoe"), 64, mesh=mesh)
    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
        psf.plan_memory(config("olmoe"), 64, dtype="bfloat16")
    with pytest.raises(ValueError, match="cfg must be a psf.StashConfig"):
        psf.plan_memory(config("olmoe"), 64, cfg={"capacity_factor": 1.25})
    with pytest.raises(ValueError, match="a plan has not seen"):
        psf.plan_memory(config("olmoe"), 64, cfg=psf.StashConfig(
            capacity_factor=1.25, paged_stash=True, cuda_factor=-1.0))
    with pytest.raises(ValueError, match="device_bytes must be a positive number"):
        psf.plan_memory(config("olmoe"), 64).check("80GB")
    with pytest.raises(ValueError, match="plans qwen3_moe, olmoe, mixtral models"):
        psf.plan_memory(transformers.Qwen2MoeConfig(), 128)
    with pytest.raises(ValueError, match="tokens must be a positive integer"):
        psf.plan_memory(config("olmoe"), 0)
    with pytest.raises(ValueError, match="pass mesh=None"):
        psf.plan_memory(config("olmoe"), 64, mesh={"dp": 2, "ep": 1}, offload=True)
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        psf.plan_memory(config("olmoe"), 64, mesh={"dp": 1, "ep": 3})
    with pytest.raises(ValueError, match="optimizer must be"):
        psf.plan_memory(config("olmoe"), 64, optimizer="sgd")
