"""Per-layer capacity factors (`StashConfig.layer_factors`): each named layer's budget and
buffers come from its own factor, a layer over its budget flags the step alone, and every
step still gives the exact path's numbers."""

import math

import pytest
import torch

import pagedstash_func as psf
from pagedstash_func.core._routing import GEMM_ALIGN

E, H, F, K, T = 8, 16, 24, 2, 96


def _batch(seed, skew):
    """Two layers' routing: ``moe0`` sends a ``0.5 + skew / 2`` share of its tokens to the
    first rank's experts, ``moe1`` spreads them evenly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)

    def ids(share):
        first = torch.rand(T, generator=g) < share
        base = torch.where(first, torch.randint(0, E // 2, (T,), generator=g),
                           torch.randint(E // 2, E, (T,), generator=g))
        return torch.stack([base, (base + 1) % (E // 2) + (base // (E // 2)) * (E // 2)], 1)
    return {"x": x, "ids0": ids(0.5 + skew / 2), "ids1": ids(0.5)}


def _loss(params, batch):
    w = torch.full((T, K), 0.5, dtype=torch.float64)
    h = psf.moe(params["a"], batch["x"], top_k=K, routing=(batch["ids0"], w))
    y = psf.moe(params["b"], h, top_k=K, routing=(batch["ids1"], w))
    return y.square().mean()


def _params():
    g = torch.Generator().manual_seed(0)
    return {n: psf.moe_init(E, H, F, generator=g, dtype=torch.float64) for n in "ab"}


def _budget(cf, ranks=2):
    """By hand: ``align(min(ceil(cf * T * k / R), T * k))``."""
    rows = min(math.ceil(cf * T * K / ranks), T * K)
    return -(-rows // GEMM_ALIGN) * GEMM_ALIGN


@pytest.mark.parametrize("kw, match", [
    (dict(layer_factors={"moe0": 1.5}), "needs capacity_factor too"),
    (dict(capacity_factor=1.0, layer_factors={"moe0": 0.0}), "positive finite"),
    (dict(capacity_factor=1.0, layer_factors={"moe0": float("nan")}), "positive finite"),
    (dict(capacity_factor=1.0, layer_factors={"moe0": "2"}), "positive finite"),
    (dict(capacity_factor=1.0, layer_factors={0: 1.5}), "layer name: capacity factor"),
    (dict(capacity_factor=1.0, layer_factors=[("moe0",)]), "layer name: capacity factor"),
    (dict(capacity_factor=1.0, layer_factors=1.5), "layer name: capacity factor"),
    (dict(capacity_factor=1.0, layer_factors=[("moe0", 1.5), ("moe0", 2.0)]), "twice")])
def test_bad_layer_factors_name_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        psf.StashConfig(**kw)


def test_layer_factors_are_a_frozen_sorted_value():
    a = psf.StashConfig(capacity_factor=1.0, layer_factors={"moe1": 2, "moe0": 1.5})
    b = psf.StashConfig(capacity_factor=1.0, layer_factors=[["moe0", 1.5], ["moe1", 2.0]])
    assert a == b and hash(a) == hash(b)
    assert a.layer_factors == (("moe0", 1.5), ("moe1", 2.0))
    assert (a.factor_for("moe0"), a.factor_for("moe1"), a.factor_for("moe7")) == (1.5, 2.0, 1.0)


def test_each_layer_gets_its_own_budget_and_only_the_tight_one_flags():
    params, batch = _params(), _batch(1, skew=0.8)
    exact_grads, exact_loss = psf.value_and_grad(_loss)(params, batch)
    flat = dict(capacity_factor=1.25, expert_ranks=2, paged_stash=True, page_size=8,
                pool_scope="layer")
    for factors, over in [({}, True), ({"moe0": 2.0}, False), ({"moe1": 2.0}, True)]:
        step = psf.stash_aware(_loss, psf.StashConfig(**flat, layer_factors=factors))
        state = step.init(params, batch)
        budgets = [info.budget for info in state.layers]
        assert budgets == [_budget(factors.get(f"moe{i}", 1.25)) for i in range(2)]
        res = psf.run_step(step, params, batch, state)
        assert res.report.over_budget == over and res.report.reran == over
        # the skewed layer needs ~1.8x its balanced load, the even one about 1x
        assert res.report.layers[0].budget == budgets[0]
        assert max(res.report.layers[0].load_ratio) > 1.5
        torch.testing.assert_close(res.loss, exact_loss, rtol=1e-13, atol=0)
        for k in exact_grads:
            for n in exact_grads[k]:
                torch.testing.assert_close(res.grads[k][n], exact_grads[k][n], rtol=1e-12,
                                           atol=1e-14)
        # each layer's capacity buffer: R budgets, at most every pair
        aligned_pairs = -(-T * K // GEMM_ALIGN) * GEMM_ALIGN
        assert [lay.capacity for lay in res.report.layers] == \
            [min(2 * b, aligned_pairs) for b in budgets]


def test_a_name_the_loss_does_not_call_is_refused_at_init():
    step = psf.stash_aware(_loss, psf.StashConfig(capacity_factor=1.0, expert_ranks=2,
                                                  layer_factors={"moe2": 2.0}))
    with pytest.raises(ValueError, match=r"names \['moe2'\].*2 times.*'moe0', 'moe1'"):
        step.init(_params(), _batch(0, 0.0))


def test_the_ladder_refuses_fixed_layer_factors():
    cfg = psf.StashConfig(capacity_factor=1.0, paged_stash=True, pool_scope="layer",
                          layer_factors={"moe0": 2.0})
    with pytest.raises(ValueError, match="drop layer_factors"):
        psf.adaptive(_loss, cfg)


def test_a_step_file_keeps_the_layer_factors(tmp_path):
    params, batch = _params(), _batch(2, skew=0.8)
    cfg = psf.StashConfig(capacity_factor=1.25, expert_ranks=2, layer_factors={"moe0": 2.0})
    step = psf.stash_aware(_loss, cfg)
    state = step.init(params, batch)
    psf.save_step(tmp_path / "s.pt", step, params, batch, state)
    res = psf.run_step(step, params, batch, state)
    again, p2, b2, s2 = psf.load_step(tmp_path / "s.pt", _loss)
    assert again.cfg == cfg
    res2 = psf.run_step(again, p2, b2, s2)
    assert not res.report.reran and torch.equal(res.loss, res2.loss)


def test_per_layer_advice_meets_the_target_with_less_capacity_than_one_factor():
    """Profiled over 40 steps, one skewed layer and one even: each layer's factor is its own
    quantile at target / 2, so rerunning the same steps with them reruns at most the target
    share, where the one-factor advice would give the even layer the skewed one's budget."""
    params = _params()
    batches = [_batch(100 + i, skew=0.5 + 0.4 * (i % 5) / 4) for i in range(40)]
    cfg = psf.StashConfig(capacity_factor=1.0, expert_ranks=2)
    step = psf.stash_aware(_loss, cfg)
    state, prof = step.init(params, batches[0]), psf.RoutingProfile()
    for b in batches:
        res = psf.run_step(step, params, b, state)
        state = res.state
        prof.add(res.report)
    advice = prof.recommend(0.1, per_layer=True)
    per = advice["layer_factors"]
    assert set(per) == {"moe0", "moe1"} and per["moe1"] < per["moe0"] <= \
        advice["capacity_factor"]
    worst = {n: [max(r["load_ratio"] for r in prof.records if r["step"] == s and
                     r["layer"] == n) for s in range(40)] for n in per}
    assert all(sum(w > per[n] for w in worst[n]) <= 0.05 * 40 for n, w in worst.items())
    tuned = psf.stash_aware(_loss, psf.StashConfig(capacity_factor=advice["capacity_factor"],
                                                   expert_ranks=2, layer_factors=per))
    state, reran = tuned.init(params, batches[0]), 0
    for b in batches:
        res = psf.run_step(tuned, params, b, state)
        state, reran = res.state, reran + res.report.reran
    assert reran <= 0.1 * 40
    one = psf.stash_aware(_loss, psf.StashConfig(capacity_factor=advice["capacity_factor"],
                                                 expert_ranks=2)).init(params, batches[0])
    assert sum(i.budget for i in state.layers) < sum(i.budget for i in one.layers)
