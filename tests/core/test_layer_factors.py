"""Per-layer capacity factors (`StashConfig.layer_factors`): each named layer's budget and
buffers come from its own factor, a layer over its budget flags the step alone, and every
step still gives the exact path's numbers."""

import math

import pytest
import torch

import pagedstash_func as psf
from moe_reference import two_rank_ids, two_rank_report
from pagedstash_func.core._routing import GEMM_ALIGN

E, H, F, K, T = 8, 16, 24, 2, 96


def _batch(seed, skew):
    """Two layers' routing: ``moe0`` sends a ``0.5 + skew / 2`` share of its tokens to the
    first rank's experts, ``moe1`` spreads them evenly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    return {"x": x, "ids0": two_rank_ids(T, E, 0.5 + skew / 2, g),
            "ids1": two_rank_ids(T, E, 0.5, g)}


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
    (dict(capacity_factor=1.0, layer_factors=["a1", "b2"]), "layer name: capacity factor"),
    (dict(capacity_factor=1.0, layer_factors="moe0"), "layer name: capacity factor"),
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


def test_a_state_of_another_config_is_refused():
    """A state's budgets are its config's (agreed across ranks, read by its reports): a step
    whose factors differ refuses it rather than report budgets it did not run at."""
    params, batch = _params(), _batch(0, 0.0)
    flat = psf.StashConfig(capacity_factor=1.25, expert_ranks=2, paged_stash=True)
    state = psf.stash_aware(_loss, flat).init(params, batch)
    tuned = psf.stash_aware(_loss, psf.StashConfig(capacity_factor=1.25, expert_ranks=2,
                                                   paged_stash=True,
                                                   layer_factors={"moe0": 2.0}))
    with pytest.raises(ValueError, match=r"moe0\) runs at a budget of .* built for"):
        psf.run_step(tuned, params, batch, state)


def test_by_hand_a_name_no_stashed_tensor_has_is_refused():
    params = _params()["a"]
    cfg = psf.StashConfig(capacity_factor=1.25, paged_stash=True, layer_factors={"blk0": 2})
    specs = psf.moe_stash_specs("block0", params, tokens=T, top_k=K, cfg=cfg)
    with pytest.raises(ValueError, match=r"names \['blk0'\].*\['block0'\]"):
        psf.init_stash_state(specs, cfg)


def a_name_only_one_rank_has(rank, world):
    """Rank 1's config names a layer the loss does not call: both ranks refuse at init (the
    other one would otherwise wait in the next exchange)."""
    import torch.distributed as dist
    g = torch.Generator().manual_seed(0)
    params = psf.shard_experts(psf.moe_init(E, H, F, generator=g, dtype=torch.float64),
                               dist.group.WORLD)

    def loss(p, batch):
        return psf.moe(p, batch["x"], top_k=K, group=dist.group.WORLD).square().mean()

    cfg = psf.StashConfig(capacity_factor=1.25,
                          layer_factors={"moe7": 2.0} if rank == 1 else {})
    try:
        psf.stash_aware(loss, cfg).init(params, {"x": torch.randn(T, H, dtype=torch.float64)})
    except ValueError as err:
        return str(err)
    return "not refused"


def test_a_name_only_one_rank_has_is_refused_on_every_rank():
    from worlds import spawn_world
    first, second = spawn_world(2, [a_name_only_one_rank_has])["a_name_only_one_rank_has"]
    assert "rank 1 refused step.init's layer_factors" in first, first
    assert "layer_factors names ['moe7']" in second, second


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
    """Profiled over 40 steps, one skewed layer and one even: each layer goes down from the
    one factor while the steps any layer would overflow stay within the target's share, so
    rerunning the same steps with them reruns at most that share, where the one-factor
    advice would give the even layer the skewed one's budget."""
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
    assert sum(any(worst[n][s] > per[n] for n in per) for s in range(40)) <= 0.1 * 40
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


def test_per_layer_advice_never_exceeds_the_one_factor():
    """Layers that skew on the same steps: a factor each at target / L would be stricter
    than the one factor; lowered from it, none is above it, and the target still holds."""
    import random
    rng = random.Random(0)
    for trial in range(200):
        prof, layers = psf.RoutingProfile(), rng.randint(1, 4)
        n = rng.randint(1, 30)
        for s in range(n):
            base = rng.uniform(1.0, 2.0)
            prof.add(_ratio_report([min(2.0, base + rng.uniform(0, 0.2) * (i % 2))
                                    for i in range(layers)]))
        target = rng.choice([0.0, 0.05, 0.1, 0.3])
        advice = prof.recommend(target, per_layer=True)
        per, one = advice["layer_factors"], advice["capacity_factor"]
        assert all(f <= one for f in per.values()), (trial, per, one)
        worst = {name: {} for name in per}
        for r in prof.records:
            worst[r["layer"]][r["step"]] = max(worst[r["layer"]].get(r["step"], 0),
                                               r["load_ratio"])
        missed = sum(any(worst[m][s] > per[m] for m in per) for s in range(n))
        assert missed <= math.floor(target * n), (trial, missed)


def _ratio_report(ratios):
    """A report whose layer ``i``'s busier of two ranks carries ``ratios[i]`` (in [1, 2]) of
    the balanced load."""
    return two_rank_report(ratios, T * K)
