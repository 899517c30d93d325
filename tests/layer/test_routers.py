"""Routers as data, shared experts, router statistics and the load-balancing losses, each
against an independent reference: transformers' own router modules and loss, formulas written
out here, and hand-computed cases."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from worlds import no_failures, spawn_world

import pagedstash_func as psf

E, H, F, K, T = 8, 16, 24, 2, 32
D = torch.float64


def _params(seed=0, **extra):
    g = torch.Generator().manual_seed(seed)
    p = psf.moe_init(E, H, F, generator=g, dtype=D)
    for name, shape in extra.items():
        p[name] = torch.randn(*shape, generator=g, dtype=D) * 0.3
    return p


def _x(seed=1, t=T):
    return torch.randn(t, H, generator=torch.Generator().manual_seed(seed), dtype=D)


def test_the_default_router_keeps_todays_bits():
    p, x = _params(), _x()
    ids, w = psf.route(p["router"], x, K)
    probs = torch.softmax(x @ p["router"].T, dim=-1)
    top, want = torch.topk(probs, K, dim=-1)
    assert torch.equal(ids, want) and torch.equal(w, top / top.sum(-1, keepdim=True))
    same = psf.route(p["router"], x, K, router=psf.Router())
    assert torch.equal(same[0], ids) and torch.equal(same[1], w)


def _deepseek_reference(weight, bias, x, k, groups, kept, scale):
    """DeepSeek-V3's router, written from its formula."""
    scores = torch.sigmoid(x.float() @ weight.float().T)
    choice = scores + bias
    g = choice.view(len(x), groups, -1).topk(2, dim=-1).values.sum(-1)
    mask = torch.zeros_like(g).scatter_(1, g.topk(kept, dim=-1).indices, 1).bool()
    choice = choice.masked_fill(~mask.repeat_interleave(E // groups, dim=1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices
    w = scores.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * scale


def test_sigmoid_group_limited_routing_with_a_bias_matches_its_formula():
    p, x = _params(), _x().float()
    bias = torch.randn(E, generator=torch.Generator().manual_seed(3)) * 0.5
    router = psf.Router(scores="sigmoid", groups=4, groups_kept=2, scale=2.5,
                        logits_dtype=torch.float32)
    ids, w = psf.route(p["router"].float(), x, K, router=router, bias=bias)
    ref_ids, ref_w = _deepseek_reference(p["router"], bias, x, K, 4, 2, 2.5)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)
    # the bias changed the choice for some tokens, but never the weight of a chosen expert
    plain, _ = psf.route(p["router"].float(), x, K, router=router)
    assert not torch.equal(plain, ids)


def test_deepseek_v3_router_module_agrees():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    cfg = transformers.DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K,
                                        n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                        norm_topk_prob=True)
    gate = DeepseekV3TopkRouter(cfg)
    torch.manual_seed(0)
    torch.nn.init.normal_(gate.weight, std=0.3)
    gate.e_score_correction_bias.normal_(std=0.5)
    x = _x().float()
    _, hf_w, hf_ids = gate(x)
    router = psf.Router(scores="sigmoid", groups=4, groups_kept=2, scale=2.5,
                        logits_dtype=torch.float32)
    ids, w = psf.route(gate.weight.detach(), x, K, router=router,
                       bias=gate.e_score_correction_bias)
    order = hf_ids.argsort(dim=-1)                 # transformers takes topk(sorted=False)
    mine = ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, order), ids.gather(1, mine))
    torch.testing.assert_close(hf_w.gather(1, order), w.gather(1, mine), rtol=1e-6, atol=1e-7)


def test_router_options_on_the_capacity_path_equal_the_exact_path():
    """Drops and reruns included: cf 1.0 over two virtual ranks with skewed scores."""
    p = _params(router_bias=(E,), shared_gate_up=(H, 20), shared_down=(10, H),
                shared_gate=(1, H))
    router = psf.Router(scores="sigmoid", groups=4, groups_kept=2, scale=1.5,
                        logits_dtype=torch.float32)

    def loss(params, x):
        return psf.moe(params, x, top_k=K, router=router).square().mean()

    for cf in (1.0, 4.0):
        step = psf.stash_aware(loss, psf.StashConfig(capacity_factor=cf, expert_ranks=2,
                                                     paged_stash=True, page_size=8))
        x = _x()
        res = psf.run_step(step, p, x, step.init(p, x))
        loss_ref, grads_ref = torch.func.grad_and_value(loss)(p, x)[::-1]
        torch.testing.assert_close(res.loss, loss_ref, rtol=1e-12, atol=0)
        for name in grads_ref:
            torch.testing.assert_close(res.grads[name], grads_ref[name], rtol=1e-10, atol=1e-12)
    assert torch.count_nonzero(res.grads["router_bias"]) == 0     # chosen with, not trained


def test_shared_expert_matches_its_formula():
    p = _params(shared_gate_up=(H, 20), shared_down=(10, H), shared_gate=(1, H))
    x = _x()
    routed = {k: p[k] for k in psf.PARAM_NAMES}
    gate, up = x @ p["shared_gate_up"][:, :10], x @ p["shared_gate_up"][:, 10:]
    shared = torch.sigmoid(x @ p["shared_gate"][0])[:, None] * (
        (gate * torch.sigmoid(gate) * up) @ p["shared_down"])
    torch.testing.assert_close(psf.moe(p, x, top_k=K), psf.moe(routed, x, top_k=K) + shared,
                               rtol=1e-12, atol=1e-12)
    no_gate = {k: v for k, v in p.items() if k != "shared_gate"}
    torch.testing.assert_close(psf.moe(no_gate, x, top_k=K) - psf.moe(routed, x, top_k=K),
                               (gate * torch.sigmoid(gate) * up) @ p["shared_down"],
                               rtol=1e-10, atol=1e-12)


def test_bad_router_settings_and_params_name_the_fix():
    cases = [(dict(scores="relu"), "scores"), (dict(groups=3, groups_kept=4), "groups_kept"),
             (dict(scale=0.0), "scale"), (dict(logits_dtype=torch.int32), "logits_dtype")]
    for kw, word in cases:
        with pytest.raises(ValueError, match=word):
            psf.Router(**kw)
    p, x = _params(), _x()
    with pytest.raises(ValueError, match="divide"):
        psf.moe(p, x, top_k=K, router=psf.Router(groups=3))
    with pytest.raises(ValueError, match="exceeds"):
        psf.moe(p, x, top_k=3, router=psf.Router(groups=4, groups_kept=1))
    with pytest.raises(ValueError, match="not both"):
        psf.moe(p, x, top_k=K, norm_topk_prob=False, router=psf.Router())
    with pytest.raises(ValueError, match="router_bias must be"):
        psf.moe({**p, "router_bias": torch.zeros(E + 1, dtype=D)}, x, top_k=K)
    with pytest.raises(ValueError, match="shared expert needs"):
        psf.moe({**p, "shared_down": torch.zeros(4, H, dtype=D)}, x, top_k=K)
    with pytest.raises(ValueError, match="does not read"):
        psf.moe({**p, "bias": torch.zeros(E, dtype=D)}, x, top_k=K)
    ids, w = psf.route(p["router"], x, K)
    with pytest.raises(ValueError, match="return_stats"):
        psf.moe(p, x, top_k=K, routing=(ids, w), return_stats=True)
    with pytest.raises(ValueError, match="replaces the router"):
        psf.moe(p, x, top_k=K, routing=(ids, w), router=psf.Router(scale=2.0))


# ------------------------------------------------------------------------------ the losses


def _hand_stats():
    """Two experts, top-1, three tokens (the last padding)."""
    logits = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0], [5.0, -5.0]], dtype=D,
                          requires_grad=True)
    ids = torch.tensor([[0], [0], [1]])
    return logits, psf.router_stats(logits, ids, torch.tensor([True, True, False]))


def test_switch_loss_and_z_loss_on_a_hand_computed_case():
    logits, stats = _hand_stats()
    # P = mean of (3/4, 1/4) and (1/2, 1/2) = (5/8, 3/8); f = (1, 0); loss = 2 * 5/8
    loss = psf.switch_loss(stats)
    torch.testing.assert_close(loss, torch.tensor(1.25, dtype=D))
    loss.backward()
    assert logits.grad[:2].abs().sum() > 0 and torch.count_nonzero(logits.grad[2]) == 0
    z = psf.z_loss(stats)
    torch.testing.assert_close(z, torch.tensor((math.log(4.0) ** 2 + math.log(2.0) ** 2) / 2,
                                               dtype=D))
    # per sequence: two sequences of 2 tokens [t0, t1], [t2, pad] -> ... only seq 0 has pairs
    logits4 = torch.cat([logits.detach(), torch.zeros(1, 2, dtype=D)])
    stats4 = psf.router_stats(logits4, torch.tensor([[0], [1], [0], [1]]),
                              torch.tensor([True, True, True, False]))
    per_seq = psf.switch_loss(stats4, seq_len=2)
    p2 = torch.softmax(logits4[2], -1)
    want = (1.0 + 2 * (1.0 * p2[0])) / 2            # seq 1: f = (1, 0), P = softmax(t2)
    torch.testing.assert_close(per_seq, want)
    with pytest.raises(ValueError, match="seq_len"):
        psf.switch_loss(stats4, seq_len=3)


def test_load_balancing_loss_equals_transformers():
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(2 * 6, E, generator=g) for _ in range(3)]
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    for m in (None, mask):
        stats = [psf.router_stats(lg, torch.topk(lg.softmax(-1), K, -1).indices,
                                  None if m is None else m.reshape(-1)) for lg in logits]
        ref = load_balancing_loss_func(tuple(logits), E, K, m)
        torch.testing.assert_close(psf.load_balancing_loss(stats), ref, rtol=1e-6, atol=1e-7)


def test_the_statistics_of_a_capacity_step_see_dropped_pairs_and_keep_their_gradient():
    p = _params()

    def loss(params, x):
        y, stats = psf.moe(params, x, top_k=K, return_stats=True)
        return y.square().mean() + 0.1 * psf.switch_loss(stats) + 0.01 * psf.z_loss(stats)

    step = psf.stash_aware(loss, psf.StashConfig(capacity_factor=0.5, expert_ranks=2))
    x = _x()
    res = psf.run_step(step, p, x, step.init(p, x))
    assert res.report.reran
    ref_grads, ref_loss = torch.func.grad_and_value(loss)(p, x)
    torch.testing.assert_close(res.loss, ref_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(res.grads["router"], ref_grads["router"], rtol=1e-10, atol=1e-12)
    no_aux = torch.func.grad(lambda q, b: psf.moe(q, b, top_k=K).square().mean())(p, x)
    assert not torch.allclose(no_aux["router"], ref_grads["router"])


def test_update_expert_bias_on_a_hand_computed_case():
    bias = torch.tensor([0.0, 0.5, -0.5, 0.0])
    new = psf.update_expert_bias(bias, [10, 2, 4, 4], rate=0.1)      # mean 5
    torch.testing.assert_close(new, torch.tensor([-0.1, 0.6, -0.4, 0.1]))
    assert torch.equal(bias, torch.tensor([0.0, 0.5, -0.5, 0.0]))
    with pytest.raises(ValueError, match="one count per expert"):
        psf.update_expert_bias(bias, [1, 2, 3])
    with pytest.raises(ValueError, match="one count per expert"):
        psf.update_expert_bias(bias, [[1, 2], [3, 4]])
    for rate in (0, float("inf")):
        with pytest.raises(ValueError, match="rate"):
            psf.update_expert_bias(bias, [1, 2, 3, 4], rate=rate)
    # a bf16 bias would round steps of 1e-3 away at 0.5 (seen: 100 steps left it unmoved)
    with pytest.raises(ValueError, match="keep the router bias in fp32"):
        psf.update_expert_bias(bias.bfloat16(), [10, 2, 4, 4], rate=1e-3)


def global_switch_loss(rank, world):
    """Each rank its own half of a batch; f from global_counts over both ranks, P local: the
    gradient averaged over the ranks equals the one-process loss's on the whole batch."""
    p = _params()
    x_all = _x(t=2 * T)
    mine = x_all[rank * T:(rank + 1) * T]

    def loss(params, x, group):
        y, stats = psf.moe(params, x, top_k=K, return_stats=True)
        return psf.switch_loss(stats, counts=psf.global_counts([stats], group))

    grads = torch.func.grad(loss)(p, mine, dist.group.WORLD)
    for g in pytree.tree_leaves(grads):
        dist.all_reduce(g)
        g /= world
    whole = torch.func.grad(loss)(p, x_all, None)
    step = psf.stash_aware(lambda q, b: loss(q, b, dist.group.WORLD),
                           psf.StashConfig(capacity_factor=1.0, expert_ranks=2))
    res = psf.run_step(step, p, mine, step.init(p, mine))
    return (all(torch.allclose(grads[k], whole[k], rtol=1e-10, atol=1e-13) for k in whole),
            torch.allclose(res.grads["router"], torch.func.grad(loss)(p, mine, dist.group.WORLD)
                           ["router"], rtol=1e-10, atol=1e-13), res.report.flagged_by)


def test_a_global_switch_loss_over_two_ranks_equals_the_one_process_loss():
    values = spawn_world(2, [global_switch_loss])["global_switch_loss"]
    no_failures(values)
    assert [v[:2] for v in values] == [(True, True), (True, True)]
    assert values[0][2] == values[1][2]           # the ranks decided their rerun together


def test_global_counts_over_two_micro_batches_equal_the_concatenated_batch():
    """f from the counts of two micro-batches is the f of the batch they make together (the
    counts are sums), padding excluded; P stays each micro-batch's own."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2 * T, E, generator=g, dtype=D)
    ids = torch.topk(logits, K, dim=-1).indices
    valid = torch.rand(2 * T, generator=g) > 0.2
    whole = psf.router_stats(logits, ids, valid)
    halves = [psf.router_stats(logits[i * T:(i + 1) * T], ids[i * T:(i + 1) * T],
                               valid[i * T:(i + 1) * T]) for i in range(2)]
    torch.testing.assert_close(psf.global_counts(halves), whole.counts())
    torch.testing.assert_close(psf.global_counts([h.counts() for h in halves]), whole.counts())
    torch.testing.assert_close(whole.counts().sum(), valid.sum().to(torch.float32) * K)
    # a loss with the global f and each half's P, averaged, equals the whole batch's loss
    # when the halves hold as many valid tokens each
    equal = torch.ones(2 * T, dtype=torch.bool)
    halves = [psf.router_stats(logits[i * T:(i + 1) * T], ids[i * T:(i + 1) * T],
                               equal[:T]) for i in range(2)]
    counts = psf.global_counts(halves)
    mean = sum(psf.switch_loss(h, counts=counts) for h in halves) / 2
    torch.testing.assert_close(mean, psf.switch_loss(psf.router_stats(logits, ids)))


def test_switch_loss_edge_cases_a_review_found():
    """All-padding sequences do not count in the per-sequence mean; padding ids on valid
    tokens count nowhere, so the local f and counts=stats.counts() agree; no token gives 0;
    a sigmoid router's P is its scores over their sum (as Megatron-Core reads it)."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4 * 6, E, generator=g, dtype=D)
    ids = torch.topk(logits, K, dim=-1).indices
    valid = torch.ones(24, dtype=torch.bool)
    valid[18:] = False                                   # the last sequence is all padding
    padded = psf.switch_loss(psf.router_stats(logits, ids, valid), seq_len=6)
    kept = psf.switch_loss(psf.router_stats(logits[:18], ids[:18]), seq_len=6)
    torch.testing.assert_close(padded, kept)
    holes = ids.clone()
    holes[::3, 1] = -1
    st = psf.router_stats(logits, holes)
    torch.testing.assert_close(psf.switch_loss(st), psf.switch_loss(st, counts=st.counts()))
    torch.testing.assert_close(psf.switch_loss(st, counts=st.counts().tolist()),
                               psf.switch_loss(st))
    empty = psf.router_stats(logits[:0], ids[:0])
    assert float(psf.switch_loss(empty)) == 0 and float(psf.load_balancing_loss([empty])) == 0
    sig = psf.router_stats(logits, ids, scores="sigmoid")
    p = torch.sigmoid(logits)
    torch.testing.assert_close(sig.probs, p / p.sum(-1, keepdim=True))
    p = psf.moe(_params(), _x(), top_k=K, router=psf.Router(scores="sigmoid"),
                return_stats=True)[1].probs
    torch.testing.assert_close(p.sum(-1), torch.ones(T, dtype=D))
    # transformers' loss reads the softmax of the logits whatever the router scores with
    torch.testing.assert_close(psf.load_balancing_loss([sig]),
                               psf.load_balancing_loss([psf.router_stats(logits, ids)]))


def test_optional_params_of_the_wrong_dtype_or_device_name_the_fix():
    p = _params(shared_gate_up=(H, 20), shared_down=(10, H), shared_gate=(1, H))
    x = _x()
    with pytest.raises(ValueError, match="shared expert's weights"):
        psf.moe({**p, "shared_gate": p["shared_gate"].float()}, x, top_k=K)
    with pytest.raises(ValueError, match="router_bias must be"):
        psf.moe({**_params(), "router_bias": torch.zeros(E, dtype=torch.bool)}, x, top_k=K)
    with pytest.raises(ValueError, match="router_bias must be"):
        psf.moe({**_params(), "router_bias": torch.zeros(E, device="meta")}, x, top_k=K)
    import numpy as np
    assert psf.Router(scale=np.float32(2.0), groups=np.int64(2)).groups == 2
