"""The opt-in float8 stash of the activation input: quantised per row, its pages (or the
buffer kept whole) hold half the bytes, and gradients stay within float8's rounding of the
exact path's."""

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import CPU_BACKENDS

import pagedstash_func as psf
from pagedstash_func.experts._experts import dequantize_rows, quantize_rows

E, H, F, K, T = 8, 32, 48, 2, 64


def _loss(params, x):
    h = x
    for p in params:
        h = h + psf.moe(p, h, top_k=K)
    return h.square().mean()


@pytest.mark.parametrize("scope,cuda_factor", [("state", 1.1), ("layer", 1.1), ("layer", 0.6)])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fp8_stash_gradients_are_close_to_the_exact_path(scope, cuda_factor, backend):
    """A shared pool and a pool of the layer's own page the float8 rows; a pool of its own
    that holds the whole buffer (cuda_factor 1.1) keeps the float8 buffer instead; 0.6 pages
    into a smaller pool of its own (with padding so that it fits)."""
    g = torch.Generator().manual_seed(0)
    params = [psf.moe_init(E, H, F, generator=g) for _ in range(2)]
    x = torch.randn(T, H, generator=g)
    cfg = psf.StashConfig(capacity_factor=2.0, paged_stash=True, page_size=8, expert_ranks=2,
                          pool_scope=scope, cuda_factor=cuda_factor, stash_precision="fp8",
                          backend=backend)

    def loss(params, x):
        h = x
        for p in params:
            ids, w = psf.route(p["router"], h, K)
            if cuda_factor < 1:       # half the tokens are padding: 0.6 of T*k rows fit
                ids = torch.where((torch.arange(T) % 2 == 0)[:, None], -1, ids)
            h = h + psf.moe(p, h, top_k=K, routing=(ids, w))
        return h.square().mean()

    step = psf.stash_aware(loss, cfg)
    state = step.init(params, x)
    assert any(lay.dtype == torch.uint8 for lay in state.layouts) or state.layer_pools
    res = psf.run_step(step, params, x, state)
    assert not res.report.reran and not res.report.overflow
    exact = torch.func.grad(loss)(params, x)
    for got, want in zip(pytree.tree_leaves(res.grads), pytree.tree_leaves(exact)):
        err = (got - want).norm() / want.norm()
        assert 0 < err < 0.06            # lossy: float8 keeps 3 mantissa bits an entry
    plain = psf.stash_aware(loss, psf.StashConfig(
        capacity_factor=2.0, paged_stash=True, page_size=8, expert_ranks=2, pool_scope=scope,
        cuda_factor=cuda_factor, backend=backend))
    with pytest.raises(ValueError, match="stash_precision='same' but the state was built"):
        psf.run_step(plain, params, x, step.init(params, x))
    same = psf.run_step(plain, params, x, plain.init(params, x))
    torch.testing.assert_close(res.loss, same.loss, rtol=0, atol=0)   # forward untouched
    assert all(v["cuda_used"] == 0 for v in psf.pages_in_use(res.state).values())


def test_quantize_rows_round_trip_and_skip_the_unwritten_rows():
    t = torch.randn(10, 16) * torch.logspace(-3, 3, 10)[:, None]
    t[7:] = float("nan")                       # rows past n: never written
    q, scale = quantize_rows(t, torch.tensor([7]))
    back = dequantize_rows(q, scale, torch.float32)
    assert torch.isfinite(back).all() and (back[7:] == 0).all() and (scale[7:] == 1).all()
    rel = ((back[:7] - t[:7]).abs() / t[:7].abs().amax(dim=1, keepdim=True)).max()
    assert rel < 2 ** -4                       # e4m3: 3 mantissa bits, per-row scale
    zero, s0 = quantize_rows(torch.zeros(3, 4), torch.tensor([3]))
    assert (dequantize_rows(zero, s0, torch.float32) == 0).all()
    tiny = torch.tensor([[1e-44, 0.0, -1e-44, 0.0]])       # amax / 448 underflows in fp32
    q, s1 = quantize_rows(tiny, torch.tensor([1]))
    back = dequantize_rows(q, s1, torch.float32)
    assert torch.isfinite(back).all() and (back[0, 1] == 0) and (back[0, 3] == 0)


def test_fp8_needs_the_stash():
    with pytest.raises(ValueError, match="paged_stash=True"):
        psf.StashConfig(capacity_factor=1.25, stash_precision="fp8")
    with pytest.raises(ValueError, match="stash_precision must be"):
        psf.StashConfig(capacity_factor=1.25, paged_stash=True, stash_precision="int4")
