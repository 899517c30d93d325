"""torch.compile over a capacity attempt: without the stash it traces whole (no graph break)
and gives eager's numbers; with the stash it still gives them, through graph breaks (its
pages' host-side bookkeeping is not traced yet); vmap and forward-mode AD are refused by
psf's own message at the layer's entry, not by methods that would keep Dynamo out."""

import pytest
import torch

import pagedstash_func as psf

E, H, F, K, T = 8, 16, 24, 2, 32


def _setup(cf, stash):
    g = torch.Generator().manual_seed(0)
    params = [{k: v.requires_grad_() for k, v in psf.moe_init(E, H, F, generator=g).items()}
              for _ in range(2)]
    batch = {"x": torch.randn(T, H, generator=g)}

    def loss_fn(params, batch):
        x = batch["x"]
        for p in params:
            x = x + psf.moe(p, torch.tanh(x), top_k=K)
        return x.square().mean()
    cfg = psf.StashConfig(capacity_factor=cf, paged_stash=stash, page_size=8, expert_ranks=2)
    return params, batch, psf.stash_aware(loss_fn, cfg)


def _run(attempt, params, batch, step):
    loss, state = attempt(params, batch, step.init(params, batch))
    leaves = [v for p in params for v in p.values()]
    return loss, torch.autograd.grad(loss, leaves), state


@pytest.mark.parametrize("cf", [2.0, 0.5])          # 0.5: pairs dropped, over_budget raised
def test_a_capacity_attempt_without_the_stash_traces_whole_and_equals_eager(cf):
    torch._dynamo.reset()
    params, batch, step = _setup(cf, stash=False)
    state = step.init(params, batch)
    explained = torch._dynamo.explain(step.attempt)(params, batch, state)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    eager = _run(step.attempt, params, batch, step)
    compiled = _run(torch.compile(step.attempt, fullgraph=True, backend="aot_eager"),
                    params, batch, step)
    # the grouped matmul traces as one batched product a row (not eager's loop over groups):
    # the same sums in another order, so fp32 rounding apart
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-7)
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert torch.equal(compiled[2].flags, eager[2].flags)
    assert bool(eager[2].flags[2]) == (cf < 1)                   # over_budget
    for name, count in eager[2].counts.items():
        assert torch.equal(compiled[2].counts[name], count), name


def test_the_stash_under_compile_gives_eagers_numbers_and_frees_its_pages():
    torch._dynamo.reset()
    params, batch, step = _setup(2.0, stash=True)
    eager = _run(step.attempt, params, batch, step)
    compiled = _run(torch.compile(step.attempt, backend="aot_eager"), params, batch, step)
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    assert all(v["cuda_used"] == 0 for v in psf.pages_in_use(compiled[2]).values())


def test_compiled_evaluation_without_gradients_and_refused_transforms():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    p = psf.moe_init(E, H, F, generator=g)
    x = torch.randn(T, H, generator=g)
    with torch.no_grad():
        out = torch.compile(lambda p, x: psf.moe(p, x, top_k=K), backend="aot_eager")(p, x)
    torch.testing.assert_close(out, psf.moe(p, x, top_k=K), rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError, match="psf.moe does not support vmap"):
        torch.func.vmap(lambda x: psf.moe(p, x, top_k=K))(torch.randn(2, T, H))
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda x: psf.moe(p, x, top_k=K), (x,), (x,))
    import torch.autograd.forward_ad as fwad
    with fwad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        psf.moe(p, fwad.make_dual(x, torch.ones_like(x)), top_k=K)
