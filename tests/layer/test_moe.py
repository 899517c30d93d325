"""The MoE layer: exact path, capacity path, stash, padding ids, edge shapes, transformers."""

import math
import os

import pytest
import torch
from moe_reference import reference_moe, reference_routing

import pagedstash_func as psf

# These tests run on CPU tensors: Triton runs there only under the interpreter (a CPU machine).
CPU_BACKENDS = ["torch", "triton"] if os.environ.get("TRITON_INTERPRET") == "1" else ["torch"]

E, H, F, K = 6, 16, 12, 2


def params_and_x(tokens, dtype=torch.float64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    params = psf.moe_init(E, H, F, generator=g, dtype=dtype, device=device)
    x = torch.randn(tokens, H, generator=g, dtype=torch.float32).to(dtype=dtype, device=device)
    return params, x


def loss_of(y):
    return (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=y.device)
            .reshape(y.shape)).sum()


def on_path(path, cfg, tokens, ids, w):
    """``f(params, x)`` running one MoE call with fixed routing on the named path."""
    def f(p, x):
        if path == "exact":
            return psf.moe(p, x, top_k=K, routing=(ids, w))
        return psf.moe_capacity(p, x, capacity_state(p, tokens, cfg), layer="l0", top_k=K,
                                cfg=cfg, routing=(ids, w))[0]
    return f


def capacity_state(params, tokens, cfg, layer="l0", top_k=K):
    specs = psf.moe_stash_specs(layer, params, tokens=tokens, top_k=top_k, cfg=cfg) \
        if cfg.paged_stash else []
    return psf.init_stash_state(specs, cfg, device=params["w_down"].device,
                                counts={f"{layer}/expert_load": E})


# ----------------------------------------------------------------------------- exact path


@pytest.mark.parametrize("norm", [True, False])
def test_exact_matches_dense_loop_fp64(norm):
    params, x = params_and_x(11)
    y = psf.moe(params, x, top_k=K, norm_topk_prob=norm)
    ids, w = reference_routing(params["router"], x, K, norm)
    torch.testing.assert_close(y, reference_moe(params, x, ids, w), rtol=1e-12, atol=1e-12)


def test_exact_gradcheck():
    params, x = params_and_x(5)
    x.requires_grad_()
    leaves = [params[n].requires_grad_() for n in psf.PARAM_NAMES]

    def f(x, router, w_gate_up, w_down):
        p = {"router": router, "w_gate_up": w_gate_up, "w_down": w_down}
        return psf.moe(p, x, top_k=K)

    assert torch.autograd.gradcheck(f, (x, *leaves), eps=1e-6, atol=1e-7)


def test_exact_keeps_leading_shape_and_precomputed_routing():
    params, x = params_and_x(12)
    ids = torch.randint(0, E, (12, K), generator=torch.Generator().manual_seed(1))
    w = torch.rand(12, K, dtype=torch.float64)
    y = psf.moe(params, x.reshape(3, 4, H), top_k=K, routing=(ids, w))
    assert y.shape == (3, 4, H)
    torch.testing.assert_close(y.reshape(12, H), reference_moe(params, x, ids, w))


# ----------------------------------------------------------------------------- capacity path


@pytest.mark.parametrize("stash", [False, True])
def test_ample_capacity_equals_exact_values_and_grads(stash):
    tokens = 13
    params, x = params_and_x(tokens)
    cfg = psf.StashConfig(capacity_factor=float(E), paged_stash=stash, page_size=8,
                          expert_ranks=2)
    state = capacity_state(params, tokens, cfg)

    held = []

    def capacity_loss(p, x, state):
        y, state = psf.moe_capacity(p, x, state, layer="l0", top_k=K, cfg=cfg)
        held.append(sum(v["cuda_used"] for v in psf.pages_in_use(state).values()))
        return loss_of(y), (y, state)

    def exact_loss(p, x):
        y = psf.moe(p, x, top_k=K)
        return loss_of(y), y

    (g_p, g_x), (y_cap, state) = torch.func.grad(capacity_loss, argnums=(0, 1),
                                                 has_aux=True)(params, x, state)
    (e_p, e_x), y_exact = torch.func.grad(exact_loss, argnums=(0, 1), has_aux=True)(params, x)
    torch.testing.assert_close(y_cap, y_exact, rtol=0, atol=1e-13)
    torch.testing.assert_close(g_x, e_x, rtol=0, atol=1e-13)
    for name in g_p:
        torch.testing.assert_close(g_p[name], e_p[name], rtol=0, atol=1e-13)
    assert not any(psf.read_flags(state).values())
    ids, _ = reference_routing(params["router"], x, K)
    assert torch.equal(state.counts["l0/expert_load"], torch.bincount(ids.reshape(-1),
                                                                      minlength=E))
    if stash:   # pages held between forward and backward, all free again after
        assert held[0] == len(psf.stashed_names()) * -(-tokens * K // 8)
        assert all(v["cuda_used"] == 0 for v in psf.pages_in_use(state).values())


def test_stash_pages_follow_valid_rows():
    tokens, page = 21, 8
    params, x = params_and_x(tokens)
    ids = torch.randint(-1, E + 1, (tokens, K), generator=torch.Generator().manual_seed(3))
    w = torch.rand(tokens, K, dtype=torch.float64)
    valid = int(((ids >= 0) & (ids < E)).sum())
    cfg = psf.StashConfig(capacity_factor=4.0, paged_stash=True, page_size=page)
    state = capacity_state(params, tokens, cfg)
    x.requires_grad_()
    y, state = psf.moe_capacity(params, x, state, layer="l0", top_k=K, cfg=cfg,
                                routing=(ids, w))
    for name in psf.stashed_names():
        view = psf.table_view(state, f"l0/{name}")
        assert view["rows"] == valid
        assert len(view["pages"]) == math.ceil(valid / page)
    used = sum(v["cuda_used"] for v in psf.pages_in_use(state).values())
    assert used == len(psf.stashed_names()) * math.ceil(valid / page)
    loss_of(y).backward()
    assert all(v["cuda_used"] == 0 for v in psf.pages_in_use(state).values())
    torch.testing.assert_close(y, reference_moe(params, x.detach(), ids, w))


@pytest.mark.parametrize("capacity_factor, expect", [(1.0, True), (2.0, False)])
def test_forced_skew_sets_over_budget_exactly_when_over(capacity_factor, expect):
    tokens = 24                       # P = 48; R = 2: budget align16(ceil(cf * 24))
    params, x = params_and_x(tokens)
    ids = torch.zeros(tokens, K, dtype=torch.int64)          # every pair to expert 0 (rank 0)
    ids[:, 1] = 1
    w = torch.full((tokens, K), 0.5, dtype=torch.float64)
    cfg = psf.StashConfig(capacity_factor=capacity_factor, expert_ranks=2)
    budget, _ = psf.capacity_rows(tokens, K, cfg)
    assert budget == (32 if capacity_factor == 1.0 else 48)
    state = capacity_state(params, tokens, cfg)
    y, state = psf.moe_capacity(params, x, state, layer="l0", top_k=K, cfg=cfg,
                                routing=(ids, w))
    assert psf.read_flags(state)["over_budget"] is expect
    # Documented drop order: rank 0 keeps its pairs ranked by (expert, token, slot) below the
    # budget: all of expert 0 (24 pairs), then the first `budget - 24` tokens of expert 1.
    keep = torch.ones(tokens, K, dtype=torch.bool)
    keep[budget - tokens:, 1] = False
    torch.testing.assert_close(y, reference_moe(params, x, ids, w, keep=keep))


@pytest.mark.parametrize("seed", range(6))
def test_over_budget_flag_matches_rank_loads(seed):
    tokens, ranks = 40, 3
    params = psf.moe_init(E, H, F, dtype=torch.float64)
    x = torch.randn(tokens, H, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    skew = torch.tensor([8.0, 4, 1, 1, 1, 1]) ** (seed / 3)
    ids = torch.multinomial(skew, tokens * K, replacement=True, generator=g).reshape(tokens, K)
    w = torch.rand(tokens, K, dtype=torch.float64, generator=g)
    cfg = psf.StashConfig(capacity_factor=1.1, expert_ranks=ranks)
    budget, _ = psf.capacity_rows(tokens, K, cfg)
    loads = torch.bincount(ids.reshape(-1) // (E // ranks), minlength=ranks)
    state = capacity_state(params, tokens, cfg)
    _, state = psf.moe_capacity(params, x, state, layer="l0", top_k=K, cfg=cfg,
                                routing=(ids, w))
    assert psf.read_flags(state)["over_budget"] == bool((loads > budget).any())


# ----------------------------------------------------------------------------- padding ids


def test_minus_one_and_E_are_the_same_padding_bit_for_bit():
    tokens = 10
    params, x = params_and_x(tokens)
    ids = torch.randint(0, E, (tokens, K), generator=torch.Generator().manual_seed(0))
    pad = torch.rand(tokens, K, generator=torch.Generator().manual_seed(1)) < 0.4
    w = torch.rand(tokens, K, dtype=torch.float64)
    grads = []
    for pad_id in (-1, E):
        routed = torch.where(pad, pad_id, ids)
        grads.append(torch.func.grad(lambda p, x: loss_of(psf.moe(p, x, top_k=K,
                                                                  routing=(routed, w))),
                                     argnums=(0, 1))(params, x))
    (p1, x1), (p2, x2) = grads
    assert torch.equal(x1, x2) and all(torch.equal(p1[n], p2[n]) for n in p1)
    keep_x = torch.where(pad.any(1, keepdim=True) & pad.all(1, keepdim=True), 0.0, 1.0)
    assert torch.equal(x1 * (1 - keep_x), torch.zeros_like(x1))   # padding-only tokens: 0


@pytest.mark.parametrize("path", ["exact", "capacity"])
def test_inf_in_padding_only_token_stays_out(path):
    tokens = 6
    params, x = params_and_x(tokens)
    x[2] = float("inf")
    ids = torch.randint(0, E, (tokens, K), generator=torch.Generator().manual_seed(2))
    ids[2] = torch.tensor([-1, E])
    w = torch.rand(tokens, K, dtype=torch.float64)
    w[2] = float("nan")                                  # padding weights are ignored too
    cfg = psf.StashConfig(capacity_factor=2.0, paged_stash=True, page_size=4)
    f = on_path(path, cfg, tokens, ids, w)
    y = f(params, x)
    assert torch.isfinite(y).all() and not y[2].any()
    (g_p, g_x) = torch.func.grad(lambda p, x: loss_of(f(p, x)), argnums=(0, 1))(params, x)
    assert torch.isfinite(g_x).all() and not g_x[2].any()
    assert all(torch.isfinite(g).all() for g in g_p.values())


@pytest.mark.parametrize("path", ["exact", "capacity"])
def test_all_padding_call_gives_zeros_not_none(path):
    tokens = 5
    params, x = params_and_x(tokens)
    ids = torch.full((tokens, K), -1)
    w = torch.rand(tokens, K, dtype=torch.float64)
    cfg = psf.StashConfig(capacity_factor=1.0, paged_stash=True, page_size=4)
    f = on_path(path, cfg, tokens, ids, w)
    assert not f(params, x).any()
    g_p, g_x = torch.func.grad(lambda p, x: loss_of(f(p, x)), argnums=(0, 1))(params, x)
    assert not g_x.any()
    for name, g in g_p.items():
        assert g is not None and g.shape == params[name].shape and not g.any()


def test_out_of_range_ids():
    tokens = 4
    params, x = params_and_x(tokens)
    w = torch.rand(tokens, K, dtype=torch.float64)
    for bad in (-2, E + 1, 10**6):
        ids = torch.zeros(tokens, K, dtype=torch.int64)
        ids[3, 1] = bad
        with pytest.raises(ValueError, match=f"routing id {bad} at position \\(3, 1\\)"):
            psf.moe(params, x, top_k=K, routing=(ids, w))
        cfg = psf.StashConfig(capacity_factor=2.0)
        y, state = psf.moe_capacity(params, x, capacity_state(params, tokens, cfg),
                                    layer="l0", top_k=K, cfg=cfg, routing=(ids, w))
        assert psf.read_flags(state)["bad_id"]
        keep = torch.ones(tokens, K, dtype=torch.bool)
        keep[3, 1] = False                              # treated as padding in the attempt
        torch.testing.assert_close(y, reference_moe(params, x, ids, w, keep))


# ----------------------------------------------------------------------------- edge shapes


@pytest.mark.parametrize("case", ["empty_experts", "one_expert", "zero_tokens", "one_token"])
@pytest.mark.parametrize("path", ["exact", "capacity"])
def test_edge_shapes(case, path):
    tokens = {"zero_tokens": 0, "one_token": 1}.get(case, 9)
    params, x = params_and_x(tokens)
    g = torch.Generator().manual_seed(5)
    if case == "empty_experts":
        ids = torch.randint(0, 2, (tokens, K), generator=g) * 3      # experts 0 and 3 only
        ids[:, 1] = torch.where(ids[:, 0] == 0, 3, 0)
    elif case == "one_expert":
        ids = torch.full((tokens, K), 4)
        ids[:, 1] = -1
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]) \
            if tokens else torch.zeros(0, K, dtype=torch.int64)
    w = torch.rand(tokens, K, dtype=torch.float64, generator=g)
    cfg = psf.StashConfig(capacity_factor=float(E), paged_stash=True, page_size=4,
                          expert_ranks=3)
    f = on_path(path, cfg, tokens, ids, w)
    y = f(params, x)
    torch.testing.assert_close(y, reference_moe(params, x, ids, w), rtol=1e-12, atol=1e-12)
    g_p, g_x = torch.func.grad(lambda p, x: loss_of(f(p, x)), argnums=(0, 1))(params, x)
    e_p, e_x = torch.func.grad(
        lambda p, x: loss_of(reference_moe(p, x, ids, w)), argnums=(0, 1))(params, x)
    torch.testing.assert_close(g_x, e_x, rtol=1e-10, atol=1e-12)
    for name in ("w_gate_up", "w_down"):
        torch.testing.assert_close(g_p[name], e_p[name], rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- bad input


def test_bad_calls_raise_with_the_fix():
    params, x = params_and_x(4)
    with pytest.raises(ValueError, match="top_k must be in \\[1, 6\\]"):
        psf.moe(params, x, top_k=7)
    with pytest.raises(ValueError, match="hidden size 5"):
        psf.moe(params, torch.randn(4, 5, dtype=torch.float64), top_k=K)
    with pytest.raises(ValueError, match="cast one to the other"):
        psf.moe(params, x.float(), top_k=K)
    with pytest.raises(ValueError, match="\\[T, top_k\\]"):
        psf.moe(params, x, top_k=K, routing=(torch.zeros(4, 3, dtype=torch.int64),
                                             torch.zeros(4, 3)))
    with pytest.raises(ValueError, match="missing \\['router'\\]"):
        psf.moe({k: v for k, v in params.items() if k != "router"}, x, top_k=K)
    cfg = psf.StashConfig(capacity_factor=1.0, expert_ranks=4)
    with pytest.raises(ValueError, match="expert_ranks=4"):
        psf.moe_capacity(params, x, capacity_state(params, 4, cfg), layer="l0", top_k=K,
                         cfg=cfg)
    cfg = psf.StashConfig(capacity_factor=1.0, paged_stash=True)
    state = capacity_state(params, 8, cfg)
    with pytest.raises(ValueError, match="sized for 16 rows"):
        psf.moe_capacity(params, torch.randn(40, H, dtype=torch.float64), state, layer="l0",
                         top_k=K, cfg=cfg)
    with pytest.raises(ValueError, match="no pages for 'l1/act_in'"):
        psf.moe_capacity(params, x, state, layer="l1", top_k=K, cfg=cfg)


# ----------------------------------------------------------------------------- transformers


@pytest.mark.parametrize("model", ["mixtral", "qwen3_moe", "olmoe"])
def test_matches_transformers_blocks(model):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if model == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        config = transformers.MixtralConfig(hidden_size=32, intermediate_size=24,
                                            num_local_experts=8, num_experts_per_tok=2)
        block = MixtralSparseMoeBlock(config)
    elif model == "olmoe":
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
        config = transformers.OlmoeConfig(hidden_size=32, intermediate_size=24, num_experts=8,
                                          num_experts_per_tok=2, norm_topk_prob=False)
        block = OlmoeSparseMoeBlock(config)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24,
                                             num_experts=8, num_experts_per_tok=3,
                                             norm_topk_prob=False)
        block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    block.eval()
    x = torch.randn(2, 7, 32, requires_grad=True)
    cotangent = torch.randn(2, 7, 32)          # gradients of order one, so atol means something
    y_hf = block(x)
    (y_hf * cotangent).sum().backward()
    params = {k: v.requires_grad_() for k, v in psf.from_hf_moe_block(block).items()}
    x2 = x.detach().clone().requires_grad_()
    y = psf.moe(params, x2, **psf.hf_moe_kwargs(block))
    (y * cotangent).sum().backward()
    assert x.grad.abs().max() > 0.1 and block.gate.weight.grad.abs().max() > 0.1
    torch.testing.assert_close(y, y_hf, rtol=0, atol=1e-5)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x2.grad, x.grad, **tol)
    torch.testing.assert_close(params["router"].grad, block.gate.weight.grad, **tol)
    torch.testing.assert_close(params["w_gate_up"].grad,
                               block.experts.gate_up_proj.grad.transpose(1, 2), **tol)
    torch.testing.assert_close(params["w_down"].grad,
                               block.experts.down_proj.grad.transpose(1, 2), **tol)


def test_from_hf_refuses_blocks_whose_math_differs():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    with pytest.raises(ValueError, match="Linear is not a supported transformers-5 sparse MoE"):
        psf.from_hf_moe_block(torch.nn.Linear(2, 2))
    qwen2 = Qwen2MoeSparseMoeBlock(transformers.Qwen2MoeConfig(
        hidden_size=32, moe_intermediate_size=24, shared_expert_intermediate_size=24,
        num_experts=8, num_experts_per_tok=2))
    qwen2.shared_expert.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match="shared expert is not a bias-free SwiGLU"):
        psf.from_hf_moe_block(qwen2)
    from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeMoE
    granite = GraniteMoeMoE(transformers.GraniteMoeConfig(
        hidden_size=32, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2))
    with pytest.raises(ValueError, match="GraniteMoeMoE is not a supported"):
        psf.from_hf_moe_block(granite)
    gelu = MixtralSparseMoeBlock(transformers.MixtralConfig(
        hidden_size=32, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2,
        hidden_act="gelu"))
    with pytest.raises(ValueError, match="uses the activation GELU"):
        psf.from_hf_moe_block(gelu)
    jitter = MixtralSparseMoeBlock(transformers.MixtralConfig(
        hidden_size=32, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2,
        router_jitter_noise=0.1))
    with pytest.raises(ValueError, match="router jitter"):
        psf.hf_moe_kwargs(jitter)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("ranks", [1, 2])
def test_stash_gives_the_bits_of_no_stash(ranks, backend):
    """On one device the stash pages only the activation input (written by the SwiGLU forward
    kernel, read by the backward one) and gathers the fc1 input rows from x again in backward:
    gradients equal the unstashed capacity path's bit for bit, with drops (cf 0.6) and without,
    over 1 and 2 virtual ranks, with the torch twins and with the Triton kernels."""
    params, x = params_and_x(37)
    ids, w = psf.route(params["router"], x, K)
    for cf in (2.0, 0.6):
        grads = []
        for stash in (False, True):
            cfg = psf.StashConfig(capacity_factor=cf, paged_stash=stash, page_size=4,
                                  expert_ranks=ranks, backend=backend)
            f = on_path("capacity", cfg, x.shape[0], ids, w)
            grads.append(torch.func.grad(lambda p, x: loss_of(f(p, x)), argnums=(0, 1))(params,
                                                                                        x))
        (p0, x0), (p1, x1) = grads
        assert torch.equal(x0, x1) and all(torch.equal(p0[n], p1[n]) for n in p0)
    assert psf.stashed_names() == ("act_in",) and psf.stashed_names(2) == psf.STASHED
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        psf.stashed_names(0)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_blocks_with_shared_experts_and_sigmoid_routers_equal_transformers(family):
    """Qwen2-MoE's gated shared expert and DeepSeek-V3's sigmoid, group-limited router with
    a non-zero bias, scaling and shared expert: outputs and gradients equal the block's."""
    transformers = pytest.importorskip("transformers")
    if family == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
        block = Qwen2MoeSparseMoeBlock(transformers.Qwen2MoeConfig(
            hidden_size=32, moe_intermediate_size=24, shared_expert_intermediate_size=20,
            num_experts=8, num_experts_per_tok=2))
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
        block = DeepseekV3MoE(transformers.DeepseekV3Config(
            hidden_size=32, moe_intermediate_size=24, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5))
    block = block.float()      # transformers routes in fp32 whatever the dtype
    torch.manual_seed(0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if family == "deepseek_v3":
        block.gate.e_score_correction_bias.normal_(std=0.3)
    x = torch.randn(2, 6, 32, requires_grad=True)
    ref = block(x)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *block.parameters()])
    params = psf.from_hf_moe_block(block)
    kw = psf.hf_moe_kwargs(block)
    if family == "deepseek_v3":
        assert kw["router"].scores == "sigmoid" and "router_bias" in params
    else:
        assert "shared_gate" in params
    params = {k: v.requires_grad_() for k, v in params.items()}
    y = psf.moe(params, x, **kw)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
    grads = torch.autograd.grad(y.square().sum(), [x, params["router"], params["w_gate_up"]])
    torch.testing.assert_close(grads[0], ref_grads[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads[1], block.gate.weight.new_tensor(ref_grads[1 + [
        n for n, _ in block.named_parameters()].index("gate.weight")]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads[2], ref_grads[1 + [
        n for n, _ in block.named_parameters()].index("experts.gate_up_proj")].transpose(1, 2),
        rtol=1e-4, atol=1e-5)
