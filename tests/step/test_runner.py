"""run_step: one flag read, one rerun, statistics once, replay bit for bit, the profiler."""

import os

import re

import pytest
import torch
import torch.utils._pytree as pytree
import skewed_stack
from skewed_stack import E, H, F, K, T, loss_fn

import pagedstash_func as psf

def make(seed=0, layers=2):
    return skewed_stack.make(seed, layers, torch.float64)


def exact(params, batch):
    return torch.func.grad_and_value(loss_fn, has_aux=True)(params, batch)


def assert_equal_to_exact(res, params, batch, tol=1e-12):
    grads, (loss, aux) = exact(params, batch)
    torch.testing.assert_close(res.loss, loss, rtol=tol, atol=tol)
    torch.testing.assert_close(res.aux["mean"], aux["mean"], rtol=tol, atol=tol)
    for a, b in zip(pytree.tree_leaves(res.grads), pytree.tree_leaves(grads)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def routed_counts(params, batch, layer):
    """Independent count of pairs per expert for one layer (replays the routing by hand)."""
    x = batch["x"]
    for i, p in enumerate(params):
        h = torch.tanh(x)
        probs = torch.softmax(h @ p["router"].T + batch["skew"], -1)
        w, ids = probs.topk(K, -1)
        if i == layer:
            return torch.bincount(ids.reshape(-1), minlength=E).tolist()
        x = x + psf.moe(p, h, top_k=K, routing=(ids, w / w.sum(-1, keepdim=True)))


def test_ample_capacity_no_rerun():
    params, batch = make()
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=4.0, paged_stash=True,
                                                    page_size=8, expert_ranks=2))
    res = psf.run_step(step, params, batch, step.init(params, batch))
    assert not res.report.reran and res.report.reasons == []
    assert_equal_to_exact(res, params, batch)
    assert res.report.pages_needed == {k: 2 * -(-T * K // 8)
                                       for k in res.report.pages_needed}


def test_forced_over_budget_reruns_exactly_and_counts_once():
    params, batch = make()
    batch["skew"][:2] = 30.0                     # experts 0, 1 (rank 0 of 4) take everything
    cfg = psf.StashConfig(capacity_factor=1.5, paged_stash=True, page_size=8, expert_ranks=4)
    step = psf.stash_aware(loss_fn, cfg)
    res = psf.run_step(step, params, batch, step.init(params, batch))
    assert res.report.reran and res.report.over_budget and not res.report.overflow
    assert res.report.reasons == ["over_budget"]
    assert_equal_to_exact(res, params, batch)
    for layer in (0, 1):
        assert list(res.report.layers[layer].expert_load) == routed_counts(params, batch, layer)
    assert res.report.layers[0].rank_load[0] == T * K
    # The next state starts clean: no sticky flags, no statistics carried over.
    assert not any(psf.read_flags(res.state).values())
    assert all(not v.any() for v in res.state.counts.values())
    res2 = psf.run_step(step, params, batch, res.state)
    assert res2.report.layers[0].expert_load == res.report.layers[0].expert_load


def test_work_handed_to_the_flag_read_runs_once_before_the_flags_are_read(monkeypatch):
    """``attempt_step(..., while_waiting=f)``: ``f`` sees the attempt's own state (its flags
    still as the attempt left them, the report's over_budget among them) once, before the
    one host read of the flags, and the step is the step without it."""
    from pagedstash_func.step import _runner
    params, batch = make()
    batch["skew"][:2] = 30.0
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=1.5, paged_stash=True,
                                                    page_size=8, expert_ranks=4))
    events, read = [], _runner._to_host

    def to_host(values, while_waiting=None):
        events.append("read launched")
        out = read(values, while_waiting)
        events.append("read done")
        return out
    monkeypatch.setattr(_runner, "_to_host", to_host)
    seen = []
    res = _runner.attempt_step(step, params, batch, step.init(params, batch), rerun=False,
                               while_waiting=lambda s: (seen.append((s, s.consumed,
                                                                     psf.read_flags(s))),
                                                        events.append("f")))
    assert events == ["read launched", "f", "read done"]
    (state, consumed, flags), = seen
    assert isinstance(state, psf.StashState) and not consumed
    assert flags["over_budget"] and res.report.over_budget
    again = psf.run_step(step, params, batch, step.init(params, batch))
    assert again.report.layers == res.report.layers


def test_forced_overflow_reruns_exactly():
    params, batch = make()
    cfg = psf.StashConfig(capacity_factor=4.0, paged_stash=True, page_size=8, cuda_factor=0.2)
    step = psf.stash_aware(loss_fn, cfg)
    res = psf.run_step(step, params, batch, step.init(params, batch))
    assert res.report.reran and res.report.overflow and not res.report.over_budget
    assert not res.report.host_spill
    assert_equal_to_exact(res, params, batch)
    assert all(v["cuda_used"] == 0 for v in psf.pages_in_use(res.state).values())


def test_host_spill_without_rerun():
    params, batch = make()
    cfg = psf.StashConfig(capacity_factor=4.0, paged_stash=True, page_size=8, cuda_factor=0.2,
                          host_factor=2.0)
    step = psf.stash_aware(loss_fn, cfg)
    res = psf.run_step(step, params, batch, step.init(params, batch))
    assert not res.report.reran and res.report.host_spill and not res.report.overflow
    assert_equal_to_exact(res, params, batch)


def test_bad_routing_id_on_the_capacity_path_raises_with_the_id():
    params, batch = make(layers=1)

    def bad_loss(params, batch):
        ids = torch.zeros(T, K, dtype=torch.int64)
        ids[7, 1] = E + 3
        y = psf.moe(params[0], batch["x"], top_k=K,
                    routing=(ids, torch.ones(T, K, dtype=torch.float64)))
        return y.pow(2).mean()

    step = psf.stash_aware(bad_loss, psf.StashConfig(capacity_factor=2.0))
    with pytest.raises(ValueError, match=f"routing id {E + 3} at position \\(7, 1\\)"):
        step.init(params, batch)         # init runs the exact path: the same error
    cap = psf.capacity_rows(T, K, step.cfg)
    state = psf.init_stash_state([], step.cfg, counts={}, layers=(psf.LayerInfo(
        "moe0", T, K, E, H, F, torch.float64, 1, cap.rows, T * K, T * K, budget=cap.budget),))
    with pytest.raises(ValueError, match=f"routing id {E + 3} at position \\(7, 1\\)"):
        psf.run_step(step, params, batch, state)


def test_run_step_twice_and_replay_are_bit_for_bit(tmp_path):
    params, batch = make(seed=3)
    batch["skew"][5] = 3.0
    cfg = psf.StashConfig(capacity_factor=1.2, paged_stash=True, page_size=8, expert_ranks=2,
                          host_factor=0.5, cuda_factor=0.6)
    step = psf.stash_aware(loss_fn, cfg)
    state = step.init(params, batch)
    path = tmp_path / "step.pt"
    psf.save_step(path, step, params, batch, state)
    twin = state.clone()
    results = [psf.run_step(step, params, batch, state), psf.run_step(step, params, batch, twin),
               psf.replay_step(path, loss_fn)]
    first = results[0]
    for other in results[1:]:
        assert torch.equal(first.loss, other.loss)
        for a, b in zip(pytree.tree_leaves((first.grads, first.aux)),
                        pytree.tree_leaves((other.grads, other.aux))):
            assert torch.equal(a, b)
        for a, b in zip(pytree.tree_leaves(first.state)[1:],
                        pytree.tree_leaves(other.state)[1:]):
            # pools hold whatever the last pages held: compare the bookkeeping, not garbage
            if a.dtype == torch.int32 or a.dtype == torch.int64:
                assert torch.equal(a, b)
        assert first.report == other.report


def test_profile_recommends_quantiles():
    prof = psf.RoutingProfile()
    for loads in ([10, 10], [14, 6], [12, 8], [18, 2]):     # balanced reference 10 per rank
        layer = psf.LayerReport("moe0", tuple(loads), tuple(loads), rows=15, balanced_rows=20,
                                budget=12, capacity=20)
        prof.add(psf.StepReport(False, False, False, False, (layer,), {}, {}, 0, 0))
    assert [round(s["max_load_ratio"], 6) for s in prof.steps] == [1.0, 1.4, 1.2, 1.8]
    # cuda advice counts the 20 non-padding pairs before any drop (not the 15 rows placed)
    assert prof.recommend(0.0) == {"capacity_factor": 1.8, "cuda_factor": 1.0}
    assert prof.recommend(0.25)["capacity_factor"] == 1.4
    assert prof.recommend(0.5)["capacity_factor"] == 1.2
    assert "target rerun rate" in prof.table()
    assert layer.expert_imbalance == 1.8 and layer.expert_load_ratio == (1.8, 0.2)
    assert [r["expert_imbalance"] for r in prof.records[::2]] == [1.0, 1.4, 1.2, 1.8]
    assert re.search(r"moe0 .* 1\.35 +1\.80$", prof.table(), re.M)     # mean and worst
    with pytest.raises(ValueError, match="no steps"):
        psf.RoutingProfile().recommend()


@pytest.mark.parametrize("tokens", [0, 1])
def test_zero_and_one_token_steps(tokens):
    params = psf.moe_init(E, H, F, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(4))
    batch = {"x": torch.randn(tokens, H, dtype=torch.float64)}

    def one_layer(p, batch):
        return psf.moe(p, batch["x"], top_k=K).sum()

    step = psf.stash_aware(one_layer, psf.StashConfig(capacity_factor=1.0, paged_stash=True,
                                                      page_size=4, expert_ranks=2))
    res = psf.run_step(step, params, batch, step.init(params, batch))
    grads, loss = torch.func.grad_and_value(one_layer)(params, batch)
    assert not res.report.reran
    torch.testing.assert_close(res.loss, loss, rtol=1e-12, atol=1e-12)
    for name in grads:
        torch.testing.assert_close(res.grads[name], grads[name], rtol=1e-12, atol=1e-12)


def test_advice_rounds_up():
    prof = psf.RoutingProfile()
    layer = psf.LayerReport("moe0", (40, 20), (40, 20), rows=60, balanced_rows=60, budget=32,
                            capacity=64)                  # rank 0: 40 / 30 = 1.3333...
    prof.add(psf.StepReport(False, False, False, False, (layer,), {}, {}, 0, 0))
    assert prof.recommend(0.0)["capacity_factor"] == 1.334     # nearest would say 1.333


def test_advice_for_zero_reruns_gives_zero_reruns_on_the_profiled_steps():
    params, batch = make(seed=5)
    batch["skew"][2] = 2.0                      # expert 2 busy: the first config reruns
    cfg = psf.StashConfig(capacity_factor=1.0, paged_stash=True, page_size=4, expert_ranks=4,
                          cuda_factor=0.5)
    seeds = range(6)

    def run(cfg):
        step = psf.stash_aware(loss_fn, cfg)
        prof, reruns = psf.RoutingProfile(), 0
        for seed in seeds:
            b = dict(batch, x=torch.randn(T, H, dtype=torch.float64,
                                          generator=torch.Generator().manual_seed(seed)))
            res = psf.run_step(step, params, b, step.init(params, b))
            prof.add(res.report)
            reruns += res.report.reran
        return prof, reruns

    prof, reruns = run(cfg)
    assert reruns > 0
    advice = prof.recommend(0.0)
    _, reruns_after = run(psf.StashConfig(capacity_factor=advice["capacity_factor"],
                                          paged_stash=True, page_size=4, expert_ranks=4,
                                          cuda_factor=advice["cuda_factor"]))
    assert reruns_after == 0, advice


# ----------------------------------------------------------------------------- property test

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# CPU tensors: the Triton kernels run there only under the interpreter (set when CUDA is absent)
BACKENDS = ["torch", "torch", "triton"] if os.environ.get("TRITON_INTERPRET") == "1" \
    else ["torch"]


@st.composite
def configurations(draw):
    experts = draw(st.sampled_from([2, 4, 6, 8]))
    ranks = draw(st.sampled_from([r for r in (1, 2, 3, 4) if experts % r == 0]))
    return dict(
        experts=experts, ranks=ranks, top_k=draw(st.integers(1, min(3, experts))),
        tokens=draw(st.sampled_from([0, 1, 5, 17, 40])),
        capacity_factor=draw(st.floats(0.3, 3.0)), page_size=draw(st.sampled_from([1, 3, 8, 64])),
        cuda_factor=draw(st.sampled_from([-1.5, 0.0, 0.3, 1.1])),
        host_factor=draw(st.sampled_from([0.0, 0.5, -1.0])),
        pad=draw(st.sampled_from([0.0, 0.3])), stash=draw(st.booleans()),
        backend=draw(st.sampled_from(BACKENDS)), seed=draw(st.integers(0, 9)))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(c=configurations())
def test_run_step_equals_the_exact_path_and_frees_every_page(c):
    g = torch.Generator().manual_seed(c["seed"])
    params = psf.moe_init(c["experts"], 8, 6, generator=g, dtype=torch.float64)
    x = torch.randn(c["tokens"], 8, generator=g, dtype=torch.float64)
    pad = torch.rand(c["tokens"], generator=g) < c["pad"]
    batch = {"x": x, "pad": pad}

    def loss(p, b):
        ids, w = psf.route(p["router"], b["x"], c["top_k"])
        ids = torch.where(b["pad"][:, None], -1, ids)
        y = psf.moe(p, b["x"], top_k=c["top_k"], routing=(ids, w))
        return (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape)).sum()

    cfg = psf.StashConfig(capacity_factor=c["capacity_factor"], paged_stash=c["stash"],
                          page_size=c["page_size"], cuda_factor=c["cuda_factor"],
                          host_factor=c["host_factor"], expert_ranks=c["ranks"],
                          backend=c["backend"])
    step = psf.stash_aware(loss, cfg)
    res = psf.run_step(step, params, batch, step.init(params, batch))
    grads, value = torch.func.grad_and_value(loss)(params, batch)
    torch.testing.assert_close(res.loss, value, rtol=1e-10, atol=1e-10)
    for n in grads:
        torch.testing.assert_close(res.grads[n], grads[n], rtol=1e-10, atol=1e-10)
    assert all(v["cuda_used"] == 0 and v["host_used"] == 0
               for v in psf.pages_in_use(res.state).values())
