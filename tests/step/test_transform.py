"""stash_aware: the transformed step against the plain loss, under torch.func transforms."""

import pytest
import torch
import torch.utils._pytree as pytree

import pagedstash_func as psf

E, H, F, K, T = 8, 16, 24, 2, 40


def make(layers=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [psf.moe_init(E, H, F, generator=g, dtype=torch.float64) for _ in range(layers)]
    batch = {"x": torch.randn(T, H, generator=g, dtype=torch.float64)}
    return params, batch


def loss_fn(params, batch):
    x = batch["x"]
    for p in params:
        x = x + psf.moe(p, torch.tanh(x), top_k=K)
    return (x ** 2).mean()


def loss_with_aux(params, batch):
    loss = loss_fn(params, batch)
    return loss, {"half": loss / 2}


def close(a, b, tol=1e-12):
    for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


@pytest.mark.parametrize("stash", [False, True])
def test_grad_of_step_equals_grad_of_loss(stash):
    params, batch = make()
    cfg = psf.StashConfig(capacity_factor=float(E), paged_stash=stash, page_size=8,
                          expert_ranks=2)
    step = psf.stash_aware(loss_fn, cfg)
    state = step.init(params, batch)
    assert [info.name for info in state.layers] == ["moe0", "moe1", "moe2"]
    grads, (loss, state) = torch.func.grad_and_value(step, has_aux=True)(params, batch, state)
    ref_grads, ref_loss = torch.func.grad_and_value(loss_fn)(params, batch)
    close(loss, ref_loss)
    close(grads, ref_grads)
    assert not any(psf.read_flags(state).values())
    assert all(v["cuda_used"] == 0 for v in psf.pages_in_use(state).values())
    g2, state = torch.func.grad(step, has_aux=True)(params, batch, state)   # threads on
    close(g2, ref_grads)


def test_aux_output_and_vjp():
    params, batch = make(layers=2)
    cfg = psf.StashConfig(capacity_factor=4.0, paged_stash=True, page_size=8)
    step = psf.stash_aware(loss_with_aux, cfg)
    state = step.init(params, batch)
    loss, (aux, state) = step(params, batch, state)
    torch.testing.assert_close(aux["half"], loss / 2)
    # A call without gradients stashes nothing, so it holds no pages afterwards.
    assert all(v["cuda_used"] == 0 for v in psf.pages_in_use(state).values())
    loss_v, pullback, (aux_v, state) = torch.func.vjp(
        lambda p: step(p, batch, state), params, has_aux=True)
    assert sum(v["cuda_used"] for v in psf.pages_in_use(state).values()) > 0
    (g,) = pullback(torch.ones((), dtype=torch.float64))
    assert all(v["cuda_used"] == 0 for v in psf.pages_in_use(state).values())
    close(g, torch.func.grad(lambda p: loss_with_aux(p, batch)[0])(params))


def test_functional_call_over_a_module():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            p = psf.moe_init(E, H, F, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(1))
            self.router = torch.nn.Parameter(p["router"])
            self.w_gate_up = torch.nn.Parameter(p["w_gate_up"])
            self.w_down = torch.nn.Parameter(p["w_down"])

        def forward(self, x):
            return x + psf.moe({"router": self.router, "w_gate_up": self.w_gate_up,
                                "w_down": self.w_down}, x, top_k=K)

    module = Block()
    params = {k: v.detach() for k, v in module.named_parameters()}
    batch = {"x": torch.randn(T, H, dtype=torch.float64)}

    def module_loss(params, batch):
        return torch.func.functional_call(module, params, (batch["x"],)).pow(2).mean()

    step = psf.stash_aware(module_loss, psf.StashConfig(capacity_factor=3.0, paged_stash=True,
                                                        page_size=8))
    state = step.init(params, batch)
    grads, state = torch.func.grad(step, has_aux=True)(params, batch, state)
    close(grads, torch.func.grad(module_loss)(params, batch))


def test_consumed_state_is_refused():
    params, batch = make(layers=1)
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=2.0, paged_stash=True))
    state = step.init(params, batch)
    _, new_state = step(params, batch, state)
    with pytest.raises(psf.ConsumedStateError, match="loss, state = step"):
        step(params, batch, state)
    with pytest.raises(psf.ConsumedStateError):
        psf.run_step(step, params, batch, state)
    step(params, batch, new_state)            # the returned one is live


def test_layer_count_and_shape_mismatch():
    params, batch = make(layers=2)
    step = psf.stash_aware(loss_fn, psf.StashConfig(capacity_factor=2.0))
    state = step.init(params, batch)
    with pytest.raises(ValueError, match="more often"):
        step(params + params[:1], batch, state)
    state = step.init(params, batch)
    with pytest.raises(ValueError, match="built for 2 calls"):
        step(params[:1], batch, state)
    state = step.init(params, batch)
    with pytest.raises(ValueError, match=r"tokens 20 \(state: 40\)"):
        step(params, {"x": batch["x"][:20]}, state)
    with pytest.raises(TypeError, match="StashState from step.init"):
        step(params, batch, None)
    with pytest.raises(ValueError, match="callable"):
        psf.stash_aware(42, psf.StashConfig())


def test_without_capacity_the_step_is_the_exact_loss():
    params, batch = make(layers=2)
    step = psf.stash_aware(loss_fn, psf.StashConfig())
    state = step.init(params, batch)
    loss, state = step(params, batch, state)
    torch.testing.assert_close(loss, loss_fn(params, batch), rtol=0, atol=0)


def test_negative_cuda_factor_sizes_from_the_profiling_pass():
    params, batch = make(layers=1)
    cfg = psf.StashConfig(capacity_factor=2.0, paged_stash=True, page_size=8, cuda_factor=-1.0)
    state = psf.stash_aware(loss_fn, cfg).init(params, batch)
    assert state.layers[0].observed_rows == T * K
    for lay in state.layouts:
        assert lay.cuda_pages == -(-T * K // 8) + 1
